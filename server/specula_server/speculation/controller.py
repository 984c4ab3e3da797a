"""How many draft tokens each request verifies in a step.

`fixed` verifies every available draft token up to the maximum. `adaptive` (the default) maximises expected
emitted tokens per second of forward time, using two measured quantities:

- per request, the probability `a` that a draft token is accepted given the ones before it were. Verification
  is a run of trials that stops at the first rejection: accepting m of k drafts is m successes and, when
  m < k, one failure. `a` is the smoothed ratio of recent successes to trials, (S + 2p) / (S + F + 2), with
  S and F decayed each drafting step; the prior p is the drafting method's recent acceptance over all
  requests (0.5 before it has any). Counting trials this way, and not
  averaging m / k, matters for copying: a block copied in full after one mismatch is 6 successes, 1 failure
  (a = 0.86), where the ratio average would have had "0 of 6" drag it to 0.4. With k drafts a request emits
  on average `E(k) = 1 + a + a^2 + ... + a^k` tokens (the last one being the target's own token);
- the cost of a forward over S sequences and N tokens, `T(S, N) = t0 + ts * S + tn * N`, fitted online from
  the worker's own steps and calibration forwards. A draft adds a token, not a sequence: it costs `tn`.
  Decode on a memory-bound device has tn << t0 (extra tokens are nearly free); on a compute-bound one tn is
  what limits drafting, while `ts` (attention over each sequence's context, its sampling) grows the step
  without making drafts any dearer;
- what verifying drafts costs beyond a plain forward over as many tokens, `V(d) = v0 + v1 * d` for d drafts in
  the step: a fixed part (the verification path's bookkeeping, masks, a drafter's own setup) and a part per
  draft (attention of each draft row over its whole context, per-row sampling and checks, a draft model's
  forwards). It is fitted on the steps that verify, by recency-weighted least squares over their draft counts.
  Calibration forwards are single sequences whose extra tokens are nearly free, so without this term a draft
  looks several times cheaper than it is on a batch with long contexts.

Starting from k = 0 for everyone, draft tokens are granted one at a time to the request with the largest
marginal gain `a^(k+1)` while that gain per unit of extra cost (`tn + v1` per draft) beats the current
goodput `sum E / (T(S, S + d) + V(d))`. If the chosen drafts do not beat a plain step once `v0` is paid, none
are verified. With nothing to copy (no drafts or low acceptance) this grants nothing, so speculation can never
cost more than the drafting itself; under load the bar rises with the batch's share of per-token work and
drafts are trimmed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

ACCEPTANCE_DECAY = 0.8  # per drafting step, the weight of earlier trials in the acceptance estimate
OVERHEAD_DECAY = 0.98  # per declined step, the fraction of the verification cost estimate kept
MAX_EXTRA_STEPS = 4.0  # a step's time counts as at most this many plain forwards more than predicted (pauses)
PRIOR_DECAY = 0.98  # per verified request, the weight of earlier ones in a method's acceptance prior
RETRY_DRIFT = 0.02  # per step without drafts, the fraction of the evidence forgotten (back toward the prior)


@dataclass
class AcceptanceEstimate:
    """A request's draft acceptance `a`: decayed counts of accepted drafts (S) and rejections (F)."""

    successes: float = 0.0
    failures: float = 0.0

    @property
    def value(self) -> float:
        return self.estimate(0.5)

    def estimate(self, prior: float) -> float:
        """`a` with `prior` as the value before any evidence (weighted as two trials)."""
        return (self.successes + 2.0 * prior) / (self.successes + self.failures + 2.0)

    def observe(self, drafted: int, accepted: int, decay: float = ACCEPTANCE_DECAY) -> None:
        """One step's verification: `accepted` of `drafted` drafts, earlier evidence weighted by `decay` (0
        drafted: no evidence, the estimate drifts back toward the prior so a request that stopped drafting
        tries again later)."""
        if drafted == 0:
            self.successes *= 1 - RETRY_DRIFT
            self.failures *= 1 - RETRY_DRIFT
            return
        self.successes = decay * self.successes + accepted
        self.failures = decay * self.failures + (accepted < drafted)


@dataclass
class AcceptancePriors:
    """Per drafting method, the acceptance of recent verifications across all requests: the prior of a request
    with little evidence of its own (a new one, or one whose evidence faded while it did not draft). With 0.5
    as every request's prior, requests with nothing to copy kept coming back to try drafts that do not pay;
    with the method's own record they start, and return to, what that method has recently achieved here."""

    decay: float = PRIOR_DECAY
    _methods: dict[str, AcceptanceEstimate] = field(default_factory=dict)

    def value(self, method: str) -> float:
        estimate = self._methods.get(method)
        return estimate.value if estimate is not None else 0.5

    def observe(self, method: str, drafted: int, accepted: int) -> None:
        if drafted:  # a method's record only changes when it drafts
            self._methods.setdefault(method, AcceptanceEstimate()).observe(drafted, accepted, self.decay)


