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
- the cost of a forward over N tokens, `T(N) = t0 + t1 * N`, fitted online from the worker's own steps.
  Decode on a memory-bound device has t1 << t0 (extra tokens are nearly free); at large batch t1 grows.

- what verifying drafts costs beyond a plain forward over as many tokens, `V(d) = v0 + v1 * d` for d drafts in
  the step: a fixed part (the verification path's bookkeeping, masks, a drafter's own setup) and a part per
  draft (attention of each draft row over its whole context, per-row sampling and checks, a draft model's
  forwards). It is fitted on the steps that verify, by recency-weighted least squares over their draft counts.
  Calibration forwards are single sequences whose extra tokens are nearly free, so without this term a draft
  looks several times cheaper than it is on a batch with long contexts.

Starting from k = 0 for everyone, draft tokens are granted one at a time to the request with the largest
marginal gain `a^(k+1)` while that gain per unit of extra cost (`t1 + v1` per draft) beats the current goodput
`sum E / (T(N) + V(d))`. If the chosen drafts do not beat a plain step once `v0` is paid, none are verified.
With nothing to copy (no drafts or low acceptance) this grants nothing, so speculation can never cost more than
the drafting itself; under load the bar rises with `T(N)` and drafts are trimmed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

ACCEPTANCE_DECAY = 0.8  # per drafting step, the weight of earlier trials in the acceptance estimate
OVERHEAD_DECAY = 0.98  # per declined step, the fraction of the verification cost estimate kept
VERIFY_DECAY = 0.9  # per verifying step, the weight of earlier steps in the verification cost fit
MAX_EXTRA_STEPS = 4.0  # a step's measured verification cost counts as at most this many plain forwards (spikes)
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


@dataclass
class StepCostModel:
    """T(N) = t0 + t1 * N seconds for a forward over N tokens: a least-squares fit.

    Two kinds of points: anchors, measured once at calibration over a range of N and never forgotten, and the
    steps actually run, weighted by recency (`decay` per step) so the fit follows the machine's current speed.
    Decode steps alone all have about the same N and cannot tell the slope; the anchors can. Without anchors
    or spread, an extra token is assumed to cost `prior_ratio` of a step's fixed cost.
    """

    decay: float = 0.95
    prior_ratio: float = 1 / 16
    learning: bool = True  # False: the anchors alone (a fixed cost profile, e.g. for reproducible tests)
    _anchors: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, N, T, N*N, N*T
    _recent: list[float] = field(default_factory=lambda: [0.0] * 5)
    _verify: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, d, V, d*d, d*V
    _trust: float = 1.0  # decays on declined steps, back to 1 on a measured one

    @staticmethod
    def _point(num_tokens: float, seconds: float) -> tuple[float, ...]:
        n = float(num_tokens)
        return 1.0, n, seconds, n * n, n * seconds

    def anchor(self, num_tokens: int, seconds: float) -> None:
        self._anchors = [s + x for s, x in zip(self._anchors, self._point(num_tokens, seconds))]

    def observe(self, num_tokens: int, seconds: float) -> None:
        if not self.learning:
            return
        self._recent = [self.decay * s + x for s, x in zip(self._recent, self._point(num_tokens, seconds))]

    def observe_speculative(self, num_tokens: int, seconds: float, num_drafts: int | None = None) -> None:
        """A step that verified `num_drafts` drafts among `num_tokens` tokens: what it cost beyond a plain
        forward over as many tokens (capped at a few plain forwards, so a pause does not read as a cost)."""
        if not self.learning:
            return
        plain = self.predict(num_tokens)
        extra = min(max(seconds - plain, 0.0), MAX_EXTRA_STEPS * plain)
        drafts = float(num_drafts if num_drafts is not None else num_tokens)
        self._verify = [VERIFY_DECAY * s + x for s, x in zip(self._verify, self._point(drafts, extra))]
        self._trust = 1.0

    def declined(self) -> None:
        """A step that could have verified drafts but was judged not worth it. The verification cost is only
        measured on steps that verify, so an estimate left too high would stop speculation for good; it decays
        here until drafting is tried again and measured anew (one probing step in a few dozen, when it truly
        does not pay)."""
        if self.learning:
            self._trust *= OVERHEAD_DECAY

    def verification_cost(self) -> tuple[float, float]:
        """(v0, v1): a verifying step costs `v0 + v1 * d` seconds more than a plain forward over as many tokens.
        Steps whose draft counts barely vary cannot tell the two apart; then it all counts as fixed."""
        weight, sum_d, sum_v, sum_dd, sum_dv = self._verify
        if weight == 0:
            return 0.0, 0.0
        mean_d, mean_v = sum_d / weight, sum_v / weight
        variance = sum_dd / weight - mean_d**2
        v0, v1 = mean_v, 0.0
        if variance > 0.5:
            v1 = max((sum_dv / weight - mean_d * mean_v) / variance, 0.0)
            v0 = max(mean_v - v1 * mean_d, 0.0)
        return self._trust * v0, self._trust * v1

    @property
    def overhead(self) -> float:
        """The fixed part of the verification cost, in seconds."""
        return self.verification_cost()[0]

    def coefficients(self) -> tuple[float, float]:
        weight, sum_n, sum_t, sum_nn, sum_nt = (a + r for a, r in zip(self._anchors, self._recent))
        if weight == 0:
            return 0.02, 0.02 * self.prior_ratio
        mean_n, mean_t = sum_n / weight, sum_t / weight
        variance = sum_nn / weight - mean_n**2
        if variance > 0.25:
            t1 = max((sum_nt / weight - mean_n * mean_t) / variance, 1e-7)
            return max(mean_t - t1 * mean_n, 1e-6), t1
        t0 = mean_t / (1 + self.prior_ratio * mean_n)
        return t0, t0 * self.prior_ratio

    def predict(self, num_tokens: int) -> float:
        t0, t1 = self.coefficients()
        return t0 + t1 * num_tokens


