"""The worker's engine: it keeps the requests the router sent, by id, and runs the steps the router orders.

`TextGenerator.step(plan)` is one step of the per-step contract (`StepPlan`, the Step RPC), or a few when the
router asks for several decode steps in one call:

    requests leave          `finished`: the router ended them (cancelled, failed, preempted)
    requests change         `updates`: KV blocks appended as they grow; a long prompt's next chunk
    requests join           `new`: the prompt (or its first chunk) is computed this step
    one step runs           every request whose prompt is done decodes one token (and verifies its drafts,
                            see `Speculator`); every prompt chunk named this step is computed; a prompt
                            whose last chunk ran yields its first token: one forward over all of them
                            (`step_rows.py`), or two while the decodes replay a CUDA graph
    more decode steps       up to `decode_steps - 1`, while every request the worker holds decodes (no prompt
                            chunk, no grammar compiling) and its blocks cover its next token, and until the
                            caller says a call with newcomers waits (every rank agrees); each request's tokens
                            of all of them make one output (`StepOutput.extend`)

Requests leave on their own in the step that finishes them (stop, EOS, max_new_tokens) or fails them (their
logits were not finite, their blocks did not cover the step); the router frees their blocks.

Beside it: `request_checks.py` (what the router sends, checked), `step_outputs.py` (logits → tokens → outputs),
`speculative_step.py` (verified drafts accepted and committed), `step_graphs.py` (the CUDA graphs it replays).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import tokenizers
import torch

from specula_kernels.cuda_graphs import GraphCaptureError
from specula_kernels.paged_attention import BlockTableInputs
from specula_server.adapters.registry import AdapterRegistry, LoraBatch
from specula_server.batch import StepInputs, build_step
from specula_server.distributed import ShardGroup
from specula_server.grammar import GrammarCompiler
from specula_server.kv_cache import KVCache
from specula_server.models.llama import LlamaForCausalLM
from specula_server.request import InvalidRequestError, RequestSpec, RequestState, RequestUpdate, StepOutput, StepPlan
from specula_server.request_checks import block_slots, check_new_request, chunk_end
from specula_server.sampling import Sampler
from specula_server.speculation.draft_model import DraftModelDrafter
from specula_server.speculation.drafters import Draft
from specula_server.speculation.eagle3_drafter import Eagle3Drafter
from specula_server.speculation.speculator import SpeculationConfig, Speculator
from specula_server.speculative_step import accept_drafts, keep_aux
from specula_server.step_graphs import StepGraphs, capture_all_or_none, default_graph_batch_sizes, unavailable
from specula_server.step_outputs import (
    StepResult,
    StepTimings,
    TokenReports,
    commit_prompts,
    commit_sampled,
    first_tokens,
    sample,
    screen,
)
from specula_server.step_rows import Decodes, PromptChunks

__all__ = ["InvalidRequestError", "SpeculationConfig", "StepPlan", "TextGenerator"]

logger = logging.getLogger("specula.generator")


class TextGenerator:
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
        kv_cache_dtype: torch.dtype | None = None,
        cuda_graphs: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.group = group or ShardGroup()
        self.adapters = adapters
        self.speculation = speculation if speculation is not None and speculation.max_tokens > 0 else None
        self.speculator = None if self.speculation is None else Speculator(
            self.speculation, model.config.max_position_embeddings, self.agreed_seconds)
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.device = device
        self.dtype = model.norm.weight.dtype
        # What the KV cache stores keys and values in (--kv-cache-dtype); by default the compute dtype.
        self.kv_cache_dtype = kv_cache_dtype or self.dtype
        self.sampler = Sampler()
        self.reports = TokenReports(tokenizer)  # top-n alternatives and prompt log-probs, with their text
        self.kv_cache: KVCache | None = None
        self.requests: dict[int, RequestState] = {}
        self._grammars: GrammarCompiler | None = None  # built with the first constrained request
        # Prompts computed whose grammar is still compiling: request id -> (logits, final hidden) of their last
        # position; their first token is chosen from these once the grammar is ready, without another forward.
        self._waiting: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Batch sizes whose decode and verification steps replay CUDA graphs (None: the defaults; empty: none),
        # and the runner of those graphs, built with the KV cache they read (None: every step eager).
        self.cuda_graph_sizes = default_graph_batch_sizes() if cuda_graphs is None else tuple(cuda_graphs)
        self.graphs: StepGraphs | None = None
        # Decodes and prompt chunks of a step share one forward (False: one forward each, a benchmark's baseline).
        self.one_forward = True

    def suffix_cache_size(self) -> tuple[int, int]:
        """(tokens, nodes) of suffix decoding's global trees; (0, 0) without it."""
        drafter = self.speculation.drafter if self.speculation is not None else None
        cache = getattr(getattr(drafter, "fallback", drafter), "cache", None)
        return (cache.num_tokens, cache.num_nodes) if cache is not None else (0, 0)

    # --- KV cache -----------------------------------------------------------------------------------------

    @property
    def draft_model(self) -> DraftModelDrafter | Eagle3Drafter | None:
        return self.speculation.draft_model if self.speculation is not None else None

    @property
    def eagle(self) -> Eagle3Drafter | None:
        """The EAGLE-3 drafter, which reads the target's auxiliary hidden states after every forward."""
        return self.draft_model if isinstance(self.draft_model, Eagle3Drafter) else None

    def bytes_per_block(self) -> int:
        """Memory one KV block costs the worker: the target's keys and values, and the draft model's."""
        cfg = self.model.config
        size = KVCache.bytes_per_block(cfg.num_layers, self.model.num_kv_heads, cfg.head_dim, self.block_size,
                                       self.kv_cache_dtype)
        if self.draft_model is not None:
            size += self.draft_model.bytes_per_block(self.block_size)
        return size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.reset()
        self.release_kv_cache()  # release the old caches before allocating the new ones
        cfg = self.model.config
        graphs = bool(self.cuda_graph_sizes) and self.graphs_unavailable() is None
        self.kv_cache = KVCache.allocate(
            num_blocks, self.block_size, cfg.num_layers, self.model.num_kv_heads, cfg.head_dim, self.kv_cache_dtype,
            self.device, extra_slots=1 if graphs else 0,
        )
        if graphs:
            max_draft = self.speculation.max_tokens if self.speculation is not None else 0
            self.graphs = StepGraphs(self.model, self.kv_cache, self.cuda_graph_sizes, max_draft,
                                     lambda: self._aux_layer_ids, self.device)
        if self.draft_model is not None:  # the same blocks, addressed by the same slots
            self.draft_model.allocate_kv_cache(num_blocks, self.block_size)

    def capture_graphs(self) -> None:
        """Captures every CUDA graph now (a server's warmup), so that no request waits for one; a capture that
        fails turns graphs off."""
        if self.graphs is not None:
            self.graphs = capture_all_or_none(self.graphs)

    def graphs_unavailable(self) -> str | None:
        """Why decode steps cannot replay CUDA graphs here (None: they can)."""
        return unavailable(self.device, self.group, self.kv_cache_dtype, self.model.config.head_dim)

    def release_kv_cache(self) -> None:
        self.graphs = None  # they read the cache's tensors
        self.kv_cache = None
        if self.draft_model is not None:
            self.draft_model.release_kv_cache()

    def reset(self) -> None:
        """Drops every request (Warmup: a router starts afresh)."""
        for request_id in list(self.requests):
            self._leave(request_id)

    def _leave(self, request_id: int) -> None:
        """A request leaves the worker (finished, failed, or ended by the router)."""
        r = self.requests.pop(request_id, None)
        self._waiting.pop(request_id, None)
        if r is not None and self.speculator is not None:
            self.speculator.release(r)

    # --- requests -----------------------------------------------------------------------------------------

    def _slots(self, request_id: int, blocks: Sequence[int]) -> torch.Tensor:
        assert self.kv_cache is not None
        return block_slots(request_id, blocks, self.kv_cache.num_blocks, self.block_size, self.device)

    def _admit(self, spec: RequestSpec) -> RequestState:
        """Checks a new request (`check_new_request`), then builds its state."""
        check_new_request(spec, self.requests, self.model.config, self.block_size, self.adapters)
        grammar = self.grammars.start(spec.grammar, spec.generated_ids) if spec.grammar else None
        return RequestState.create(spec, self.tokenizer, self._slots(spec.id, spec.blocks), self.eos_token_ids,
                                   self.device, grammar)

    @property
    def grammars(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
        return self._grammars

    def _update(self, r: RequestState, update: RequestUpdate) -> int | None:
        """Appends an update's blocks; returns the end of the prompt chunk it schedules (None: none)."""
        if update.new_blocks:
            r.grow(self._slots(r.id, update.new_blocks))
        return chunk_end(r, update)

    # --- the step -----------------------------------------------------------------------------------------

    def step(self, plan: StepPlan, newcomers_waiting: Callable[[], bool] | None = None) -> StepResult:
        """Applies `plan`, runs one step over every request, then the further decode steps it allows (see the
        module's docstring) until `newcomers_waiting()` says a call with new requests waits behind this one.
        `StepResult.steps` says how many ran."""
        if self.kv_cache is None:
            raise InvalidRequestError("the KV cache is not allocated: call Warmup first")
        result = self._step(plan)
        while (result.steps < plan.decode_steps and self._may_decode_again()
               and not self._agreed(newcomers_waiting is not None and newcomers_waiting())):
            result.merge(self._step(StepPlan()))
        return result

    def _agreed(self, flag: bool) -> bool:
        """`flag` on any rank: every rank of a tensor-parallel group runs the same steps."""
        return self.group.agreed_max(float(flag), self.device) > 0 if self.group.world_size > 1 else flag

    def _may_decode_again(self) -> bool:
        """Whether a further decode step of one call may run: every request decodes, and its blocks cover the
        position of its next token (a request without one would fail; the router grows it at the next call)."""
        return bool(self.requests) and not self._waiting and all(
            not r.is_prefilling and r.capacity >= r.num_tokens for r in self.requests.values())

    def _step(self, plan: StepPlan) -> StepResult:
        start = time.perf_counter_ns()
        for request_id in plan.finished:
            self._leave(request_id)
        outputs: list[StepOutput] = []
        refused: list[StepOutput] = []  # new requests that never joined (one may carry a running request's id)
        chunks: dict[int, int] = {}  # request id -> end of the prompt chunk it computes this step
        for update in plan.updates:
            r = self.requests.get(update.id)
            if r is None:
                continue  # it finished in an earlier step the router had not seen yet
            try:
                until = self._update(r, update)
            except InvalidRequestError as e:
                outputs.append(self._drop(r.id, str(e)))
                continue
            if until is not None:
                chunks[r.id] = until
        for spec in plan.new:
            try:
                r = self._admit(spec)
            except InvalidRequestError as e:
                refused.append(StepOutput(spec.id, [], [], error=str(e)))
                continue
            self.requests[r.id] = r
            chunks[r.id] = spec.prefill_until or r.num_tokens
        timings = StepTimings()
        decoding = []
        for r in [r for r in self.requests.values() if not r.is_prefilling and r.id not in self._waiting]:
            if r.capacity >= r.num_tokens:
                decoding.append(r)
            else:  # the router grows blocks before a step needs them: a request without one fails alone
                outputs.append(self._drop(r.id, f"request {r.id}: its {r.capacity} KV positions do not cover "
                                                f"position {r.num_tokens - 1} of this step"))
        ready = [self.requests[i] for i in self._waiting if self.requests[i].grammar.is_ready]
        if ready:  # their first token, this step, from the logits their prefill kept; they decode from the next
            outputs += first_tokens(ready, [self._waiting.pop(r.id) for r in ready], self.sampler, self.reports,
                                    self.model.config.vocab_size)
        if decoding or chunks:
            outputs += self._run(decoding, [(self.requests[i], until) for i, until in chunks.items()], timings)
        for out in outputs:
            r = self.requests.get(out.request_id)
            if out.error or (r is not None and r.is_finished):
                self._leave(out.request_id)
        timings.decode_ns = time.perf_counter_ns() - start - timings.forward_ns
        return StepResult(refused + outputs, timings)

    def _drop(self, request_id: int, error: str) -> StepOutput:
        self._leave(request_id)
        return StepOutput(request_id, [], [], error=error)

    @torch.inference_mode()
    def _run(self, decoding: list[RequestState], items: list[tuple[RequestState, int]], timings: StepTimings
             ) -> list[StepOutput]:
        """The step's forward: every decode (plain, or verifying the drafts the speculator plans) and every prompt
        chunk in one, or one forward each while the decodes replay a CUDA graph (graphs hold decode shapes only)."""
        start = time.perf_counter_ns()
        decodes = Decodes.of(decoding, self.speculator, self.model.config.vocab_size) if decoding else None
        chunks = PromptChunks.of(items, self.model.config.vocab_size) if items else None
        if decodes is not None and chunks is not None and self.graphs is None and self.one_forward:
            reqs = decodes.reqs + chunks.reqs
            step = build_step(reqs, decodes.starts + chunks.starts, decodes.counts + chunks.counts, self.device,
                              decodes.trees + [None] * len(chunks.reqs), split=len(decodes.reqs))
            hidden, aux = self._forward(reqs, step)
            n, rows = len(decodes.reqs), sum(decodes.counts)
            # The decodes' step time includes the chunks: the speculator's cost model does not observe it.
            outputs = self._decoded(decodes, hidden[:rows], None if aux is None else aux[:rows], step.row_starts[:n],
                                    step.last_rows[:n], start, timings, observe=False)
            return outputs + self._prefilled(chunks, hidden, aux, step.row_starts[n:], step.last_rows[n:],
                                             time.perf_counter_ns(), timings)
        outputs = []
        if decodes is not None:
            step = self._build_step(decodes.reqs, decodes.counts, decodes.trees)
            hidden, aux = self._forward(decodes.reqs, step)
            outputs += self._decoded(decodes, hidden, aux, step.row_starts, step.last_rows, start, timings,
                                     observe=True)
        if chunks is not None:
            start = time.perf_counter_ns()
            step = build_step(chunks.reqs, chunks.starts, chunks.counts, self.device)
            hidden, aux = self._forward(chunks.reqs, step)
            outputs += self._prefilled(chunks, hidden, aux, step.row_starts, step.last_rows, start, timings)
        return outputs

    def _forward(self, requests: Sequence[RequestState], step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final hidden states of the step's rows, and the auxiliary ones an EAGLE-3 drafter reads (else None)."""
        assert self.kv_cache is not None
        if self.graphs is not None and isinstance(step.attn, BlockTableInputs):
            try:
                return self.graphs.run_step(step)
            except GraphCaptureError as error:
                logger.warning("CUDA graphs turned off, every step runs eagerly from now on: %s", error)
                self.graphs = None
        return self.model.forward_with_aux(step.input_ids, step.positions, self.kv_cache.layers, step.attn,
                                           self._lora(requests, step.counts), self._aux_layer_ids)

    @property
    def _aux_layer_ids(self) -> tuple[int, ...]:
        return self.eagle.layer_ids if self.eagle is not None else ()

    def _build_step(self, reqs: Sequence[RequestState], counts: Sequence[int],
                    trees: Sequence[Draft | None] | None = None) -> StepInputs:
        """A decode or verification step (each request feeds its last token and `counts[i] - 1` drafts): in the
        form a CUDA graph replays when one holds it, else the general one."""
        step = self.graphs.build_step(reqs, counts, trees) if self.graphs is not None else None
        return step or build_step(reqs, [r.num_tokens - 1 for r in reqs], counts, self.device, trees)

    def _decoded(self, d: Decodes, hidden: torch.Tensor, aux: torch.Tensor | None, row_starts: list[int],
                 last_rows: torch.Tensor, start: int, timings: StepTimings, observe: bool) -> list[StepOutput]:
        """The decodes' tokens from their rows of the forward: sampled, or drafts accepted by the exact rule. The
        step (timed from `start`) is priced for the speculator when `observe`."""
        reqs = d.reqs
        if d.plan is not None:
            logits = self.model.compute_logits(hidden)  # [sum(counts), vocab]
            timings.forward_ns += time.perf_counter_ns() - start
            return accept_drafts(reqs, d.plan, d.counts, hidden, aux, logits, row_starts, d.masks,
                                 start if observe else None, speculator=self.speculator, sampler=self.sampler,
                                 kv_cache=self.kv_cache, reports=self.reports, eagle=self.eagle)
        keep_aux(self.eagle, reqs, aux, [slice(i, i + 1) for i in range(len(reqs))], [r.num_tokens - 1 for r in reqs])
        last_hidden = hidden[last_rows]
        logits = self.model.compute_logits(last_hidden)
        timings.forward_ns += time.perf_counter_ns() - start
        outputs, kept, logits = screen(reqs, logits, [1] * len(reqs), d.masks)
        if not kept:
            return outputs
        chosen = sample(self.sampler, [reqs[i] for i in kept], logits)
        if self.speculator is not None and observe:  # timed up to the chosen tokens, as a verifying step is
            self.speculator.observe_plain(len(reqs), time.perf_counter_ns() - start)
        outputs += commit_sampled([reqs[i] for i in kept], chosen, last_hidden[kept], self.reports)
        if self.eagle is not None:
            live = [r for r in reqs if not r.is_finished]
            speculator = self.speculator
            self.eagle.bound_kept_rows(live, None if speculator is None else (
                lambda over: speculator.could_draft(over, len(live))))
        return outputs

    def _prefilled(self, c: PromptChunks, hidden: torch.Tensor, aux: torch.Tensor | None, row_starts: list[int],
                   last_rows: torch.Tensor, start: int, timings: StepTimings) -> list[StepOutput]:
        """After the chunks' rows of the forward (from `row_starts[i]`): each has written its KV; a prompt whose
        end ran yields its first token, or waits with its last logits for its grammar."""
        reqs = c.reqs
        keep_aux(self.eagle, reqs, aux, [slice(s, s + n) for s, n in zip(row_starts, c.counts)], c.starts)
        for r, until in zip(reqs, c.untils):
            r.prefilled = until
        if c.waiting:
            waiting_hidden = hidden[last_rows[c.waiting]]
            for i, h, row in zip(c.waiting, waiting_hidden, self.model.compute_logits(waiting_hidden)):
                self._waiting[reqs[i].id] = (row, h)
                reqs[i].prefilled = None
        if not c.done:
            timings.forward_ns += time.perf_counter_ns() - start
            return []
        last_hidden = hidden[last_rows[c.done]]
        logits = self.model.compute_logits(last_hidden)
        timings.forward_ns += time.perf_counter_ns() - start
        reqs, row_starts = [reqs[i] for i in c.done], [row_starts[i] for i in c.done]
        for r in reqs:
            r.prefilled = None

        def prompt_logits(i: int) -> torch.Tensor:  # of request i's prompt positions but the last
            return self.model.compute_logits(hidden[row_starts[i] : row_starts[i] + reqs[i].prompt_len - 1])

        return commit_prompts(reqs, logits, last_hidden, c.masks, self.sampler, self.reports, prompt_logits)

    # --- speculative decoding -------------------------------------------------------------------------------

    def agreed_seconds(self, nanoseconds: int) -> float:
        """A step's duration as every tensor-parallel rank records it (the slowest rank's): ranks that measured
        different times would choose different draft lengths and run forwards of different shapes."""
        return self.group.agreed_max(nanoseconds / 1e9, self.device)

    def _lora(self, requests: Sequence[RequestState], counts: Sequence[int]) -> LoraBatch | None:
        if self.adapters is None:
            return None
        return self.adapters.batch([r.spec.adapter_id for r in requests], counts)
