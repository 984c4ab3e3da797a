"""The seam between the engine's decode step and speculative decoding.

The engine (`TextGenerator`) asks the `Speculator` two things per decode step:

    plan(requests)        before the forward: how many drafts each request verifies, and which tokens
                          (drafters, the adaptive controller, a draft model's own forwards); None: a plain step
    accept(...)           after the forward over `[last, d1..dk]` of each request: the exact acceptance rule,
                          the step's cost and each request's acceptance recorded, tree paths moved into place

Everything speculation keeps between steps lives here: the controller's cost model and acceptance priors and
its back-off after declined steps. The draft model's KV lives in the same blocks and slots as the target's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specula_proto.choices import SpeculationMode, parse_choice
from specula_server.kv_cache import KVCache
from specula_server.request import RequestState
from specula_server.sampling import Sampler
from specula_server.speculation.controller import (
    ASK_COST_DECAY,
    Acceptance,
    AcceptancePriors,
    ConfidenceCalibration,
    DraftingSpeedup,
    RealizedAcceptance,
    StepCostModel,
    choose_draft_lengths,
    drafting_bar,
    expected_accepted,
    proposal_backoff,
)
from specula_server.speculation.draft_model import DraftModelDrafter
from specula_server.speculation.drafters import Draft, Drafter
from specula_server.speculation.eagle3_drafter import Eagle3Drafter
from specula_server.speculation.verify import Verdict, verify

logger = logging.getLogger("specula.speculation")

GRAMMAR_METHOD = "grammar"  # drafts of the tokens a request's grammar forces (see `grammar.py`)


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding of the worker: up to `max_tokens` drafts per request per step.

    `draft_model`, when the server drafts with a draft model or an EAGLE-3 speculator, is that drafter (also
    reachable through `drafter`, which may be a composite): the generator sizes and allocates its KV cache
    beside the target's and asks it for the tokens of the pending drafts it proposed. `grammar_drafts`:
    constrained requests draft the tokens their grammar forces (see `grammar.py`); off only to measure what they
    bring."""

    drafter: Drafter
    max_tokens: int
    mode: SpeculationMode = SpeculationMode.ADAPTIVE  # draft lengths follow acceptance and load, or are fixed
    draft_model: DraftModelDrafter | Eagle3Drafter | None = None
    grammar_drafts: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"invalid speculation settings: {self.max_tokens} tokens")
        object.__setattr__(self, "mode", parse_choice(SpeculationMode, self.mode, "speculation mode"))


@dataclass(frozen=True)
class DraftPlan:
    """The drafts a decode step verifies: one per request (maybe empty), and the drafter of each ("" if none)."""

    drafts: list[Draft]
    methods: list[str]

    @property
    def counts(self) -> list[int]:
        """Rows each request feeds: its last token and its drafts."""
        return [len(d) + 1 for d in self.drafts]


