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
- the cost of a plain decode step over S sequences, `P(S) = p0 + p1 * S`, fitted online from the worker's plain
  decode steps, with the warmup's calibration forwards as the prior;
- what verifying d drafts adds to a step, `V(d) = v0 + c * d`: a fixed part (the verification inputs and masks,
  the per-row sampling set-up, a drafter's own setup) and a part per draft (one more row through the matrix
  products, its attention over a context the step reads anyway, its sampling and checks, a draft model's
  forwards). It is fitted on the steps that verify, by recency-weighted least squares over their draft counts.
  A draft is priced apart from a sequence: at concurrency 32 on the demo model a sequence's share of a plain
  step is six times what a draft adds (attention over its context is the difference).

Starting from k = 0 for everyone, draft tokens are granted one at a time to the request with the largest
marginal gain `a^(k+1)` while that gain per unit of extra cost (`c` per draft) beats the current goodput
`sum E / (P(S) + c * d)`. If the chosen drafts do not beat a plain step once `v0` is paid, none are verified.
With nothing to copy (no drafts or low acceptance) this grants nothing, so speculation can never cost more than
the drafting itself; under load the bar `S * c / P(S)` rises with the batch's share of per-row work and drafts
are trimmed. After repeated declines, drafts are proposed less often (`proposal_backoff`). The expected gains
of a method's drafts are scaled by what its granted drafts were accepted for against what was expected
(`RealizedAcceptance`), which corrects the optimism of granting where noisy estimates are highest.

A model drafter whose chains carry each token's probability (EAGLE-3's) is priced per token instead: the gain of
draft k is the product of the first k tokens' calibrated acceptances (`Acceptance`, `ConfidenceCalibration`), and
whether drafting such chains pays at all, their drafting included, is judged apart (`DraftingSpeedup`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specula_proto.choices import SpeculationMode

ACCEPTANCE_DECAY = 0.8  # per drafting step, the weight of earlier trials in the acceptance estimate
OVERHEAD_DECAY = 0.98  # per declined step, the fraction of the verification cost estimate kept
VERIFY_DECAY = 0.9  # per verifying step, the weight of earlier steps in the verification cost fit
MAX_EXTRA_STEPS = 4.0  # a step's measured verification cost counts as at most this many plain forwards (spikes)
# Once the verification cost has a fit, a step's measured excess counts as at most this many times what the fit
# predicts, plus `OUTLIER_SLACK` of a plain step (a pause of the machine inside one verifying step).
OUTLIER_FACTOR = 2.0
OUTLIER_SLACK = 0.25
PRIOR_DECAY = 0.98  # per verified request, the weight of earlier ones in a method's acceptance prior
MAX_PROPOSAL_BACKOFF = 7  # most plain steps in a row without proposing drafts, after repeated declines...
# ...unless asking costs more: fruitless asks may take `ASK_BUDGET` of the time (`proposal_backoff`)
ASK_BUDGET = 0.005
LONGEST_PROPOSAL_BACKOFF = 63
ASK_COST_DECAY = 0.7  # per fruitless ask of every request, the weight of earlier ones in its measured cost
RETRY_DRIFT = 0.02  # per step without drafts, the fraction of the evidence forgotten (back toward the prior)
STALE_PLAIN = 0.9  # a verifying step faster than this share of P(S) says P was fitted at a heavier load...
STALE_KEEP = 0.1  # ...and the plain steps fitted so far keep this weight beside the next one


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


CONFIDENCE_BINS = 10  # a drafter's confidences are calibrated in bins of this many equal parts of [0, 1]
MIN_CALIBRATION_TRIALS = 2.0  # decayed trials before a bin's record says what confidences can achieve


@dataclass
class ConfidenceCalibration:
    """What drafts of a given confidence are accepted at, per drafting method whose drafts carry one (suffix
    trees: the mean of each step's count ratio along the likeliest path).

    A confidence is the drafter's own guess from counts in its trees; on text the trees have seen it is close,
    on text they have not (a two-token match in a large tree of other outputs) it can be high where drafts are
    rarely accepted. Taking it at its word made every request verify such drafts at every step, a slowdown on
    novel text under load (docs/benchmarks.md#suffix-decoding). Here each tenth of [0, 1] keeps the decayed
    record of the drafts verified with a confidence in it, and a draft counts with what its bin achieved (its
    confidence as the prior, weighted as two trials). `ceiling` is the best any bin achieved lately: when even
    that is below the drafting bar, the drafter is not asked at all (drafting costs time too); the records drift
    back toward the confidences meanwhile, so drafting is tried again later, as requests' own estimates do."""

    decay: float = PRIOR_DECAY
    _methods: dict[str, list[AcceptanceEstimate]] = field(default_factory=dict)

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)

    def value(self, method: str, confidence: float) -> float:
        """The acceptance to expect of a draft of `method` with `confidence`."""
        bins = self._methods.get(method)
        return confidence if bins is None else bins[self._bin(confidence)].estimate(confidence)

    def ceiling(self, method: str) -> float:
        """The best acceptance drafts of `method` achieved in any confidence bin with a record (1 before any)."""
        bins = self._methods.get(method)
        if bins is None:
            return 1.0
        known = [b.estimate((i + 0.5) / CONFIDENCE_BINS) for i, b in enumerate(bins)
                 if b.successes + b.failures >= MIN_CALIBRATION_TRIALS]
        return max(known, default=1.0)

    def observe(self, method: str, confidence: float, drafted: int, accepted: int) -> None:
        if drafted:
            bins = self._methods.setdefault(method, [AcceptanceEstimate() for _ in range(CONFIDENCE_BINS)])
            bins[self._bin(confidence)].observe(drafted, accepted, self.decay)

    def drift(self, method: str) -> None:
        """A step in which `method` was not asked for drafts: its record fades a little toward the prior."""
        for b in self._methods.get(method, ()):
            b.observe(0, 0)


