"""What a worker step makes of its logits, and what it returns: the grammars' masks (`grammar_masks`), the
requests whose rows it keeps (`screen`: rows not finite, grammars failed, masks applied), the tokens it samples
and commits (`sample`, `commit_sampled`, `commit_prompts`), how it reports them (`TokenReports`: each token's
top-n alternatives, a prompt's log-probabilities), and the step's result (`StepResult`, `StepTimings`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tokenizers
import torch

from specula_server.grammar import MaskJob, apply_masks
from specula_server.nonfinite import failure, kept_rows, nonfinite_requests
from specula_server.request import RequestState, StepOutput, TokenInfo
from specula_server.sampling import Sampler, SampleResult, SamplingRow

if TYPE_CHECKING:
    from specula_server.speculation.speculator import DraftPlan


@dataclass
class StepTimings:
    forward_ns: int = 0
    decode_ns: int = 0


@dataclass
class StepResult:
    outputs: list[StepOutput]
    timings: StepTimings = field(default_factory=StepTimings)
    steps: int = 1  # decode steps run (several in one call: `TextGenerator.step`)

    def merge(self, later: StepResult) -> None:
        """Adds the result of the call's next step: a request's outputs become one (`StepOutput.extend`)."""
        mine = {out.request_id: out for out in self.outputs if not out.error}
        for out in later.outputs:
            if out.request_id in mine:
                mine[out.request_id].extend(out)
            else:
                self.outputs.append(out)
        self.timings.forward_ns += later.timings.forward_ns
        self.timings.decode_ns += later.timings.decode_ns
        self.steps += later.steps


def grammar_masks(reqs: Sequence[RequestState], vocab_size: int, plan: DraftPlan | None = None) -> MaskJob | None:
    """Starts computing the allowed-token masks of the constrained requests among `reqs` (each feeding one row,
    or its last token and its drafts in `plan`) on the mask thread; None when none is constrained."""
    items = []
    for i, r in enumerate(reqs):
        if r.grammar is not None:
            draft = plan.drafts[i] if plan is not None else None
            tokens, parents = ([], []) if draft is None else (draft.tokens.tolist(), draft.node_parents())
            items.append((i, r.grammar, tokens, parents))
    return MaskJob(items, vocab_size) if items else None


def screen(reqs: Sequence[RequestState], logits: torch.Tensor, counts: Sequence[int],
           masks: MaskJob | None) -> tuple[list[StepOutput], list[int], torch.Tensor]:
    """Failures of the requests whose rows are not finite or whose grammar failed, the indices of the others,
    and their rows of `logits` (request after request, `counts[i]` each) with every grammar's mask applied."""
    failed = dict.fromkeys(nonfinite_requests(logits, counts), "")
    if masks is not None:
        masks.wait()
        failed.update((i, error) for i, error in masks.errors.items() if i not in failed)
    outputs = [StepOutput(reqs[i].id, [], [], error=f"request {reqs[i].id}: {error}") if error else failure(reqs[i])
               for i, error in failed.items()]
    keep = [i for i in range(len(reqs)) if i not in failed]
    rows, starts = kept_rows(counts, keep)
    if len(keep) < len(reqs):
        logits = logits[rows]
    if masks is not None:
        new_start = dict(zip(keep, starts))
        mask_rows = [(new_start[i] + j, at + j) for i, at, n in masks.spans() if i in new_start for j in range(n)]
        if mask_rows:
            dst, src = zip(*mask_rows)
            apply_masks(logits, torch.tensor(dst), masks.bitmask[list(src)])
    return outputs, keep, logits


def sample(sampler: Sampler, reqs: Sequence[RequestState], logits: torch.Tensor) -> SampleResult:
    """One token for each request (row i of `logits`), drawn with its own sampling parameters and generator."""
    rows = [SamplingRow(r.spec.sampling, r.history, r.generator) for r in reqs]
    return sampler(logits, rows, num_top=max(r.spec.top_n_tokens for r in reqs))


def commit_sampled(reqs: Sequence[RequestState], sample: SampleResult, last_hidden: torch.Tensor,
                   reports: TokenReports, prompts: Sequence[list[TokenInfo] | None] | None = None
                   ) -> list[StepOutput]:
    """Appends each request's sampled token (row i) and reports it."""
    token_ids, logprobs = sample.token_ids.tolist(), sample.logprobs.tolist()
    outputs = []
    for i, r in enumerate(reqs):
        r.last_hidden = last_hidden[i]
        top = reports.top_tokens(sample, i, r.spec.top_n_tokens)
        out = r.commit([token_ids[i]], [logprobs[i]], [top] if r.spec.top_n_tokens else [])
        out.prefill_tokens = prompts[i] if prompts else None
        outputs.append(out)
    return outputs


