"""A fake set of shards for scheduler tests: answers like a worker, without a model.

Request r's k-th generated token is `1000 * r + k` with text "t{k} "; a request finishes after
max_new_tokens. Like the real worker, calls start when they are made and run strictly in order (a FIFO lock),
batches that ended are remembered so pipelined Decodes may still name them, and unknown ids are errors.
Calls are recorded so tests can check what the scheduler sent.
"""

from __future__ import annotations

import asyncio

from specula_proto import generate_pb2 as pb
from specula_router.client import ShardError, StepResponse


class FakeClient:
    def __init__(self, step_delay: float = 0.0) -> None:
        self.batches: dict[int, list[pb.Request]] = {}
        self.retired: set[int] = set()
        self.generated: dict[int, int] = {}
        self.calls: list[tuple[str, object]] = []
        self.fail_next: str | None = None  # "prefill" or "decode": the next such call fails
        self.step_delay = step_delay
        self._lock = asyncio.Lock()

    def _start(self, coro):
        return asyncio.ensure_future(self._in_order(coro))

    async def _in_order(self, coro):
        async with self._lock:
            return await coro

    async def _maybe_fail(self, method: str) -> None:
        await asyncio.sleep(self.step_delay)
        if self.fail_next == method:
            self.fail_next = None
            raise ShardError(f"{method} failed: shard exploded")

    def _step(self, batch_id: int, requests: list[pb.Request]) -> StepResponse:
        generations, live = [], []
        for r in requests:
            k = self.generated.get(r.id, 0)
            self.generated[r.id] = k + 1
            gen = pb.Generation(request_id=r.id, tokens=pb.Tokens(
                ids=[1000 * r.id + k], logprobs=[-0.5], texts=[f"t{k} "], is_special=[False]))
            if k + 1 >= r.stopping_parameters.max_new_tokens:
                gen.generated_text.CopyFrom(pb.GeneratedText(
                    text="".join(f"t{i} " for i in range(k + 1)), generated_tokens=k + 1,
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

        async def run():
            await self._maybe_fail("prefill")
            return self._step(batch.id, list(batch.requests))

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