REALISM_TRIALS = 2.0  # pseudo-tokens of evidence that realized acceptance matches the estimates


@dataclass
class RealizedAcceptance:
    """Per drafting method, the tokens its granted drafts were accepted for against what their estimates
    expected when they were granted (`sum a^i` over the granted drafts), decayed per verification.

    Drafts are granted where a request's acceptance estimate is high, and estimates from a few decayed trials are
    noisy, so the granted drafts are those whose estimates erred upward (on sampled novel text the granted drafts
    were accepted for well under what was expected, while the step costs were predicted closely). The ratio of
    realized to expected tokens measures exactly that selection; `factor` scales the expected gains of the
    method's drafts by it, never above 1 (a method whose drafts do better than expected keeps the estimates as
    they are)."""

    decay: float = PRIOR_DECAY
    _methods: dict[str, list[float]] = field(default_factory=dict)  # method -> [expected, realized]

    def factor(self, method: str) -> float:
        expected, realized = self._methods.get(method, (0.0, 0.0))
        return min((realized + REALISM_TRIALS) / (expected + REALISM_TRIALS), 1.0)

    def observe(self, method: str, expected: float, realized: int) -> None:
        sums = self._methods.setdefault(method, [0.0, 0.0])
        sums[0] = self.decay * sums[0] + expected
        sums[1] = self.decay * sums[1] + realized


SPEEDUP_DECAY = 0.9  # per step that drafted before choosing, the weight of earlier ones in its expected speed-up


@dataclass
class DraftingSpeedup:
    """Steps that drafted before choosing lengths (rated chains): each one's expected tokens per sequence over
    its time, drafting included, as a share of the plain step `P(S)`; decayed. Drafting is spent before the
    choice, so the choice cannot weigh it: this says whether drafting pays at all at the present load (below 1
    the controller backs off as after a declined step)."""

    decay: float = SPEEDUP_DECAY
    _weight: float = 0.0
    _sum: float = 0.0

    @property
    def pays(self) -> bool:
        return self._weight == 0 or self._sum >= self._weight

    def observe(self, speedup: float) -> None:
        self._weight = self.decay * self._weight + 1.0
        self._sum = self.decay * self._sum + speedup