def drafting_bar(batch_size: int, cost: StepCostModel) -> float:
    """The acceptance a request needs for even one draft token to raise goodput: `B * (t1 + v1) / T(B)`.

    Requests at or below it skip drafting altogether (their estimate drifts back toward the prior, so they
    try again later)."""
    t0, t1 = cost.coefficients()
    v1 = cost.verification_cost()[1]
    return batch_size * (t1 + v1) / (t0 + t1 * batch_size)


def choose_draft_lengths(
    available: Sequence[int], acceptance: Sequence[float], cost: StepCostModel, mode: str
) -> list[int]:
    """Draft tokens each request verifies; `available[i]` is how many its drafter proposed (already capped)."""
    if mode == "fixed":
        return list(available)
    v0, v1 = cost.verification_cost()
    lengths = [0] * len(available)
    num_tokens = len(available)
    num_drafts = 0
    expected = float(len(available))  # every request emits at least its own token
    heap = [(-acceptance[i], i) for i in range(len(available)) if available[i] > 0 and acceptance[i] > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        # Grant one more draft token when expected tokens per second improve.
        before = cost.predict(num_tokens) + v1 * num_drafts
        after = cost.predict(num_tokens + 1) + v1 * (num_drafts + 1)
        if (expected + gain) / after <= expected / before:
            break
        lengths[i] += 1
        expected += gain
        num_tokens += 1
        num_drafts += 1
        if lengths[i] < available[i]:
            heapq.heappush(heap, (-gain * acceptance[i], i))
    # Verifying anything at all has a fixed cost: draft only when the whole step still beats a plain one.
    plain = len(available) / cost.predict(len(available))
    if num_drafts and expected / (cost.predict(num_tokens) + v1 * num_drafts + v0) <= plain:
        return [0] * len(available)
    return lengths