def commit_prompts(reqs: Sequence[RequestState], logits: torch.Tensor, last_hidden: torch.Tensor,
                   masks: MaskJob | None, sampler: Sampler, reports: TokenReports,
                   prompt_logits: Callable[[int], torch.Tensor]) -> list[StepOutput]:
    """The first token of each prompt whose last position ran (row i of `logits` and `last_hidden`), with the
    log-probability of every prompt token for a request that asked for them (`prompt_logits(i)`: the logits of
    request i's prompt positions but the last); a request whose prompt logits are not finite fails."""
    outputs, kept, logits = screen(reqs, logits, [1] * len(reqs), masks)
    prompts = {}
    for i in kept:
        if reqs[i].spec.prefill_logprobs:
            prompts[i] = reports.prompt_tokens(reqs[i], prompt_logits(i))
            if prompts[i] is None:
                outputs.append(failure(reqs[i], "prompt logits"))
    sampled = [j for j, i in enumerate(kept) if prompts.get(i, ()) is not None]
    kept = [kept[j] for j in sampled]
    if kept:
        chosen = sample(sampler, [reqs[i] for i in kept], logits[sampled])
        outputs += commit_sampled([reqs[i] for i in kept], chosen, last_hidden[kept], reports,
                                  [prompts.get(i) for i in kept])
    return outputs


@torch.inference_mode()
def first_tokens(reqs: Sequence[RequestState], rows: Sequence[tuple[torch.Tensor, torch.Tensor]], sampler: Sampler,
                 reports: TokenReports, vocab_size: int) -> list[StepOutput]:
    """The first token of prompts that waited for their grammar, from the (logits, final hidden state) of the
    prompt's last position that their prefill kept."""
    logits, last_hidden = torch.stack([row for row, _ in rows]), torch.stack([h for _, h in rows])
    outputs, kept, logits = screen(reqs, logits, [1] * len(reqs), grammar_masks(reqs, vocab_size))
    if not kept:
        return outputs
    chosen = sample(sampler, [reqs[i] for i in kept], logits)
    return outputs + commit_sampled([reqs[i] for i in kept], chosen, last_hidden[kept], reports)


class TokenReports:
    """The `TokenInfo`s a step reports besides its tokens (each with its text and whether it is special): the
    top-n alternatives of a chosen token, and the log-probability of every prompt token."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(
            tid for tid, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )

    def infos(self, ids: Sequence[int], logprobs: Sequence[float]) -> list[TokenInfo]:
        return [
            TokenInfo(t, self.tokenizer.decode([t], skip_special_tokens=False), lp, t in self.special_ids)
            for t, lp in zip(ids, logprobs)
        ]

    def top_tokens(self, sample: SampleResult, row: int, n: int) -> list[TokenInfo]:
        """The `n` most likely tokens of a sampled row, as the sampler ranked them."""
        if n == 0:
            return []
        return self.infos(sample.top_ids[row, :n].tolist(), sample.top_logprobs[row, :n].tolist())

    def row_top_tokens(self, scores: torch.Tensor, rows: list[int], n: int, normalized: bool) -> list[list[TokenInfo]]:
        """The `n` most likely tokens of each of `rows` of `scores` (log-probabilities when `normalized`, else
        logits)."""
        if n == 0:
            return []
        selected = scores[rows].float()
        if not normalized:
            selected = torch.log_softmax(selected, dim=-1)
        top = selected.topk(n, dim=-1)
        return [self.infos(ids, lps) for ids, lps in zip(top.indices.tolist(), top.values.tolist())]

    def prompt_tokens(self, r: RequestState, logits: torch.Tensor) -> list[TokenInfo] | None:
        """Log-probability of every prompt token given the ones before it (the first has none), from `logits` of
        the prompt's positions but the last; None when some of them are not finite."""
        prompt = r.token_ids[: r.prompt_len]
        if nonfinite_requests(logits, [logits.shape[0]]):
            return None
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, prompt[1:].to(logits.device).unsqueeze(1))
        values = [math.nan] + logprobs.squeeze(1).tolist()
        return self.infos(prompt.tolist(), values)