FEATURES = 5  # a step's cost is linear in (1, sequences, tokens, verifies, drafts)
T0, TS, TN, V0, V1 = range(FEATURES)


@dataclass
class StepCostModel:
    """What a step costs, fitted by least squares on the worker's own steps:

        T(S, N) = t0 + ts * S + tn * N           a forward over S sequences and N tokens
        V(d)    = v0 + v1 * d                     more, when it verifies d drafts

    Two costs grow differently with a batch. Per sequence (`ts`): reading its context's keys and values,
    attending over them, sampling its token, the bookkeeping of a request. Per token (`tn`): the matrix
    products. Drafts add tokens, not sequences, so a draft costs `tn + v1`; a model in N alone charges them
    the per-sequence cost too, which at batch 32 on the demo model (where attention over the contexts is half
    of a step) made drafts look several times dearer than they are. `V` is what verifying adds besides the
    tokens: a fixed part (the verification inputs, masks, a drafter's setup) and a part per draft (each draft
    row's attention over its whole context, its sampling and checks, a draft model's forwards).

    One fit over all points: anchors, single sequences over a range of N timed once at calibration and never
    forgotten (N varies while S does not: they tell `tn` apart), and the decode steps run, plain or verifying,
    weighted by recency (`decay` per step) so the fit follows the machine's current speed. What the points
    leave undetermined is pinned in turn (`_solve`): no per-sequence cost when S never varies apart from N;
    a token at `prior_ratio` of the fixed cost when N never varies; a fixed verification cost when draft
    counts never vary; none when there is nothing to compare verifying steps with.
    """

    decay: float = 0.95
    prior_ratio: float = 1 / 16
    learning: bool = True  # False: the anchors alone (a fixed cost profile, e.g. for reproducible tests)
    # Weighted sums of x x^T and x T over the points, x = (1, S, N, verifies, drafts).
    _anchors: np.ndarray = field(default_factory=lambda: np.zeros((FEATURES, FEATURES + 1)))
    _recent: np.ndarray = field(default_factory=lambda: np.zeros((FEATURES, FEATURES + 1)))
    _trust: float = 1.0  # scales V; decays on declined steps, back to 1 on a measured one
    _fit: np.ndarray | None = None  # the coefficients, dropped by every new point

    @staticmethod
    def _point(num_sequences: int, num_tokens: int, seconds: float, num_drafts: int | None = None) -> np.ndarray:
        verifies = num_drafts is not None
        x = np.array([1.0, num_sequences, num_tokens, float(verifies), num_drafts or 0.0])
        return np.outer(x, np.append(x, seconds))

    def anchor(self, num_tokens: int, seconds: float) -> None:
        """A forward over one sequence of `num_tokens` tokens took `seconds`."""
        self._anchors += self._point(1, num_tokens, seconds)
        self._fit = None

    def observe(self, num_sequences: int, num_tokens: int, seconds: float) -> None:
        """A step without drafts over `num_sequences` sequences and `num_tokens` tokens took `seconds`."""
        self._add(self._point(num_sequences, num_tokens, self._capped(num_sequences, num_tokens, seconds)))

    def observe_speculative(self, num_sequences: int, num_tokens: int, seconds: float, num_drafts: int) -> None:
        """A step that verified `num_drafts` drafts among `num_tokens` tokens took `seconds`."""
        seconds = self._capped(num_sequences, num_tokens, seconds)
        self._add(self._point(num_sequences, num_tokens, seconds, num_drafts))
        if self.learning:
            self._trust = 1.0

    def _capped(self, num_sequences: int, num_tokens: int, seconds: float) -> float:
        """A step counts as at most a few plain forwards: a pause must not read as a cost."""
        if self._fit is None and not (self._anchors[0, 0] or self._recent[0, 0]):
            return seconds
        return min(seconds, (1 + MAX_EXTRA_STEPS) * self.predict(num_sequences, num_tokens))

    def _add(self, point: np.ndarray) -> None:
        if self.learning:
            self._recent = self.decay * self._recent + point
            self._fit = None

    def declined(self) -> None:
        """A step that could have verified drafts but was judged not worth it. The verification cost is only
        measured on steps that verify, so an estimate left too high would stop speculation for good; it decays
        here until drafting is tried again and measured anew (one probing step in a few dozen, when it truly
        does not pay)."""
        if self.learning:
            self._trust *= OVERHEAD_DECAY

    def _coefficients(self) -> np.ndarray:
        if self._fit is None:
            self._fit = self._solve(self._anchors + self._recent)
        return self._fit

    def coefficients(self) -> tuple[float, float, float]:
        """(t0, ts, tn) in seconds."""
        t0, ts, tn = self._coefficients()[[T0, TS, TN]]
        return float(t0), float(ts), float(tn)

    def verification_cost(self) -> tuple[float, float]:
        """(v0, v1) in seconds: a verifying step costs `v0 + v1 * d` more than a plain forward over as many
        sequences and tokens."""
        v0, v1 = self._coefficients()[[V0, V1]]
        return self._trust * float(v0), self._trust * float(v1)

    @property
    def overhead(self) -> float:
        """The fixed part of the verification cost, in seconds."""
        return self.verification_cost()[0]

    @property
    def token_cost(self) -> float:
        """`tn`: what one more token in a forward costs, in seconds."""
        return self.coefficients()[2]

    def predict(self, num_sequences: int, num_tokens: int) -> float:
        """T(S, N): a plain forward's cost."""
        t0, ts, tn = self.coefficients()
        return t0 + ts * num_sequences + tn * num_tokens

    def _solve(self, sums: np.ndarray) -> np.ndarray:
        gram, moments = sums[:, :FEATURES], sums[:, FEATURES]
        if gram[T0, T0] == 0:
            return np.array([0.02, 0.0, 0.02 * self.prior_ratio, 0.0, 0.0])
        # The coefficients are basis^T z, z fitted on the features basis @ x. Each coefficient the points leave
        # free is pinned in turn: ts to 0 (the cost that grows with the batch is all the tokens'), tn to
        # prior_ratio * t0, v1 to 0 (draft counts that never vary: verifying costs a fixed amount), v0 to 0.
        basis = np.eye(FEATURES)
        for index in (TS, TN, V1, V0):
            if not _undetermined(gram, basis, index):
                continue
            keep = [row for row in basis if not row[index]]
            if index == TN:  # t0's row carries tn along
                keep = [row + self.prior_ratio * np.eye(FEATURES)[TN] if row[T0] else row for row in keep]
            basis = np.array(keep)
        z = _least_squares(basis @ gram @ basis.T, basis @ moments)
        coefficients = basis.T @ z
        coefficients[TN] = max(coefficients[TN], 1e-7)  # a token is never free
        return np.maximum(coefficients, 0.0)