def _line(sums: Sequence[float], min_variance: float) -> tuple[float, float, float] | None:
    """(mean x, mean y, slope) of weighted sums (weight, x, y, x*x, x*y); slope NaN when x barely varies."""
    weight, sum_x, sum_y, sum_xx, sum_xy = sums
    if weight <= 0:
        return None
    mean_x, mean_y = sum_x / weight, sum_y / weight
    variance = sum_xx / weight - mean_x**2
    slope = (sum_xy / weight - mean_x * mean_y) / variance if variance > min_variance else float("nan")
    return mean_x, mean_y, slope


def _point(x: float, y: float) -> tuple[float, ...]:
    return 1.0, float(x), y, float(x) * x, float(x) * y


@dataclass
class StepCostModel:
    """What decode steps cost, in two parts fitted from the worker's own steps:

        P(S)    = p0 + p1 * S        a plain decode step over S sequences (one token each)
        V(d)    = v0 + c * d         more, when the step verifies d drafts

    A sequence and a draft cost different things. A sequence brings its context's keys and values to read and
    attend over, its sampling, its bookkeeping; a draft adds one row to the matrix products and one query over
    a context already read, so on a CPU a draft costs a fraction of a sequence's share of the step. A model in
    tokens alone, `T(N)` with drafts and sequences both counted as tokens, cannot see that difference.

    `P` is a recency-weighted least-squares line over plain decode steps (`decay` per step). When S has not
    varied lately the slope comes from the anchors (warmup forwards over 1..64 tokens of one sequence, which
    also stand in for `P` before any decode step). `V` is fitted the same way on the steps that verify, over
    their excess `seconds - P(S)`, with `P` as it is fitted when the cost is used, not when the step ran (capped
    at a few plain steps, so a pause does not read as a cost), or over each excess as a share of the P(S) it was
    measured beside, times today's P(S), whichever fit is lower (steps in a slow spell of the machine). When draft
    counts have not varied, `c` is the anchors' cost of a token and the rest of the excess is `v0`; before any
    verifying step, the same prior with `v0 = 0`.
    """

    decay: float = 0.95
    prior_ratio: float = 1 / 16
    learning: bool = True  # False: the anchors alone (a fixed cost profile, e.g. for reproducible tests)
    # Verifying steps said P(S) is above what steps cost now: the next step should be a plain one, to measure P
    # at the present load (see `observe_speculative`).
    plain_is_stale: bool = False
    _anchors: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, N, T, N*N, N*T
    _plain: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, S, T, S*S, S*T
    # weight, d, T, d*d, d*T, S, d*S over verifying steps (T: the step's seconds as counted, after the caps)
    _verify: list[float] = field(default_factory=lambda: [0.0] * 7)
    # weight, d, d*d, r, d*r, r*S, d*r*S over the same steps since P was last found stale (r: the step's excess as
    # a share of the plain step it was measured beside)
    _shares: list[float] = field(default_factory=lambda: [0.0] * 7)
    _trust: float = 1.0  # decays on declined steps, back to 1 on a measured one

    def anchor(self, num_tokens: int, seconds: float) -> None:
        """A calibration forward over one sequence of `num_tokens` tokens took `seconds`."""
        self._anchors = [a + x for a, x in zip(self._anchors, _point(num_tokens, seconds))]

    def observe(self, num_sequences: int, seconds: float) -> None:
        """A plain decode step over `num_sequences` sequences took `seconds`."""
        if self.learning:  # the first plain step is capped by the anchors' cost (a cold or paused step)
            cap = (1 + MAX_EXTRA_STEPS) * self.plain(num_sequences) if self._plain[0] or self._anchors[0] else seconds
            self._plain = [self.decay * a + x for a, x in zip(self._plain, _point(num_sequences, min(seconds, cap)))]

    def observe_speculative(self, num_sequences: int, seconds: float, num_drafts: int) -> None:
        """A decode step over `num_sequences` sequences that verified `num_drafts` drafts took `seconds`.

        A verifying step does a plain step's work and more, so one that took clearly less than P(S) says P was
        fitted at a heavier load: steps got cheaper (shorter contexts after long ones) while every step verified,
        and P is only measured on plain steps. So does a fit of the verifying steps whose excess at 0 drafts is
        clearly below 0 (many drafts can hide a stale P in each step's total, not in the fit's intercept). Then
        `plain_is_stale` is set (the speculator runs the next step plain) and the plain steps fitted so far keep a
        tenth of their weight, so that measurement counts. Excesses below 0 are kept as they are: the slope over
        draft counts (the price of a draft) is measured whatever the offset. Raised to 0, as they were, they read
        every draft as free once P was stale: at 32 streams of open questions after long summaries, drafts
        accepted at 15-18% were verified at most steps, 0.58x plain decoding
        (docs/benchmarks.md#suffix-decoding)."""
        if not self.learning:
            return
        plain = self.plain(num_sequences)
        extra = min(seconds - plain, MAX_EXTRA_STEPS * plain)
        prior = self.token_cost()
        # A step timed across a pause would otherwise enter the fit at up to four plain steps and, decaying by
        # VERIFY_DECAY per verifying step, raise the price of every draft for a dozen verifying steps (one pause
        # was seen to double the predicted cost of a large batch's drafts). A real rise in cost is still learned,
        # each step's sample allowed up to double what the fit predicted. Before any fit the prediction is the
        # prior (no fixed part): a first verifying step that ran slow alone (at the start of an agentic replay
        # under load) was the whole fit, and kept drafts off for dozens of steps.
        v0, c = self._fitted_verification(prior) or (0.0, prior)
        extra = min(extra, OUTLIER_FACTOR * (v0 + c * num_drafts) + OUTLIER_SLACK * plain)
        point = (*_point(num_drafts, plain + extra), float(num_sequences), float(num_drafts) * num_sequences)
        self._verify = [VERIFY_DECAY * a + x for a, x in zip(self._verify, point)]
        r, d = extra / plain, float(num_drafts)
        shares = (1.0, d, d * d, r, d * r, r * num_sequences, d * r * num_sequences)
        self._shares = [VERIFY_DECAY * a + x for a, x in zip(self._shares, shares)]
        self._trust = 1.0
        intercept = self._fitted_verification(prior, clip=False)[0]
        if (seconds < STALE_PLAIN * plain or intercept < -(1 - STALE_PLAIN) * plain) and not self.plain_is_stale:
            self.plain_is_stale = True
            self._plain = [STALE_KEEP * a for a in self._plain]
            # The verifying steps before this one were measured while P was wrong too, perhaps in a slow spell
            # of the machine (a cold start, another process on the cores: seconds that would weigh as excess):
            # they keep as much weight as the plain steps do, and their shares of that P none.
            self._verify = [STALE_KEEP * (a - x) + x for a, x in zip(self._verify, point)]
            self._shares = [0.0] * len(self._shares)

    def declined(self) -> None:
        """A step that could have verified drafts but was judged not worth it. The verification cost is only
        measured on steps that verify, so an estimate left too high would stop speculation for good; it decays
        here until drafting is tried again and measured anew (one probing step in a few dozen, when it truly
        does not pay)."""
        if self.learning:
            self._trust *= OVERHEAD_DECAY

    def token_cost(self) -> float:
        """The anchors' cost of one more token in a forward: the prior for a draft's cost, and the slope of `P`
        while S has not varied. Without anchors that vary, a token costs `prior_ratio` of a forward's fixed
        cost."""
        line = _line(self._anchors, 0.25)
        if line is not None and line[2] == line[2]:  # a slope (not NaN)
            return max(line[2], 1e-7)
        line = line or _line(self._plain, float("inf"))  # the plain steps' means (no slope)
        if line is None:
            return 0.02 * self.prior_ratio
        mean_n, mean_t, _ = line
        return mean_t / (1 + self.prior_ratio * mean_n) * self.prior_ratio

    def coefficients(self) -> tuple[float, float]:
        """(p0, p1): a plain decode step over S sequences costs `p0 + p1 * S` seconds."""
        line = _line(self._plain, 0.25)
        if line is None:  # no decode step yet: one sequence of S tokens stands in for S sequences
            line = _line(self._anchors, 0.25)
            if line is None:
                return 0.02, 0.02 * self.prior_ratio
        mean_s, mean_t, slope = line
        slope = max(slope if slope == slope else self.token_cost(), 1e-7)  # NaN: S has not varied
        # The line passes through the steps' mean: a borrowed slope too steep for it (anchors timed while the
        # machine was slower) is cut so the intercept stays positive, not the intercept raised above the data.
        slope = min(slope, 0.999 * mean_t / max(mean_s, 1e-9))
        return mean_t - slope * mean_s, slope

    def plain(self, num_sequences: int) -> float:
        """P(S), in seconds."""
        p0, p1 = self.coefficients()
        return p0 + p1 * num_sequences

    def verification_cost(self) -> tuple[float, float]:
        """(v0, c): verifying d drafts costs `v0 + c * d` seconds more than a plain step over the sequences.

        Declined steps scale `v0` and the part of `c` above the prior down (`_trust`), and the prior itself while
        no verifying step has been measured, so an estimate that went too high is measured again later rather
        than switching speculation off for good."""
        prior = self.token_cost()
        fitted = self._fitted_verification(prior)
        if fitted is None:  # nothing measured yet: the prior, worn down by declines until drafts are tried
            return 0.0, self._trust * prior
        v0, c = fitted
        return self._trust * v0, min(c, prior) + self._trust * max(c - prior, 0.0)

    def _fitted_verification(self, prior: float, clip: bool = True) -> tuple[float, float] | None:
        """(v0, c) as fitted on the verifying steps, before declines scale it down (`prior`: `token_cost()`);
        None before any. `clip=False`: v0 as fitted, below 0 where P(S) is above what verifying steps took."""
        weight, sum_d, sum_t, sum_dd, sum_dt, sum_s, sum_ds = self._verify
        if weight <= 0:
            return None
        # The excess V = T - P(S) over the plain step as it is fitted now, not as it was when the step ran: the
        # first verifying steps at a new load were measured against a plain cost fitted at the old one (a
        # heavier load after a lighter one), and their whole error stayed in v0, above a plain step, until enough
        # declines wore it down (dozens of steps without drafts).
        p0, p1 = self.coefficients()
        now = _line((weight, sum_d, sum_t - p0 * weight - p1 * sum_s, sum_dd, sum_dt - p0 * sum_d - p1 * sum_ds),
                    0.5)
        # The other way round when the machine, not the load, changed: steps measured while everything ran slower
        # (a cold start, another process on the cores: plain steps of 1.2 s, verifying ones of 1.5) have seconds
        # of excess over the plain step of today, and that excess, put in v0, declined every draft for hundreds
        # of steps. As a share of the plain step each was measured beside, times today's P(S), they count for what
        # they showed. Of the two fits, the lower excess: one that is too high stops speculation for hundreds of
        # steps, one that is too low is measured again at the next verifying step. Shares below 0 were measured
        # beside a stale P, which only the excess over today's P corrects; they are dropped when P is found stale
        # (`observe_speculative`).
        w, d, dd, r, dr, rs, drs = self._shares
        shares = _line((w, d, p0 * r + p1 * rs, dd, p0 * dr + p1 * drs), 0.5) if w > 0 else None
        mean_d, mean_v, slope = shares if shares is not None and 0 <= shares[1] < now[1] else now
        # Draft counts that did not vary give no slope: the prior, but never more per draft than the measured
        # excess itself (anchors timed on a slower machine would otherwise keep the bar above every request).
        c = max(slope, 0.0) if slope == slope else max(min(prior, mean_v / max(mean_d, 1.0)), 0.0)
        v0 = mean_v - c * mean_d
        return (max(v0, 0.0) if clip else v0), c

    @property
    def overhead(self) -> float:
        """The fixed part of the verification cost, in seconds."""
        return self.verification_cost()[0]


