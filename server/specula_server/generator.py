"""The worker's step executor: prefill and decode over cached batches.

`TextGenerator` owns the model, the KV cache and the batches cached between steps. The router decides what
runs (which requests, which KV blocks); this class runs it and reports tokens:

    prefill(batch)  -> forward over every prompt, first token of each request
    decode(batches) -> concatenate, forward over each request's last token, next token of each request
    filter / clear  -> drop requests or batches the router no longer wants

Finished requests leave their batch in the step that finishes them; their KV blocks return to the router.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import tokenizers
import torch

from specula_server.adapters.registry import AdapterRegistry, LoraBatch
from specula_server.adapters.sources import AdapterError
from specula_server.batch import Batch, StepInputs, build_step
from specula_server.distributed import ShardGroup
from specula_server.kv_cache import KVCache, slots_for_blocks
from specula_server.models.llama import LlamaForCausalLM
from specula_server.nonfinite import failure, kept_rows, nonfinite_requests
from specula_server.request import RequestSpec, RequestState, StepOutput, TokenInfo
from specula_server.sampling import Sampler, SamplingRow
from specula_server.speculation.controller import (
    AcceptancePriors, StepCostModel, choose_draft_lengths, drafting_bar, proposal_backoff,
)
from specula_server.speculation.draft_model import DraftModelDrafter
from specula_server.speculation.drafters import Draft, Drafter
from specula_server.speculation.verify import Verdict, verify

logger = logging.getLogger("specula.generator")


@dataclass(frozen=True)
class SpeculationConfig:
    """Speculative decoding of the worker: up to `max_tokens` drafts per request per step.

    `draft_model`, when the server drafts with a draft model, is that drafter (also reachable through
    `drafter`, which may be a composite): the generator sizes and allocates its KV cache beside the target's
    and asks it for the tokens of the pending drafts it proposed."""

    drafter: Drafter
    max_tokens: int
    mode: str = "adaptive"  # "adaptive" (draft lengths follow acceptance and load) or "fixed"
    draft_model: DraftModelDrafter | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.mode not in ("adaptive", "fixed"):
            raise ValueError(f"invalid speculation settings: {self.max_tokens} tokens, mode {self.mode!r}")


class InvalidRequestError(ValueError):
    """A request the worker cannot run; reported to the router as INVALID_ARGUMENT."""


class BatchNotFoundError(KeyError):
    """A batch id the worker does not hold; reported as NOT_FOUND."""


@dataclass
class StepTimings:
    forward_ns: int = 0
    decode_ns: int = 0


@dataclass
class StepResult:
    outputs: list[StepOutput]
    batch: Batch | None  # None when every request finished
    timings: StepTimings


class TextGenerator:
    MAX_RETIRED = 4096  # ended batch ids remembered, far more than the router can have in flight
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: tokenizers.Tokenizer,
        eos_token_ids: frozenset[int],
        block_size: int,
        device: torch.device,
        speculation: SpeculationConfig | None = None,
        adapters: AdapterRegistry | None = None,
        group: ShardGroup | None = None,
    ) -> None:
        self.model = model
        self.group = group or ShardGroup()
        self.adapters = adapters
        self.speculation = speculation if speculation is not None and speculation.max_tokens > 0 else None
        self.step_cost = StepCostModel()
        self.acceptance_priors = AcceptancePriors()
        self._declined_in_a_row = 0  # adaptive: steps whose drafts were all declined, since one verified
        self._steps_without_proposals = 0  # adaptive: plain steps left before drafts are proposed again
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.special_ids = frozenset(
            tid for tid, tok in tokenizer.get_added_tokens_decoder().items() if tok.special
        )
        self.block_size = block_size
        self.device = device
        self.dtype = model.norm.weight.dtype
        self.sampler = Sampler()
        self.kv_cache: KVCache | None = None
        self.batches: dict[int, Batch] = {}
        self._retired: OrderedDict[int, None] = OrderedDict()  # ids of batches that ended, oldest first

    # --- KV cache -----------------------------------------------------------------------------------------

    @property
    def draft_model(self) -> DraftModelDrafter | None:
        return self.speculation.draft_model if self.speculation is not None else None

    def bytes_per_block(self) -> int:
        """Memory one KV block costs the worker: the target's keys and values, and the draft model's."""
        cfg = self.model.config
        size = KVCache.bytes_per_block(cfg.num_layers, self.model.num_kv_heads, cfg.head_dim, self.block_size,
                                       self.dtype)
        if self.draft_model is not None:
            size += self.draft_model.bytes_per_block(self.block_size)
        return size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.clear()
        self.release_kv_cache()  # release the old caches before allocating the new ones
        cfg = self.model.config
        self.kv_cache = KVCache.allocate(
            num_blocks, self.block_size, cfg.num_layers, self.model.num_kv_heads, cfg.head_dim, self.dtype, self.device
        )
        if self.draft_model is not None:  # the same blocks, addressed by the same slots
            self.draft_model.allocate_kv_cache(num_blocks, self.block_size)

    def release_kv_cache(self) -> None:
        self.kv_cache = None
        if self.draft_model is not None:
            self.draft_model.release_kv_cache()

    # --- requests -----------------------------------------------------------------------------------------

    def _admit(self, spec: RequestSpec) -> RequestState:
        """Checks a request against the model and the cache, then builds its state."""
        cache = self.kv_cache
        if cache is None:
            raise InvalidRequestError("the KV cache is not allocated: call Warmup first")
        if not spec.input_ids:
            raise InvalidRequestError(f"request {spec.id}: empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in spec.input_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"request {spec.id}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if spec.stopping.max_new_tokens < 1:
            raise InvalidRequestError(f"request {spec.id}: max_new_tokens must be at least 1")
        total = len(spec.input_ids) + spec.stopping.max_new_tokens
        if total > self.model.config.max_position_embeddings:
            raise InvalidRequestError(
                f"request {spec.id}: {len(spec.input_ids)} prompt + {spec.stopping.max_new_tokens} new tokens "
                f"exceed the model's {self.model.config.max_position_embeddings} positions"
            )
        if len(spec.blocks) * self.block_size < total:
            raise InvalidRequestError(
                f"request {spec.id}: {len(spec.blocks)} KV blocks of {self.block_size} tokens cannot hold "
                f"{total} tokens"
            )
        if any(not 0 <= b < cache.num_blocks for b in spec.blocks):
            raise InvalidRequestError(f"request {spec.id}: KV block ids must be in [0, {cache.num_blocks})")
        if spec.cached_tokens and (spec.cached_tokens >= len(spec.input_ids) or spec.cached_tokens % self.block_size
                                   or spec.prefill_logprobs):
            raise InvalidRequestError(
                f"request {spec.id}: cached_tokens ({spec.cached_tokens}) must be whole blocks of {self.block_size} "
                f"shorter than the prompt ({len(spec.input_ids)} tokens), and 0 with prefill_logprobs")
        if spec.prefill_until and not (spec.cached_tokens < spec.prefill_until <= len(spec.input_ids)
                                       and not spec.prefill_logprobs):
            raise InvalidRequestError(
                f"request {spec.id}: prefill_until ({spec.prefill_until}) must lie past cached_tokens "
                f"({spec.cached_tokens}) and within the prompt ({len(spec.input_ids)} tokens), without "
                f"prefill_logprobs")
        if spec.adapter_id:
            if self.adapters is None:
                raise InvalidRequestError(f"request {spec.id}: this worker serves no adapters")
            try:
                self.adapters.check(spec.adapter_id)
            except AdapterError as e:
                raise InvalidRequestError(f"request {spec.id}: {e}") from None
        slots = slots_for_blocks(torch.tensor(spec.blocks, device=self.device), self.block_size)
        return RequestState.create(spec, self.tokenizer, slots, self.eos_token_ids, self.device)

    # --- steps --------------------------------------------------------------------------------------------

    def prefill(self, batch_id: int, specs: Sequence[RequestSpec]) -> StepResult:
        if batch_id in self.batches:
            raise InvalidRequestError(f"batch {batch_id} already exists")
        if not specs:
            raise InvalidRequestError("a batch needs at least one request")
        if len({s.id for s in specs}) != len(specs):
            raise InvalidRequestError("request ids within a batch must be unique")
        start = time.perf_counter_ns()
        requests = [self._admit(spec) for spec in specs]
        if any(r.spec.is_chunk for r in requests):
            return self._prefill_chunks(batch_id, requests, start)
        self._declined_in_a_row = self._steps_without_proposals = 0  # new requests may have drafts that pay
        # A reused prefix's KV is in the request's first blocks already: only the rest of the prompt is computed.
        starts = [r.spec.cached_tokens for r in requests]
        step = build_step(requests, starts, [r.prompt_len - s for r, s in zip(requests, starts)], self.device)
        return self._run(Batch(batch_id, requests), step, start, with_prefill_logprobs=True)

    @torch.inference_mode()
    def _prefill_chunks(self, batch_id: int, requests: list[RequestState], start: int) -> StepResult:
        """Chunks of long prompts: one forward that writes the chunks' KV into their blocks, and nothing else
        (no logits, no token, no state kept). The router sends each prompt's last part as a plain prefill, with
        `cached_tokens` covering the chunks, so a long prompt never stalls running requests for all of it."""
        if not all(r.spec.is_chunk for r in requests):
            raise InvalidRequestError("a Prefill holds either chunks of prompts only, or no chunk")
        assert self.kv_cache is not None
        starts = [r.spec.cached_tokens for r in requests]
        step = build_step(requests, starts, [r.spec.prefill_until - s for r, s in zip(requests, starts)],
                          self.device)
        self.model(step.input_ids, step.positions, self.kv_cache.layers, step.attn, self._lora(requests, step.counts))
        forward_done = time.perf_counter_ns()
        self._retire(batch_id)
        return StepResult([], None, StepTimings(forward_done - start, 0))

    def decode(self, batch_ids: Sequence[int]) -> StepResult:
        """One step over the named batches, concatenated into the first that still exists.

        Ids of batches that ended (all their requests finished, merged into another batch, or cleared) are
        skipped: the router sends its next Decode before it has seen the previous step's result, so it may
        name a batch that ended in that step. Ids never seen are an error.
        """
        if not batch_ids:
            raise BatchNotFoundError("no batch given")
        missing = [b for b in batch_ids if b not in self.batches and b not in self._retired]
        if missing:
            raise BatchNotFoundError(f"unknown batch ids {missing}")
        live = [b for b in batch_ids if b in self.batches]
        if not live:
            return StepResult([], None, StepTimings())
        start = time.perf_counter_ns()
        for merged in live[1:]:
            self._retire(merged)
        batch = Batch.concatenate([self.batches.pop(b) for b in live])
        reqs = batch.requests
        if self.speculation is not None:
            return self._speculative_step(batch, start)
        step = build_step(reqs, [r.num_tokens - 1 for r in reqs], [1] * len(reqs), self.device)
        return self._run(batch, step, start, with_prefill_logprobs=False)

    def filter(self, batch_id: int, keep_ids: Sequence[int]) -> Batch:
        """Keeps only the listed requests (ids of other batches may be listed too); an emptied batch ends."""
        batch = self.batches.get(batch_id)
        if batch is None:
            if batch_id in self._retired:
                return Batch(batch_id, [])
            raise BatchNotFoundError(f"unknown batch id {batch_id}")
        batch.filter(keep_ids)
        if not batch.requests:
            self.batches.pop(batch_id)
            self._retire(batch_id)
        return batch

    def clear(self, batch_id: int | None = None) -> None:
        if batch_id is None:
            self.batches.clear()
            self._retired.clear()
        elif self.batches.pop(batch_id, None) is not None:
            self._retire(batch_id)

    def _retire(self, batch_id: int) -> None:
        self._retired[batch_id] = None
        while len(self._retired) > self.MAX_RETIRED:
            self._retired.popitem(last=False)

    @torch.inference_mode()
    def _run(self, batch: Batch, step: StepInputs, start: int, with_prefill_logprobs: bool) -> StepResult:
        """Forward, sample and commit one step; `start` is when the step began (its inputs' preparation)."""
        assert self.kv_cache is not None
        lora = self._lora(batch.requests, step.counts)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache.layers, step.attn, lora)
        last_hidden = hidden[step.last_rows]
        logits = self.model.compute_logits(last_hidden)  # [num_seqs, vocab]
        forward_done = time.perf_counter_ns()

        requests, row_starts = batch.requests, step.row_starts
        failed = nonfinite_requests(logits, [1] * len(requests))
        outputs = [failure(requests[i]) for i in failed]
        if failed:  # the others go on without them: from here on every operation is row by row
            keep = [i for i in range(len(requests)) if i not in failed]
            requests, row_starts = [requests[i] for i in keep], [row_starts[i] for i in keep]
            logits, last_hidden = logits[keep], last_hidden[keep]
            if not requests:
                return self._end_step(batch, outputs, start, forward_done)
        rows = [SamplingRow(r.spec.sampling, r.history, r.generator) for r in requests]
        num_top = max(r.spec.top_n_tokens for r in requests)
        sample = self.sampler(logits, rows, num_top=num_top)
        token_ids, logprobs = sample.token_ids.tolist(), sample.logprobs.tolist()
        if self.speculation is not None and step.input_ids.numel() == len(batch.requests):  # decode steps only
            # Up to the chosen tokens: a verifying step is timed to the same point (its acceptance included).
            self.step_cost.observe(len(batch.requests), self.agreed_seconds(time.perf_counter_ns() - start))

        for i, r in enumerate(requests):
            r.last_hidden = last_hidden[i]
            prefill = None
            if with_prefill_logprobs and r.spec.prefill_logprobs:
                prefill = self._prefill_tokens(r, hidden, row_starts[i])
                if prefill is None:
                    outputs.append(failure(r, "prompt logits"))
                    continue
            token = r.append(token_ids[i], logprobs[i])
            top = self._top_tokens(sample, i, r.spec.top_n_tokens)
            out = StepOutput(r.id, [token], [top] if r.spec.top_n_tokens else [], prefill)
            if r.is_finished:
                out.generated_text = r.generated_text()
            outputs.append(out)

        return self._end_step(batch, outputs, start, forward_done)

    def _end_step(self, batch: Batch, outputs: list[StepOutput], start: int, forward_done: int) -> StepResult:
        """Drops finished and failed requests from the batch (it ends when none is left); reports the step."""
        failed = {o.request_id for o in outputs if o.error}
        batch.requests = [r for r in batch.requests if not r.is_finished and r.id not in failed]
        kept = batch if batch.requests else None
        if kept is not None:
            self.batches[batch.id] = kept
        else:
            self._retire(batch.id)
        timings = StepTimings(forward_done - start, time.perf_counter_ns() - forward_done)
        return StepResult(outputs, kept, timings)

    # --- speculative decoding -------------------------------------------------------------------------------

    def agreed_seconds(self, nanoseconds: int) -> float:
        """A step's duration as every tensor-parallel rank records it: the slowest rank's.

        The adaptive controller decides draft lengths from measured step costs; ranks that measured different
        times would decide differently and run forwards of different shapes. With one value on every rank
        (and the same acceptance, which verification already makes identical) every rank decides the same.
        """
        seconds = nanoseconds / 1e9
        if self.group.world_size == 1:
            return seconds
        agreed = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        return float(self.group.all_reduce(agreed, op="max"))

    def _draft_cap(self, r: RequestState) -> int:
        """Most drafts `r` may verify: its own cap, what it may still emit, and the positions it owns."""
        assert self.speculation is not None
        cap = self.speculation.max_tokens
        if r.spec.speculative_tokens is not None:
            cap = min(cap, r.spec.speculative_tokens)
        remaining = r.spec.stopping.max_new_tokens - r.num_generated - 1  # the target adds one token itself
        room = min(r.capacity, self.model.config.max_position_embeddings) - r.num_tokens
        return max(0, min(cap, remaining, room))

    @torch.inference_mode()
    def _speculative_step(self, batch: Batch, start: int) -> StepResult:
        """propose → verify (one forward over `[last, d1..dk]` per request) → accept → commit."""
        assert self.speculation is not None and self.kv_cache is not None
        reqs = batch.requests
        adaptive = self.speculation.mode == "adaptive"
        if adaptive and self._steps_without_proposals > 0:
            self._steps_without_proposals -= 1
            self.step_cost.declined()
            return self._plain_step(batch, start)
        drafter = self.speculation.drafter
        methods = [drafter.method_for(r) for r in reqs]
        acceptance = [r.acceptance.estimate(self.acceptance_priors.value(m)) for r, m in zip(reqs, methods)]
        bar = drafting_bar(len(reqs), self.step_cost) if adaptive else -1.0
        caps = [self._draft_cap(r) if a > bar else 0 for r, a in zip(reqs, acceptance)]
        try:
            proposals = self.speculation.drafter.propose(reqs, caps)
        except Exception:  # drafts only ever save time: a drafter's failure must not fail the requests
            logger.exception("drafting failed; this step verifies no drafts")
            return self._plain_step(batch, start)
        lengths = choose_draft_lengths([p.available for p in proposals], acceptance, self.step_cost,
                                       self.speculation.mode)
        if not any(lengths):  # nothing worth verifying: a plain step, at a plain step's cost
            if any(p.available for p in proposals):
                self.step_cost.declined()
                self._declined_in_a_row += 1
                self._steps_without_proposals = proposal_backoff(self._declined_in_a_row)
            return self._plain_step(batch, start)
        self._declined_in_a_row = 0
        try:
            drafts = self._draft_pending(reqs, [p.truncated(k) for p, k in zip(proposals, lengths)])
        except Exception:
            logger.exception("drafting failed; this step verifies no drafts")
            return self._plain_step(batch, start)
        return self._verify_step(batch, drafts, [m if len(d) else "" for m, d in zip(methods, drafts)], start)

    def _verify_step(self, batch: Batch, drafts: list[Draft], methods: list[str], start: int) -> StepResult:
        """verify → accept → commit: one forward over `[last, d1..dk]` per request, then the exact rule."""
        assert self.kv_cache is not None
        reqs = batch.requests
        for r, d in zip(reqs, drafts):  # the buffer tail past num_tokens is free: drafts go there
            r.token_ids[r.num_tokens : r.num_tokens + len(d)] = d.tokens
        trees = [None if d.is_chain else d for d in drafts]
        counts = [len(d) + 1 for d in drafts]
        step = build_step(reqs, [r.num_tokens - 1 for r in reqs], counts, self.device, trees)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache.layers, step.attn,
                            self._lora(reqs, counts))
        logits = self.model.compute_logits(hidden)  # [sum(counts), vocab]
        forward_done = time.perf_counter_ns()

        num_seqs, num_drafted, row_starts = len(reqs), sum(counts) - len(counts), step.row_starts
        failed = nonfinite_requests(logits, counts)  # any verified row: its drafts' rows are its logits too
        outputs = [failure(reqs[i]) for i in failed]
        if failed:  # the others go on without them: from here on every operation is row by row
            keep = [i for i in range(num_seqs) if i not in failed]
            rows, row_starts = kept_rows(counts, keep)
            hidden, logits = hidden[rows], logits[rows]
            reqs, drafts, methods = ([x[i] for i in keep] for x in (reqs, drafts, methods))
            if not reqs:
                return self._end_step(batch, outputs, start, forward_done)
        verdicts, processed = verify(logits, reqs, drafts, row_starts, self.sampler)
        # Timed up to the accepted tokens, as plain steps are up to their sampled ones: drawing and checking a
        # token at every verified position is part of what a draft costs (a sampling request's rows most of all).
        self.step_cost.observe_speculative(num_seqs, self.agreed_seconds(time.perf_counter_ns() - start),
                                          num_drafted)
        self._compact_accepted_paths(reqs, drafts, verdicts)
        scores = processed if processed is not None else logits
        outputs += [self._commit_verdict(r, v, method, hidden, scores, normalized=processed is not None)
                    for r, v, method in zip(reqs, verdicts, methods)]
        return self._end_step(batch, outputs, start, forward_done)

    def _commit_verdict(self, r: RequestState, v: Verdict, method: str, hidden: torch.Tensor,
                        scores: torch.Tensor, normalized: bool) -> StepOutput:
        """Appends a request's accepted tokens (up to a stop) and updates its acceptance statistics."""
        r.last_hidden = hidden[v.rows[-1]]
        tokens = []
        for token_id, logprob in zip(v.token_ids, v.logprobs):
            tokens.append(r.append(token_id, logprob))
            if r.is_finished:
                break  # nothing after a stop is emitted or counted
        r.acceptance.observe(v.num_drafted, v.num_accepted)
        self.acceptance_priors.observe(method, v.num_drafted, v.num_accepted)
        # The draft model's KV is valid up to the last accepted draft it ran over; the target's own token
        # (correction or bonus) is run over before the next draft.
        r.draft_cached = min(r.draft_cached, r.num_tokens - 1)
        tops = self._row_top_tokens(scores, v.rows[: len(tokens)], r.spec.top_n_tokens, normalized=normalized)
        out = StepOutput(r.id, tokens, tops, num_drafted=v.num_drafted,
                         num_accepted=min(v.num_accepted, len(tokens)), draft_method=method)
        if r.is_finished:
            out.generated_text = r.generated_text()
        return out

    def _plain_step(self, batch: Batch, start: int) -> StepResult:
        """A step that verifies no drafts (each request's acceptance estimate drifts back to the prior)."""
        for r in batch.requests:
            r.acceptance.observe(0, 0)
        step = build_step(batch.requests, [r.num_tokens - 1 for r in batch.requests], [1] * len(batch.requests),
                          self.device)
        return self._run(batch, step, start, with_prefill_logprobs=False)

    def _draft_pending(self, reqs: Sequence[RequestState], drafts: list[Draft]) -> list[Draft]:
        """Has the draft model draft the tokens of pending drafts, exactly as many as the controller granted."""
        pending = [i for i, d in enumerate(drafts) if d.pending]
        if not pending:
            return drafts
        assert self.draft_model is not None, "a drafter proposed pending drafts but the worker has no draft model"
        drafted = self.draft_model.draft([reqs[i] for i in pending], [drafts[i].pending for i in pending])
        for i, d in zip(pending, drafted):
            drafts[i] = d
        return drafts

    def _compact_accepted_paths(self, reqs: Sequence[RequestState], drafts: Sequence[Draft],
                                verdicts: Sequence[Verdict]) -> None:
        """Moves the KV of each tree's accepted nodes to the positions they now hold in the sequence.

        Node i was written at buffer index `num_tokens + i`; the accepted node at depth d belongs at
        `num_tokens + d - 1`. Chains, and tree paths along the first nodes, are already in place. Rejected
        nodes' slots are past the sequence's end and are overwritten by later steps, never read.
        """
        assert self.kv_cache is not None
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
            self.kv_cache.move(torch.cat(src), torch.cat(dst))

    def _lora(self, requests: Sequence[RequestState], counts: Sequence[int]) -> LoraBatch | None:
        if self.adapters is None:
            return None
        return self.adapters.batch([r.spec.adapter_id for r in requests], counts)

    def _row_top_tokens(self, scores: torch.Tensor, rows: list[int], n: int, normalized: bool) -> list[list[TokenInfo]]:
        if n == 0:
            return []
        selected = scores[rows].float()
        if not normalized:
            selected = torch.log_softmax(selected, dim=-1)
        top = selected.topk(n, dim=-1)
        return [
            [TokenInfo(t, lp, self.tokenizer.decode([t], skip_special_tokens=False), t in self.special_ids)
             for t, lp in zip(ids, lps)]
            for ids, lps in zip(top.indices.tolist(), top.values.tolist())
        ]

    def _prefill_tokens(self, r: RequestState, hidden: torch.Tensor, row_start: int) -> list[TokenInfo] | None:
        """Log-probability of every prompt token given the ones before it (the first has none); None when
        some prompt position's logits are not finite."""
        prompt = r.token_ids[: r.prompt_len]
        logits = self.model.compute_logits(hidden[row_start : row_start + r.prompt_len - 1])
        if nonfinite_requests(logits, [logits.shape[0]]):
            return None
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, prompt[1:].to(self.device).unsqueeze(1))
        values = [math.nan] + logprobs.squeeze(1).tolist()
        ids = prompt.tolist()
        return [
            TokenInfo(t, lp, self.tokenizer.decode([t], skip_special_tokens=False), t in self.special_ids)
            for t, lp in zip(ids, values)
        ]

    def _top_tokens(self, sample, row: int, n: int) -> list[TokenInfo]:
        if n == 0:
            return []
        ids = sample.top_ids[row, :n].tolist()
        lps = sample.top_logprobs[row, :n].tolist()
        return [
            TokenInfo(t, lp, self.tokenizer.decode([t], skip_special_tokens=False), t in self.special_ids)
            for t, lp in zip(ids, lps)
        ]