class Speculator:
    def __init__(self, config: SpeculationConfig, max_positions: int,
                 agreed_seconds: Callable[[int], float]) -> None:
        self.config = config
        self.max_positions = max_positions
        self.agreed_seconds = agreed_seconds  # a duration as every tensor-parallel rank records it
        self.step_cost = StepCostModel()
        self.acceptance_priors = AcceptancePriors()
        self.calibration = ConfidenceCalibration()  # what a confident drafter's drafts achieve, by confidence
        self.realized = RealizedAcceptance()  # granted drafts' accepted tokens against what was expected
        self.rated_speedup = DraftingSpeedup()  # what steps that drafted rated chains achieved, drafting included
        self._granted_at: dict[int, Acceptance] = {}  # request id -> the acceptance its draft was granted at
        self._declined_in_a_row = 0  # adaptive: steps whose drafts were all declined, since one verified
        self._steps_without_proposals = 0  # adaptive: plain steps left before drafts are proposed again
        self._ask_cost: float | None = None  # adaptive: what a fruitless ask costs, in plain steps (decayed)
        self._asked_ns = 0  # how long this step's ask took, when it verifies nothing (not part of a plain step)
        # How long drafting rated chains took in this step (`_draft_rated`): spent before the lengths are chosen,
        # so not part of what verifying them costs.
        self._drafted_ns = 0
        self._drafted_prompt = False  # whether that drafting ran the draft layer over a prompt
        self.clock = time.perf_counter_ns  # times asking (a test's own clock can stand in)

    @property
    def adaptive(self) -> bool:
        return self.config.mode == SpeculationMode.ADAPTIVE

    def release(self, r: RequestState) -> None:
        """`r` left the worker (finished, failed, cancelled or preempted): drafters that keep state per request
        (suffix decoding) let it go, and learn from its output when it finished."""
        release = getattr(self.config.drafter, "release", None)
        if release is not None:
            release(r)

    def draft_cap(self, r: RequestState) -> int:
        """Most drafts `r` may verify: its own cap, what it may still emit, and the positions it owns."""
        cap = self.config.max_tokens
        if r.spec.speculative_tokens is not None:
            cap = min(cap, r.spec.speculative_tokens)
        remaining = r.spec.stopping.max_new_tokens - r.num_generated - 1  # the target adds one token itself
        room = min(r.capacity, self.max_positions) - r.num_tokens
        return max(0, min(cap, remaining, room))

    def could_draft(self, reqs: Sequence[RequestState], batch_size: int) -> list[bool]:
        """Per request of `reqs` (some of a batch of `batch_size`), whether the controller could grant it drafts at
        this batch size: for rated chains (EAGLE-3's), while drafting them pays at this load (`_judge_drafting`)
        and tokens of some probability have lately been accepted above the bar (`drafting_bar`); for others, while
        its acceptance estimate clears the bar; always in fixed mode. What a drafter keeps for later drafts
        (EAGLE-3's rows) need not be worked on for requests that could not."""
        if not self.adaptive:
            return [True] * len(reqs)
        bar = drafting_bar(batch_size, self.step_cost)
        drafter = self.config.drafter
        methods = [drafter.method_for(r) for r in reqs]
        if getattr(self.config.draft_model, "confident", False):
            could = {m: self.rated_speedup.pays and self.calibration.ceiling(m) > bar for m in set(methods)}
            return [could[m] for m in methods]
        return [r.acceptance.estimate(self.acceptance_priors.value(m)) > bar for r, m in zip(reqs, methods)]

    def plan(self, reqs: Sequence[RequestState]) -> DraftPlan | None:
        """propose → choose lengths → draft pending tokens; None when this step verifies nothing (a plain
        step, at a plain step's cost: each request's acceptance estimate then drifts back to the prior)."""
        self._asked_ns = self._drafted_ns = 0
        chosen = self._choose(reqs)
        if chosen is None:
            for r in reqs:
                r.acceptance.observe(0, 0)
        return chosen

    def _choose(self, reqs: Sequence[RequestState]) -> DraftPlan | None:
        if self.adaptive and self.step_cost.plain_is_stale:  # P is measured again at this load first
            self.step_cost.plain_is_stale = False
            return None
        forced = self._forced(reqs)
        # While backing off, the drafter is asked only for requests at their first decode step, the one after
        # the prefill sampled their first token (new requests may have drafts that pay; asking everyone
        # whenever one joined, as was done, ended the back-off at every join); forced tokens cost nothing to
        # propose.
        backing_off = self.adaptive and self._steps_without_proposals > 0
        newcomers = [r.num_generated <= 1 for r in reqs] if backing_off else [True] * len(reqs)
        if backing_off:
            self._steps_without_proposals -= 1
            if not any(forced) and not any(newcomers):
                self.step_cost.declined()
                return None
        drafter = self.config.drafter
        methods = [GRAMMAR_METHOD if f else drafter.method_for(r) for r, f in zip(reqs, forced)]
        acceptance = [r.acceptance.estimate(self.acceptance_priors.value(m)) for r, m in zip(reqs, methods)]
        bar = drafting_bar(len(reqs), self.step_cost) if self.adaptive else -1.0
        caps = self._ask_caps(reqs, forced, newcomers, methods, acceptance, bar)
        if not any(caps) and not any(forced):  # nobody is asked: a plain step
            if self.adaptive and (backing_off or any(self.draft_cap(r) for r in reqs)):
                # The bar withheld every draft: a declined step for the cost model too. Its fitted excess fades
                # until drafts are asked for and measured again; else one step that fitted the cost of a draft
                # too high kept the bar above every request (and a confident drafter's ceiling) for good. It
                # backs off as a decline does: deciding so for every request at every step has a cost of its
                # own, which the back-off cuts.
                self.step_cost.declined()
                self._verified_nothing(backing_off)
            return None
        asked_at = self.clock()
        try:
            proposals = drafter.propose(reqs, caps)
            proposals = [Draft(torch.tensor(f), confidence=1.0) if f else p for p, f in zip(proposals, forced)]
            if self.adaptive:
                proposals = self._draft_rated(reqs, proposals, methods, bar)
        except Exception:  # drafts only ever save time: a drafter's failure must not fail the requests
            logger.exception("drafting failed; this step verifies no drafts")
            return None
        acceptance = [self._acceptance(a, p, f, m) for a, p, f, m in zip(acceptance, proposals, forced, methods)]
        # Rated tokens are priced by what tokens of their probability achieved, which already says how far the
        # drafter's word goes: the realized factor corrects estimates that were granted because they erred upward.
        realism = [1.0 if f or p.confidences is not None else self.realized.factor(m)
                   for f, m, p in zip(forced, methods, proposals)]
        lengths = choose_draft_lengths([p.available for p in proposals], acceptance, self.step_cost,
                                       self.config.mode, realism)
        self._granted_at = {r.id: a for r, a, k in zip(reqs, acceptance, lengths) if k}
        pays = self._judge_drafting(reqs, acceptance, lengths) if self._drafted_ns else True
        if not any(lengths):  # nothing worth verifying
            self._asked_ns = self.clock() - asked_at
            if backing_off or any(p.available for p in proposals):
                self.step_cost.declined()
            # Asking costs time whether or not drafts come back: a step that asked and verified nothing backs
            # off too (else a drafter that proposes nothing on novel text is asked at most steps).
            if any(caps):
                self._verified_nothing(backing_off, self._asked_ns, len(reqs))
            return None
        if pays:
            self._declined_in_a_row = self._steps_without_proposals = 0
        else:  # drafting at this load costs more than it brings: back off as after a declined step, the drafting
            self._verified_nothing(False, self._drafted_ns, len(reqs))  # being what the ask cost
        try:
            drafts = self._draft_pending(reqs, [p.truncated(k) for p, k in zip(proposals, lengths)])
            drafts = [d if r.grammar is None or f else within_grammar(r, d) for r, d, f in zip(reqs, drafts, forced)]
        except Exception:
            logger.exception("drafting failed; this step verifies no drafts")
            return None
        return DraftPlan(drafts, [m if len(d) else "" for m, d in zip(methods, drafts)])

    def _acceptance(self, estimate: float, draft: Draft, forced: list[int], method: str) -> Acceptance:
        """What to expect of `draft`'s tokens: certain acceptance for forced ones; for a model drafter's rated
        chain, per token what tokens of its probability were accepted at; for a draft with one confidence, the
        better of that confidence's record and the request's own `estimate`; else `estimate`."""
        if forced:
            return 1.0
        if draft.confidences is not None:
            return [self.calibration.value(method, q) for q in draft.confidences]
        if draft.confidence is not None:
            return max(estimate, self.calibration.value(method, draft.confidence))
        return estimate

    def _draft_rated(self, reqs: Sequence[RequestState], proposals: list[Draft], methods: list[str],
                     bar: float) -> list[Draft]:
        """Pending drafts of a draft model that rates its tokens (EAGLE-3's chains), drafted now, before the
        lengths are chosen: each chain goes on while what its tokens so far are worth, times the best any
        probability achieved lately, clears `bar`, and the choice then prices every token by what tokens of its
        probability were accepted at.

        A request's own record says little of its next draft (on the real model's answers the draft layer's
        probability of its first token correlated 0.51 with that token's acceptance, the request's recent
        acceptance 0.12), so declining by that record left one stream drafting in 40% of its steps where
        drafting at every step was 14% faster (docs/speculation.md#the-adaptive-controller)."""
        draft_model = self.config.draft_model
        pending = [i for i, p in enumerate(proposals) if p.pending]
        if not pending or not getattr(draft_model, "confident", False):
            return proposals
        ceilings = {m: self.calibration.ceiling(m) for m in {methods[i] for i in pending}}

        def extend(j: int, confidences: Sequence[float]) -> bool:
            method = methods[pending[j]]
            worth = 1.0
            for q in confidences:
                worth *= self.calibration.value(method, q)
            return worth * ceilings[method] > bar

        self._drafted_prompt = any(reqs[i].draft_cached < reqs[i].prompt_len - 1 for i in pending)
        started = time.perf_counter_ns()
        drafted = draft_model.draft([reqs[i] for i in pending], [proposals[i].pending for i in pending], extend)
        self._drafted_ns = time.perf_counter_ns() - started
        proposals = list(proposals)
        for i, d in zip(pending, drafted):
            proposals[i] = d
        return proposals

    def _judge_drafting(self, reqs: Sequence[RequestState], acceptance: list[Acceptance], lengths: list[int]) -> bool:
        """Whether drafting rated chains pays at this load, drafting included (`rated_speedup` at 1 or more).

        Drafting is spent before the lengths are chosen, so the choice cannot weigh it. This step's expected
        speed-up over a plain one is its expected tokens per sequence over its expected time, drafting as it
        took, as a share of `P(S)`; a step whose drafting ran the draft layer over a prompt (work done once a
        request, for all its drafts) is not counted. Declining every chain that did not pay, as the choice does,
        still left every step drafting for every request at 8 streams of the real model: 0.82x plain decoding.
        Expected rather than realized tokens: a stream's accepted tokens go 0 to 3 a step, and their average over
        a few dozen steps fell below 1 at one stream where drafting paid."""
        if not self._drafted_prompt:
            num_sequences, drafts = len(reqs), sum(lengths)
            plain = self.step_cost.plain(num_sequences)
            v0, per_draft = self.step_cost.verification_cost()
            tokens = num_sequences + sum(expected_accepted(a, k) for a, k in zip(acceptance, lengths))
            seconds = plain + (v0 + per_draft * drafts if drafts else 0.0) + self.agreed_seconds(self._drafted_ns)
            self.rated_speedup.observe(tokens / num_sequences * plain / seconds)
        return self.rated_speedup.pays

    def _ask_caps(self, reqs: Sequence[RequestState], forced: list, newcomers: list[bool], methods: list[str],
                  acceptance: list[float], bar: float) -> list[int]:
        """How many drafts to ask the drafter for, per request (0: none): forced tokens need no drafter, and a
        request is asked when its acceptance estimate clears `bar`.

        A drafter whose drafts say how likely they are is asked for every request while drafts of some
        confidence have lately been accepted above the bar (a request's own record says little of its next
        match); requests' own estimates decide for the others."""
        confident = {m: self.calibration.ceiling(m) > bar for m in set(methods)} if getattr(
            self.config.drafter, "confident", False) else {}
        caps = [0 if f or not new else self.draft_cap(r) if a > bar or confident.get(m, False) else 0
                for r, a, f, m, new in zip(reqs, acceptance, forced, methods, newcomers)]
        for m, asked in confident.items():
            if not asked:
                self.calibration.drift(m)
        return caps

    def _verified_nothing(self, backing_off: bool, asked_ns: int | None = None, num_sequences: int = 0) -> None:
        """A step that could have drafted verified nothing: the back-off grows (newcomers asked while backing
        off do not prolong it). `asked_ns`: how long asking took, when every request could be asked; in plain
        steps of this batch, it sets how far the back-off may grow (`proposal_backoff`)."""
        self._declined_in_a_row += 1
        if backing_off:
            return
        if asked_ns is not None:
            cost = self.agreed_seconds(asked_ns) / max(self.step_cost.plain(num_sequences), 1e-6)
            earlier = cost if self._ask_cost is None else self._ask_cost
            self._ask_cost = ASK_COST_DECAY * earlier + (1 - ASK_COST_DECAY) * cost
        self._steps_without_proposals = proposal_backoff(self._declined_in_a_row, self._ask_cost or 0.0)

    def _forced(self, reqs: Sequence[RequestState]) -> list[list[int]]:
        """Per request, the tokens its grammar forces from here, up to its draft cap ([] when unconstrained)."""
        forced = []
        for r in reqs:
            tokens = r.grammar.forced_tokens() if r.grammar is not None and self.config.grammar_drafts else []
            forced.append(tokens[: self.draft_cap(r)] if tokens else tokens)
        return forced

    def _draft_pending(self, reqs: Sequence[RequestState], drafts: list[Draft]) -> list[Draft]:
        """Has the draft model draft the tokens of pending drafts, exactly as many as the controller granted."""
        pending = [i for i, d in enumerate(drafts) if d.pending]
        if not pending:
            return drafts
        draft_model = self.config.draft_model
        assert draft_model is not None, "a drafter proposed pending drafts but the worker has no draft model"
        drafted = draft_model.draft([reqs[i] for i in pending], [drafts[i].pending for i in pending])
        for i, d in zip(pending, drafted):
            drafts[i] = d
        return drafts

    def observe_plain(self, num_sequences: int, nanoseconds: int) -> None:
        """A plain decode step over `num_sequences` took `nanoseconds` (up to its chosen tokens), less what asking
        the drafter took in it when nothing was verified: that is the ask's cost, which the back-off weighs
        (`proposal_backoff`), not a plain step's. Counted in P, a drafter's first ask for many new requests at
        once (suffix trees built over their prompts: 565 ms in a step of 32 streams whose forward took 80) raised
        P(32) threefold; drafts then looked free beside it, and the next steps verified 60-100 drafts at about
        three times a plain step's cost (docs/speculation.md#the-adaptive-controller)."""
        self.step_cost.observe(num_sequences, self.agreed_seconds(max(nanoseconds - self._asked_ns, 0)))

    def accept(self, reqs: Sequence[RequestState], plan: DraftPlan, logits: torch.Tensor, row_starts: list[int],
               sampler: Sampler, kv_cache: KVCache, start_ns: int | None, num_sequences: int
               ) -> tuple[list[Verdict], torch.Tensor | None]:
        """The exact acceptance rule over the verified rows; returns each request's verdict and, when sampling
        processed the logits, the distributions the tokens were chosen from. The step, timed from `start_ns`,
        prices drafts for the controller; None when its forward also ran prompt chunks."""
        verdicts, processed = verify(logits, reqs, plan.drafts, row_starts, sampler)
        # Timed up to the accepted tokens, as plain steps are up to their sampled ones: drawing and checking a
        # token at every verified position is part of what a draft costs (a sampling request's rows most of all).
        if start_ns is not None:
            num_drafted = sum(len(d) for d in plan.drafts)
            seconds = self.agreed_seconds(time.perf_counter_ns() - start_ns - self._drafted_ns)
            self.step_cost.observe_speculative(num_sequences, seconds, num_drafted)
        compact_accepted_paths(kv_cache, reqs, plan.drafts, verdicts)
        return verdicts, processed

    def record(self, r: RequestState, verdict: Verdict, method: str, draft: Draft) -> None:
        """A request's verification of `draft`, once its tokens are committed: acceptance statistics (the
        request's, its method's and, for a draft that carried a confidence, that confidence's) and draft KV."""
        r.acceptance.observe(verdict.num_drafted, verdict.num_accepted)
        self.acceptance_priors.observe(method, verdict.num_drafted, verdict.num_accepted)
        if draft.confidence is not None and method != GRAMMAR_METHOD:
            self.calibration.observe(method, draft.confidence, verdict.num_drafted, verdict.num_accepted)
        if draft.confidences is not None and method != GRAMMAR_METHOD:  # each token up to the first rejected one
            for k, q in enumerate(draft.confidences[: min(verdict.num_accepted + 1, verdict.num_drafted)]):
                self.calibration.observe(method, q, 1, int(k < verdict.num_accepted))
        granted_at = self._granted_at.pop(r.id, None)
        # Over the drafts verified (a grammar may cut some); rated chains are priced by their calibration instead.
        if granted_at is not None and method != GRAMMAR_METHOD and draft.confidences is None:
            expected = expected_accepted(granted_at, verdict.num_drafted)
            self.realized.observe(method, expected, verdict.num_accepted)
        # The draft model's KV is valid up to the last accepted draft it ran over; the target's own token
        # (correction or bonus) is run over before the next draft.
        r.draft_cached = min(r.draft_cached, r.num_tokens - 1)