def _scaled(gram: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Gram matrix scaled to a unit diagonal (so features as different as 1 and N = 4096 compare), and
    the scale."""
    scale = 1.0 / np.sqrt(np.maximum(np.diag(gram), 1e-30))
    return gram * np.outer(scale, scale), scale


def _undetermined(gram: np.ndarray, basis: np.ndarray, index: int) -> bool:
    """Whether the points leave coefficient `index` free: some direction the fit on `basis @ x` cannot see
    moves it."""
    scaled, scale = _scaled(basis @ gram @ basis.T)
    values, vectors = np.linalg.eigh(scaled)
    for value, vector in zip(values, vectors.T):
        if value <= 1e-9 * values.max():
            move = basis.T @ (scale * vector)
            if abs(move[index]) > 1e-6 * np.abs(move).max():
                return True
    return False


def _least_squares(gram: np.ndarray, moments: np.ndarray) -> np.ndarray:
    scaled, scale = _scaled(gram)
    return scale * (np.linalg.pinv(scaled, rcond=1e-9) @ (moments * scale))


def drafting_bar(batch_size: int, cost: StepCostModel) -> float:
    """The acceptance a request needs for even one draft token to raise goodput: `B * (tn + v1) / T(B, B)`.

    Requests at or below it skip drafting altogether (their estimate drifts back toward the prior, so they
    try again later)."""
    marginal = cost.token_cost + cost.verification_cost()[1]
    return batch_size * marginal / cost.predict(batch_size, batch_size)


def choose_draft_lengths(
    available: Sequence[int], acceptance: Sequence[float], cost: StepCostModel, mode: str
) -> list[int]:
    """Draft tokens each request verifies; `available[i]` is how many its drafter proposed (already capped)."""
    if mode == "fixed":
        return list(available)
    v0, v1 = cost.verification_cost()
    num_sequences = len(available)
    lengths = [0] * num_sequences
    plain = cost.predict(num_sequences, num_sequences)
    marginal = cost.token_cost + v1  # seconds per verified draft
    num_drafts = 0
    expected = float(num_sequences)  # every request emits at least its own token
    heap = [(-acceptance[i], i) for i in range(num_sequences) if available[i] > 0 and acceptance[i] > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        # Grant one more draft token when expected tokens per second improve.
        before = plain + marginal * num_drafts
        if (expected + gain) / (before + marginal) <= expected / before:
            break
        lengths[i] += 1
        expected += gain
        num_drafts += 1
        if lengths[i] < available[i]:
            heapq.heappush(heap, (-gain * acceptance[i], i))
    # Verifying anything at all has a fixed cost: draft only when the whole step still beats a plain one.
    if num_drafts and expected / (plain + marginal * num_drafts + v0) <= num_sequences / plain:
        return [0] * num_sequences
    return lengths
