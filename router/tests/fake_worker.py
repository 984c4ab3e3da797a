"""A fake set of shards for scheduler tests: answers Prefill/Decode like a worker, without a model.

Request r's k-th generated token is `1000 * r + k` with text "t{k} "; a request finishes after
max_new_tokens. Calls are recorded so tests can check what the scheduler sent.
"""

from __future__ import annotations

import asyncio

from specula_proto import generate_pb2 as pb
from specula_router.client import ShardError, StepResponse


class FakeClient:
    def __init__(self, step_delay: float = 0.0) -> None:
        self.batches: dict[int, list[pb.Request]] = {}
        self.generated: dict[int, int] = {}
        self.calls: list[tuple[str, object]] = []
        self.fail_next: str | None = None  # "prefill" or "decode": the next such call fails
        self.step_delay = step_delay

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
        return StepResponse(generations, batch, pb.Timings(forward_ns=1000, decode_ns=100))

    async def prefill(self, batch: pb.Batch) -> StepResponse:
        self.calls.append(("prefill", [r.id for r in batch.requests]))
        await self._maybe_fail("prefill")
        return self._step(batch.id, list(batch.requests))

    async def decode(self, batches) -> StepResponse:
        ids = [b.id for b in batches]
        self.calls.append(("decode", [i for b in batches for i in b.request_ids]))
        await self._maybe_fail("decode")
        requests = [r for i in ids for r in self.batches.pop(i)]
        return self._step(ids[0], requests)

    async def filter_batch(self, batch_id: int, request_ids) -> pb.CachedBatch:
        self.calls.append(("filter", list(request_ids)))
        keep = set(request_ids)
        self.batches[batch_id] = [r for r in self.batches[batch_id] if r.id in keep]
        return pb.CachedBatch(id=batch_id, request_ids=list(request_ids))

    async def clear_cache(self, batch_id: int | None = None) -> None:
        self.calls.append(("clear", batch_id))
        if batch_id is None:
            self.batches.clear()
        else:
            self.batches.pop(batch_id, None)

    async def health(self, timeout: float = 5.0) -> None:
        return None