def within_grammar(r: RequestState, draft: Draft) -> Draft:
    """`draft` without the nodes whose path the request's grammar forbids: a chain ends before its first
    forbidden token, a tree keeps the nodes whose whole path is allowed (a forbidden token could never match
    the masked target's choice, so verifying it would only cost a row).

    Drafts sampled from a draft distribution q are kept whole for a sampling request: speculative sampling's
    correction at a rejected position draws from norm(max(0, p - q)), and ending the chain where the drawn draft
    is forbidden would draw from p instead, a different distribution. The masked p gives the forbidden draft
    probability 0, so the rule rejects it there, exactly.
    """
    assert r.grammar is not None
    if not len(draft) or (draft.q is not None and not r.spec.sampling.is_greedy):
        return draft
    tokens = draft.tokens.tolist()
    if draft.is_chain:
        return draft.truncated(r.grammar.valid_prefix(tokens))
    paths: list[list[int] | None] = []
    for token, parent in zip(tokens, draft.node_parents()):
        base = [] if parent < 0 else paths[parent]
        path = None if base is None else base + [token]
        paths.append(path if path is not None and r.grammar.valid_prefix(path) == len(path) else None)
    return draft.subtree([i for i, p in enumerate(paths) if p is not None])


def compact_accepted_paths(kv_cache: KVCache, reqs: Sequence[RequestState], drafts: Sequence[Draft],
                           verdicts: Sequence[Verdict]) -> None:
    """Moves the KV of each tree's accepted nodes to the positions they now hold in the sequence.

    Node i was written at buffer index `num_tokens + i`; the accepted node at depth d belongs at
    `num_tokens + d - 1`. Chains, and tree paths along the first nodes, are already in place. Rejected
    nodes' slots are past the sequence's end and are overwritten by later steps, never read.
    """
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    for r, d, v in zip(reqs, drafts, verdicts):
        if d.is_chain:
            continue
        moves = [(r.num_tokens + node, r.num_tokens + depth) for depth, node in enumerate(v.path) if node != depth]
        if moves:
            src.append(r.slots[[m[0] for m in moves]])
            dst.append(r.slots[[m[1] for m in moves]])
    if src:
        kv_cache.move(torch.cat(src), torch.cat(dst))