def drafting_bar(batch_size: int, cost: StepCostModel) -> float:
    """The acceptance a request needs for even one draft token to raise goodput: `S * c / P(S)`.

    Requests at or below it skip drafting altogether (their estimate drifts back toward the prior, so they
    try again later)."""
    return batch_size * cost.verification_cost()[1] / cost.plain(batch_size)


def proposal_backoff(declined_in_a_row: int, ask_cost: float = 0.0) -> int:
    """Plain steps to run without proposing drafts after `declined_in_a_row` steps that asked for drafts and
    verified none (all declined, or none proposed) or whose bar withheld every draft: 0, 1, 3, then 7 at most
    (more where asking is dear, below), until a step verifies drafts. Meanwhile requests at their first decode
    step are still asked.

    Proposing costs something even when nothing is verified: every request's prompt lookup and the choice
    itself, per request at every step that proposes, which shows at high concurrency with nothing to copy,
    where nearly every step used to propose and then decline. Each skipped step still
    counts as declined for the verification cost estimate, so probing happens as often as before.

    `ask_cost`: what asking every request costs, in plain steps (measured on fruitless asks). Where one ask in 8
    steps would cost more than `ASK_BUDGET` of the time, the back-off goes on doubling (15, 31, ...) up to the
    length that keeps it there: suffix trees on novel text under load cost a sizeable part of a step per ask
    (docs/benchmarks.md#suffix-decoding)."""
    longest = max(MAX_PROPOSAL_BACKOFF, min(math.ceil(ask_cost / ASK_BUDGET) - 1, LONGEST_PROPOSAL_BACKOFF))
    return min(2 ** max(declined_in_a_row - 1, 0), longest + 1) - 1


