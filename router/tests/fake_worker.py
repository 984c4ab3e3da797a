"""A fake set of shards for scheduler tests: answers like a worker, without a model.

Request r's k-th generated token is `1000 * r + k` with text "t{k} " on the base model and "{adapter}:t{k} "
with an adapter; a request finishes after max_new_tokens. Like the real worker, steps start when they are made
and run strictly in order (a FIFO lock), batches that ended are remembered so pipelined Decodes may still name
them, unknown ids are errors, and a Prefill naming an adapter that is not loaded fails. LoadAdapter and
OffloadAdapter run beside the steps, as in the worker; each adapter's load can be made slow or failing
(`AdapterBehaviour`), and `max_adapter_slots` refuses loads past the workers' slots. Calls are recorded so tests
can check what the router sent; `offloaded_in_use` lists offloads of an adapter a live request still used.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specula_proto import generate_pb2 as pb
from specula_router.client import ShardError, StepResponse


@dataclass
class AdapterBehaviour:
    """How the fake answers LoadAdapter for one adapter."""

    delay: float = 0.0  # seconds the load takes
    error: str | None = None  # set: the load fails with this message ...
    status: int = 424  # ... and this status
    kind: str = "lora"


class FakeClient:
    def __init__(self, step_delay: float = 0.0, max_adapter_slots: int | None = None) -> None:
        self.batches: dict[int, list[pb.Request]] = {}
        self.retired: set[int] = set()
        self.generated: dict[int, int] = {}
        self.calls: list[tuple[str, object]] = []
        self.fail_next: str | None = None  # "prefill" or "decode": the next such call fails
        self.raise_next: tuple[str, Exception] | None = None  # (method, error): the next such call raises it
        self.failing_rows: set[int] = set()  # requests that fail alone in their next step (Generation.error)
        self.hang: str | None = None  # "prefill" or "decode": such calls never answer (a stopped shard)
        self.prefilled: list[pb.Request] = []  # every request as a Prefill sent it
        self.step_delay = step_delay
        self._lock = asyncio.Lock()
        self.adapters: dict[str, AdapterBehaviour] = {}  # per adapter id; others load at once
        self.loaded_adapters: set[str] = set()
        self.max_adapter_slots = max_adapter_slots
        self.adapter_calls: list[tuple[str, str]] = []  # ("load" | "offload", adapter id), in order
        self.load_requests: list[pb.LoadAdapterRequest] = []
        self.offloaded_in_use: list[str] = []
        self._prefilling: list[list[pb.Request]] = []  # prefills sent and not finished

    def _start(self, coro):
        return asyncio.ensure_future(self._in_order(coro))

    async def _in_order(self, coro):
        async with self._lock:
            return await coro

    async def _maybe_fail(self, method: str) -> None:
        await asyncio.sleep(self.step_delay)
        if self.hang == method:
            await asyncio.Event().wait()
        if self.fail_next == method:
            self.fail_next = None
            raise ShardError(f"{method} failed: shard exploded")
        if self.raise_next is not None and self.raise_next[0] == method:
            error, self.raise_next = self.raise_next[1], None
            raise error

    def _step(self, batch_id: int, requests: list[pb.Request]) -> StepResponse:
        generations, live = [], []
        for r in requests:
            if r.id in self.failing_rows:  # like the worker: the row is dropped and reported alone
                self.failing_rows.discard(r.id)
                generations.append(pb.Generation(request_id=r.id, error=f"request {r.id}: non-finite logits"))
                continue
            k = self.generated.get(r.id, 0)
            self.generated[r.id] = k + 1
            gen = pb.Generation(request_id=r.id, tokens=pb.Tokens(
                ids=[1000 * r.id + k], logprobs=[-0.5], texts=[token_text(r.adapter_id, k)], is_special=[False]))
            if k + 1 >= r.stopping_parameters.max_new_tokens:
                gen.generated_text.CopyFrom(pb.GeneratedText(
                    text="".join(token_text(r.adapter_id, i) for i in range(k + 1)), generated_tokens=k + 1,
                    finish_reason=pb.FINISH_REASON_LENGTH, seed=r.parameters.seed))
            else:
                live.append(r)
            generations.append(gen)
        batch = None
        if live:
            self.batches[batch_id] = live
            batch = pb.CachedBatch(id=batch_id, request_ids=[r.id for r in live])
        else:
            self.retired.add(batch_id)
        return StepResponse(generations, batch, pb.Timings(forward_ns=1000, decode_ns=100))

    def prefill(self, batch: pb.Batch):
        self.calls.append(("prefill", [r.id for r in batch.requests]))
        self.prefilled.extend(batch.requests)
        requests = list(batch.requests)
        self._prefilling.append(requests)

        async def run():
            try:
                await self._maybe_fail("prefill")
                chunks = [r for r in requests if 0 < r.prefill_until < len(r.input_ids)]
                if chunks:  # like the worker: chunks only, which write KV and answer nothing
                    assert len(chunks) == len(requests), "a Prefill mixed chunks and whole prompts"
                    self.calls.append(("chunk", [(r.id, r.cached_tokens, r.prefill_until) for r in chunks]))
                    return StepResponse([], None, pb.Timings())
                missing = [r for r in requests if r.adapter_id and r.adapter_id not in self.loaded_adapters]
                if missing:
                    raise ShardError(f"Prefill failed: request {missing[0].id}: adapter `{missing[0].adapter_id}` "
                                     "is not loaded on this worker")
                return self._step(batch.id, requests)
            finally:
                self._prefilling.remove(requests)

        return self._start(run())

    def decode(self, batches):
        ids = [b.id for b in batches]
        self.calls.append(("decode", ids))

        async def run():
            await self._maybe_fail("decode")
            unknown = [i for i in ids if i not in self.batches and i not in self.retired]
            if unknown:
                raise ShardError(f"Decode failed: unknown batch ids {unknown}")
            live = [i for i in ids if i in self.batches]
            if not live:
                return StepResponse([], None, pb.Timings())
            self.retired.update(live[1:])
            requests = [r for i in live for r in self.batches.pop(i)]
            self.calls.append(("decoded", [r.id for r in requests]))
            return self._step(live[0], requests)

        return self._start(run())

    async def filter_batch(self, batch_id: int, request_ids) -> pb.CachedBatch:
        async def run():
            self.calls.append(("filter", list(request_ids)))
            if batch_id in self.retired:
                return pb.CachedBatch(id=batch_id)
            keep = set(request_ids)
            self.batches[batch_id] = [r for r in self.batches[batch_id] if r.id in keep]
            remaining = [r.id for r in self.batches[batch_id]]
            if not remaining:
                del self.batches[batch_id]
                self.retired.add(batch_id)
            return pb.CachedBatch(id=batch_id, request_ids=remaining)

        return await self._start(run())

    async def clear_cache(self, batch_id: int | None = None) -> None:
        self.calls.append(("clear", batch_id))
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)

    async def health(self, timeout: float = 5.0) -> None:
        return None

    async def load_adapter(self, adapter_id: str, source: str, api_token: str = "") -> pb.LoadAdapterResponse:
        self.adapter_calls.append(("load", adapter_id))
        self.load_requests.append(pb.LoadAdapterRequest(adapter_id=adapter_id, adapter_source=source,
                                                        api_token=api_token))
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
        live = [r for batch in [*self.batches.values(), *self._prefilling] for r in batch]
        if any(r.adapter_id == adapter_id for r in live):
            self.offloaded_in_use.append(adapter_id)
        offloaded = adapter_id in self.loaded_adapters
        self.loaded_adapters.discard(adapter_id)
        return offloaded


def token_text(adapter_id: str, k: int) -> str:
    """The fake's k-th token text: adapters can be told apart by their output."""
    return f"{adapter_id}:t{k} " if adapter_id else f"t{k} "
