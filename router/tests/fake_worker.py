"""A fake set of shards for scheduler tests: answers Step like a worker, without a model.

Request r's k-th generated token is `1000 * r + k` with text "t{k} " on the base model and "{adapter}:t{k} "
with an adapter; a request finishes after max_new_tokens (or with EOS after `eos_after` tokens). A request
resumed after a preemption (`generated_ids`) goes on from its k-th token, as the worker does, so its tokens are
those it would produce alone.

Like the real worker, steps start when they are made and run strictly in order (a FIFO lock), with the Step
semantics of proto/generate.proto: `finished` leave first (unknown ids ignored), then `updates` apply (blocks
appended, a prompt's next chunk), then `new_requests` join, then one step runs over every request whose prompt
is done and every prompt chunk named; a step asking for several decode steps runs more while every request it
holds decodes, each writing only within the blocks it holds (which the router must have granted for all of
them), and a request's tokens of all of them come back as one generation. A request that finished or failed in
the worker leaves on its own; an
update naming it later is ignored. A new request naming an adapter that is not loaded is refused alone (an
error for it). A step made to fail (`fail_next`) fails after it was applied, as a worker whose forward raised.

It fails loudly on what would be a router bug (`misuse` lists them; the step raises AssertionError): a step out
of sequence, an update or a duplicate for a request it never held, a chunk for a request that is not
prefilling, a step that writes past a request's blocks, a block written by one request while another holds it,
a block id outside the cache, a block listed twice.

LoadAdapter and OffloadAdapter run beside the steps, as in the worker; each adapter's load can be made slow or
failing (`AdapterBehaviour`), and `max_adapter_slots` refuses loads past the workers' slots. Calls are recorded
so tests can check what the router sent; `offloaded_in_use` lists offloads of an adapter a live request used.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specula_proto import generate_pb2 as pb
from specula_router.client import ShardError
from specula_router.entries import FinalEvent, TokenOut
from specula_router.step_messages import GenerationOut, NewRequest, RequestUpdate, StepResponse, StepTimings


@dataclass
class AdapterBehaviour:
    """How the fake answers LoadAdapter for one adapter."""

    delay: float = 0.0  # seconds the load takes
    error: str | None = None  # set: the load fails with this message ...
    status: int = 424  # ... and this status
    kind: str = "lora"


@dataclass(frozen=True)
class SentStep:
    """A step as the router sent it: the Step RPC's request, in the router's own messages."""

    sequence: int
    finished: tuple[int, ...]
    updates: tuple[RequestUpdate, ...]
    new_requests: tuple[NewRequest, ...]
    decode_steps: int = 1


@dataclass
class Held:
    """A request the fake worker holds."""

    request: NewRequest
    blocks: list[int]
    context_len: int  # prompt + generated_ids
    computed: int  # context positions whose KV is written
    generated: int  # tokens generated so far, those of `generated_ids` included
    chunk_until: int | None = None  # set for the step that computes its next prompt chunk
    new_this_step: bool = False

    @property
    def prefilling(self) -> bool:
        return self.computed < self.context_len


@dataclass
class FakeClient:
    step_delay: float = 0.0
    max_adapter_slots: int | None = None
    block_size: int | None = None  # set: positions are checked against the requests' blocks
    num_blocks: int | None = None  # set: block ids are checked against the cache
    lookahead: int = 0  # positions past a decoded token a step may write (speculative drafts)
    eos_after: int | None = None  # set: every request ends with EOS after this many tokens
    held: dict[int, Held] = field(default_factory=dict)
    retired: set[int] = field(default_factory=set)  # finished or failed in the worker
    generated: dict[int, int] = field(default_factory=dict)
    calls: list[tuple[str, object]] = field(default_factory=list)
    steps: list[SentStep] = field(default_factory=list)  # every step as sent
    prefilled: list[NewRequest] = field(default_factory=list)  # every new request as a step sent it
    misuse: list[str] = field(default_factory=list)
    fail_next: str | None = None  # "prefill" or "decode": the next such step fails (see `_method`)
    raise_next: tuple[str, Exception] | None = None  # (method, error): the next such step raises it
    failing_rows: set[int] = field(default_factory=set)  # requests that fail alone in their next step
    hang: str | None = None  # "prefill" or "decode": such steps never answer (a stopped shard)
    adapters: dict[str, AdapterBehaviour] = field(default_factory=dict)  # per adapter id; others load at once
    loaded_adapters: set[str] = field(default_factory=set)
    adapter_calls: list[tuple[str, str]] = field(default_factory=list)  # ("load" | "offload", adapter id)
    load_requests: list[pb.LoadAdapterRequest] = field(default_factory=list)
    load_merges: list = field(default_factory=list)  # each load's MergeSpec (None: a plain adapter)
    offloaded_in_use: list[str] = field(default_factory=list)
    _sequence_sent: int = 0
    _sequence_run: int = 0
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    # --- Step ----------------------------------------------------------------------------------------------

    def step(self, finished, updates, new_requests, decode_steps=1):
        self._sequence_sent += 1
        # Copied as sent, as the wire would: the planner's objects are its own.
        request = SentStep(self._sequence_sent, tuple(finished),
                           tuple(RequestUpdate(u.id, list(u.new_blocks), u.prefill_until) for u in updates),
                           tuple(new_requests), decode_steps)
        self.steps.append(request)
        self.calls.append(("step", request))
        self.prefilled.extend(request.new_requests)
        return asyncio.ensure_future(self._in_order(request))

    async def _in_order(self, request: SentStep) -> StepResponse:
        async with self._lock:
            self._check(request.sequence == self._sequence_run + 1,
                        f"step {request.sequence} ran after step {self._sequence_run}")
            self._sequence_run = request.sequence
            method = self._method(request)
            await asyncio.sleep(self.step_delay)
            if self.hang == method:
                await asyncio.Event().wait()
            refused = self._apply(request)
            self._maybe_fail(method)
            response = self._run()
            steps = 1
            while steps < request.decode_steps and self.held and not any(h.prefilling for h in self.held.values()):
                response = _merged(response, self._run())
                steps += 1
            response.generations[:0] = refused
            return StepResponse(response.generations, response.timings, decode_steps=steps)

    def _method(self, request: SentStep) -> str:
        """"prefill": the step computes prompts; "decode": it only decodes; "idle": it runs nothing."""
        if request.new_requests or any(u.id in self.held and self.held[u.id].prefilling for u in request.updates):
            return "prefill"
        decoding = [i for i, held in self.held.items() if not held.prefilling and i not in request.finished]
        return "decode" if decoding else "idle"

    def _maybe_fail(self, method: str) -> None:
        if self.fail_next == method:
            self.fail_next = None
            raise ShardError("Step failed: shard exploded")
        if self.raise_next is not None and self.raise_next[0] == method:
            error, self.raise_next = self.raise_next[1], None
            raise error

    def _check(self, ok: bool, message: str) -> None:
        if not ok:
            self.misuse.append(message)
            raise AssertionError(f"fake worker: {message}")

    def _check_blocks(self, blocks) -> None:
        self._check(len(set(blocks)) == len(blocks), f"a block listed twice in {list(blocks)}")
        if self.num_blocks is not None:
            self._check(all(b < self.num_blocks for b in blocks), f"a block outside the cache in {list(blocks)}")

    def _apply(self, step: SentStep) -> list[GenerationOut]:
        """Applies a step's changes; returns the errors of the new requests it refused."""
        refused = []
        for request_id in step.finished:
            self.held.pop(request_id, None)
        for update in step.updates:
            held = self.held.get(update.id)
            if held is None:
                self._check(update.id in self.retired, f"update for request {update.id}, never held")
                continue
            held.blocks += update.new_blocks
            self._check_blocks(held.blocks)
            if update.prefill_until:
                self._check(held.prefilling and held.computed < update.prefill_until <= held.context_len,
                            f"a chunk to {update.prefill_until} for request {update.id}, prefilled to "
                            f"{held.computed} of {held.context_len}")
            if held.prefilling:  # named: it computes its next chunk (0: the rest of its prompt)
                held.chunk_until = update.prefill_until or held.context_len
        for request in step.new_requests:
            self._check(request.id not in self.held, f"new request {request.id} already held")
            if request.adapter_id and request.adapter_id not in self.loaded_adapters:
                self.retired.add(request.id)
                refused.append(GenerationOut(request.id, error=f"request {request.id}: adapter "
                                                               f"`{request.adapter_id}` is not loaded on this worker"))
                continue
            context_len = len(request.input_ids) + len(request.generated_ids)
            self._check(request.cached_tokens < context_len, f"request {request.id}: cached_tokens past its context")
            if self.block_size:
                self._check(request.cached_tokens % self.block_size == 0, "cached_tokens not on a block")
            self._check_blocks(request.blocks)
            held = Held(request, list(request.blocks), context_len, request.cached_tokens,
                        len(request.generated_ids), request.prefill_until or context_len, True)
            self.held[request.id] = held
            self.retired.discard(request.id)
        return refused

    def _write(self, held: Held, start: int, stop: int, owners: dict[int, set[int]]) -> None:
        """The step writes positions [start, stop) of a request's KV: into its own blocks only."""
        if not self.block_size:
            return
        size, request_id = self.block_size, held.request.id
        self._check(stop <= len(held.blocks) * size,
                    f"request {request_id} writes position {stop - 1} with {len(held.blocks)} blocks of {size}")
        for block in held.blocks[start // size: -(-stop // size)]:
            others = owners.get(block, set()) - {request_id}
            self._check(not others, f"request {request_id} writes block {block}, held by {sorted(others)}")

    def _run(self) -> StepResponse:
        owners: dict[int, set[int]] = {}
        for held in self.held.values():
            for block in held.blocks:
                owners.setdefault(block, set()).add(held.request.id)
        generations, chunks, decoded, prefilled = [], [], [], []
        for held in list(self.held.values()):
            r = held.request
            if held.prefilling:
                until = held.chunk_until
                held.chunk_until = None
                if until is None:
                    continue  # no update named it: it does not run
                self._write(held, held.computed, until, owners)
                if until < held.context_len:
                    chunks.append((r.id, held.computed, until))
                    held.computed = until
                    continue
                held.computed = until
                prefilled.append(r.id)
            else:
                position = len(r.input_ids) + held.generated - 1  # the last token, fed back now
                self._write(held, position, position + 1 + self.lookahead, owners)
                decoded.append(r.id)
            generations.append(self._generate(held))
        if chunks:
            self.calls.append(("chunk", chunks))
        if prefilled:
            self.calls.append(("prefilled", prefilled))
        if decoded:
            self.calls.append(("decoded", decoded))
        return StepResponse(generations, StepTimings(forward_ns=1000, decode_ns=100))

    def _generate(self, held: Held) -> GenerationOut:
        r = held.request
        if r.id in self.failing_rows:  # like the worker: the request is dropped and reported alone
            self.failing_rows.discard(r.id)
            self._retire(r.id)
            return GenerationOut(r.id, error=f"request {r.id}: non-finite logits")
        k = held.generated
        held.generated = self.generated[r.id] = k + 1
        tokens = [TokenOut(1000 * r.id + k, token_text(r.adapter_id, k), -0.5, False)]
        eos = self.eos_after is not None and k + 1 >= self.eos_after and not r.stopping.ignore_eos_token
        final = None
        if eos or k + 1 >= r.stopping.max_new_tokens:
            final = FinalEvent("".join(token_text(r.adapter_id, i) for i in range(k + 1)),
                               "eos_token" if eos else "length", k + 1, r.sampling.seed)
            self._retire(r.id)
        return GenerationOut(r.id, tokens, final=final)

    def _retire(self, request_id: int) -> None:
        del self.held[request_id]
        self.retired.add(request_id)

    # --- the rest of the service ---------------------------------------------------------------------------

    async def health(self, timeout: float = 5.0) -> None:
        return None

    async def warmup(self, *limits) -> pb.WarmupResponse:
        async with self._lock:
            self.held.clear()
            self._sequence_sent = self._sequence_run = 0
        return pb.WarmupResponse(num_blocks=self.num_blocks or 64)

    async def load_adapter(self, adapter_id: str, source: str, api_token: str = "",
                           merge=None) -> pb.LoadAdapterResponse:
        self.adapter_calls.append(("load", adapter_id))
        self.load_requests.append(pb.LoadAdapterRequest(adapter_id=adapter_id, adapter_source=source,
                                                        api_token=api_token))
        self.load_merges.append(merge)
        behaviour = self.adapters.get(adapter_id, AdapterBehaviour())
        await asyncio.sleep(behaviour.delay)
        if behaviour.error is not None:
            return pb.LoadAdapterResponse(loaded=False, error=behaviour.error, error_status=behaviour.status,
                                          load_seconds=behaviour.delay)
        slots = self.max_adapter_slots
        if slots is not None and adapter_id not in self.loaded_adapters and len(self.loaded_adapters) >= slots:
            return pb.LoadAdapterResponse(loaded=False, error_status=424,
                                          error=f"adapter `{adapter_id}`: all {slots} adapter slots are in use")
        self.loaded_adapters.add(adapter_id)
        return pb.LoadAdapterResponse(loaded=True, kind=behaviour.kind, load_seconds=behaviour.delay)

    async def offload_adapter(self, adapter_id: str) -> bool:
        self.adapter_calls.append(("offload", adapter_id))
        if any(h.request.adapter_id == adapter_id for h in self.held.values()):
            self.offloaded_in_use.append(adapter_id)
        offloaded = adapter_id in self.loaded_adapters
        self.loaded_adapters.discard(adapter_id)
        return offloaded


def _merged(first: StepResponse, later: StepResponse) -> StepResponse:
    """Two decode steps' generations as one call returns them: a request's tokens in order, its final one's end."""
    merged = {g.request_id: g for g in first.generations}
    for g in later.generations:
        before = merged.get(g.request_id)
        if before is None or before.error or g.error:
            merged[g.request_id] = g if before is None or not before.error else before
            continue
        merged[g.request_id] = GenerationOut(g.request_id, before.tokens + g.tokens, before.top_tokens + g.top_tokens,
                                             before.prefill_tokens, g.final,
                                             step_tokens=(before.step_tokens or [len(before.tokens)]) + [len(g.tokens)])
    return StepResponse(list(merged.values()), first.timings)


def token_text(adapter_id: str, k: int) -> str:
    """The fake's k-th token text: adapters can be told apart by their output."""
    return f"{adapter_id}:t{k} " if adapter_id else f"t{k} "