Acceptance = float | Sequence[float]  # one `a` for every draft token, or one per token (given the ones before)


def token_acceptance(acceptance: Acceptance, k: int) -> float:
    """The chance that draft token k (from 0) is accepted given the ones before it were."""
    return acceptance if isinstance(acceptance, float | int) else acceptance[k]


def expected_accepted(acceptance: Acceptance, num_drafts: int) -> float:
    """Expected accepted tokens of `num_drafts` drafts: `a + a^2 + ...`, or the products along the chain."""
    total, path = 0.0, 1.0
    for k in range(num_drafts):
        path *= token_acceptance(acceptance, k)
        total += path
    return total


def choose_draft_lengths(
    available: Sequence[int], acceptance: Sequence[Acceptance], cost: StepCostModel, mode: SpeculationMode,
    realism: Sequence[float] | None = None,
) -> list[int]:
    """Draft tokens each request verifies; `available[i]` is how many its drafter proposed (already capped), and
    `acceptance[i]` the request's `a`, or per token the chance of its acceptance given the ones before
    (`Acceptance`). `realism[i]` (1 when not given) scales request i's expected accepted tokens
    (`RealizedAcceptance`)."""
    if mode == SpeculationMode.FIXED:
        return list(available)
    realism = realism or [1.0] * len(available)
    v0, per_draft = cost.verification_cost()
    num_sequences = len(available)
    lengths = [0] * num_sequences
    plain = cost.plain(num_sequences)
    num_drafts = 0
    expected = float(num_sequences)  # every request emits at least its own token
    heap = [(-token_acceptance(acceptance[i], 0) * realism[i], i) for i in range(num_sequences)
            if available[i] > 0 and token_acceptance(acceptance[i], 0) > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        # Grant one more draft token when expected tokens per second improve.
        before = plain + per_draft * num_drafts
        if (expected + gain) / (before + per_draft) <= expected / before:
            break
        lengths[i] += 1
        expected += gain
        num_drafts += 1
        if lengths[i] < available[i]:
            heapq.heappush(heap, (-gain * token_acceptance(acceptance[i], lengths[i]), i))
    # Verifying anything at all has a fixed cost: draft only when the whole step still beats a plain one.
    if num_drafts and expected / (plain + per_draft * num_drafts + v0) <= num_sequences / plain:
        return [0] * num_sequences
    return lengths
