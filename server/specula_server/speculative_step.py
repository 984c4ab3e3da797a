"""The worker step's side of speculative decoding, around the forward that `TextGenerator._verify` runs: each
request's draft written after its last token (`place_drafts`), the verified rows accepted by the exact rule and
their tokens committed and reported (`accept_drafts`), and the target's auxiliary hidden states handed to an
EAGLE-3 drafter (`keep_aux`, after plain steps and prompt chunks too)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula_server.grammar import MaskJob
from specula_server.kv_cache import KVCache
from specula_server.nonfinite import kept_rows
from specula_server.request import RequestState, StepOutput
from specula_server.sampling import Sampler
from specula_server.speculation.drafters import Draft
from specula_server.speculation.eagle3_drafter import Eagle3Drafter
from specula_server.speculation.speculator import DraftPlan, Speculator
from specula_server.step_outputs import TokenReports, screen


def place_drafts(reqs: Sequence[RequestState], drafts: Sequence[Draft]) -> list[Draft | None]:
    """Writes each request's draft into its token buffer after its last token, where the verifying step reads
    it; returns the trees among the drafts (None for a chain)."""
    for r, d in zip(reqs, drafts):  # the buffer tail past num_tokens is free: drafts go there
        r.token_ids[r.num_tokens : r.num_tokens + len(d)] = d.tokens
    return [None if d.is_chain else d for d in drafts]


def accept_drafts(reqs: list[RequestState], plan: DraftPlan, counts: list[int], hidden: torch.Tensor,
                  aux: torch.Tensor | None, logits: torch.Tensor, row_starts: list[int], masks: MaskJob | None,
                  start: int | None, *, speculator: Speculator, sampler: Sampler, kv_cache: KVCache,
                  reports: TokenReports, eagle: Eagle3Drafter | None) -> list[StepOutput]:
    """accept → commit over the verified rows (`counts[i]` of request i from `row_starts[i]`: its final hidden
    states, auxiliary ones and logits): the requests with a bad row fail, the speculator accepts a prefix of
    each other draft by the exact rule (the step timed from `start`, unless None), and the tokens are committed
    and reported."""
    drafts, methods = plan.drafts, plan.methods
    num_seqs = len(reqs)
    # A verified row's logits are its drafts' too: a request with one bad row fails whole.
    outputs, keep, logits = screen(reqs, logits, counts, masks)
    if len(keep) < num_seqs:  # the others go on without them: from here on every operation is row by row
        rows, row_starts = kept_rows(counts, keep)
        hidden = hidden[rows]
        aux = aux[rows] if aux is not None else None
        reqs = [reqs[i] for i in keep]
        plan = DraftPlan([drafts[i] for i in keep], [methods[i] for i in keep])
        if not reqs:
            return outputs
    verdicts, processed = speculator.accept(reqs, plan, logits, row_starts, sampler, kv_cache, start, num_seqs)
    scores = processed if processed is not None else logits
    # The accepted path's rows: the positions num_tokens - 1 .. of the tokens committed now.
    keep_aux(eagle, reqs, aux, [v.rows for v in verdicts], [r.num_tokens - 1 for r in reqs])
    for r, v, method, draft in zip(reqs, verdicts, plan.methods, plan.drafts):
        r.last_hidden = hidden[v.rows[-1]]
        tops = reports.row_top_tokens(scores, v.rows, r.spec.top_n_tokens, normalized=processed is not None)
        out = r.commit(v.token_ids, v.logprobs, tops)  # up to a stop: nothing after it is emitted
        speculator.record(r, v, method, draft)
        out.num_drafted, out.num_accepted, out.draft_method = v.num_drafted, min(v.num_accepted,
                                                                                 len(out.tokens)), method
        outputs.append(out)
    if eagle is not None:
        live = [r for r in reqs if not r.is_finished]
        eagle.bound_kept_rows(live, lambda over: speculator.could_draft(over, len(live)))
    return outputs


def keep_aux(eagle: Eagle3Drafter | None, reqs: Sequence[RequestState], aux: torch.Tensor | None,
             rows: Sequence[slice | list[int]], first_positions: Sequence[int]) -> None:
    """Hands each request's auxiliary rows (of consecutive positions from `first_positions[i]`) to EAGLE-3."""
    if aux is None or eagle is None:
        return
    for r, index, first in zip(reqs, rows, first_positions):
        eagle.keep_aux(r, aux[index], first)
