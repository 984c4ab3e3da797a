"""gRPC client to every shard of a model: each call is broadcast, shard 0's answer is used.

All shards run the same step in lockstep (tensor parallelism), so every RPC goes to all of them; Warmup takes
the minimum budget over shards. A failing shard makes the whole call fail with `ShardError`, which the
router reports to the requests of that step as a 424.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Sequence

import grpc

from specula_proto import generate_pb2 as pb
from specula_proto import generate_pb2_grpc

logger = logging.getLogger("specula.router.client")


class ShardError(Exception):
    """A shard failed an RPC; the message is the shard's own error."""


@dataclass
class StepResponse:
    generations: list[pb.Generation]
    batch: pb.CachedBatch | None
    timings: pb.Timings


class ShardedClient:
    def __init__(self, channels: Sequence[grpc.aio.Channel]) -> None:
        self._channels = list(channels)
        self._stubs = [generate_pb2_grpc.TextGenerationServiceStub(c) for c in channels]

    @classmethod
    async def connect(cls, master_url: str, timeout: float = 30.0) -> ShardedClient:
        """Connects to shard 0, asks it for every shard's URL, and connects to all of them."""
        master = grpc.aio.insecure_channel(master_url)
        stub = generate_pb2_grpc.TextGenerationServiceStub(master)
        response = await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=timeout, wait_for_ready=True)
        await master.close()
        urls = list(response.urls) or [master_url]
        logger.info("connected to %d shard(s): %s", len(urls), ", ".join(urls))
        return cls([grpc.aio.insecure_channel(u) for u in urls])

    @property
    def num_shards(self) -> int:
        return len(self._stubs)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))

    async def _broadcast(self, method: str, request, timeout: float | None = None) -> list:
        calls = [getattr(stub, method)(request, timeout=timeout) for stub in self._stubs]
        try:
            return await asyncio.gather(*calls)
        except grpc.aio.AioRpcError as e:
            for call in calls:  # the others would otherwise run on unobserved
                call.cancel()
            raise ShardError(f"{method} failed: {e.details() or e.code().name}") from e

    async def info(self) -> pb.InfoResponse:
        return (await self._broadcast("Info", pb.InfoRequest()))[0]

    async def health(self, timeout: float = 5.0) -> None:
        await self._broadcast("Health", pb.HealthRequest(), timeout=timeout)

    async def clear_cache(self, batch_id: int | None = None) -> None:
        request = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self._broadcast("ClearCache", request)

    async def warmup(self, max_input_tokens: int, max_prefill_tokens: int, max_total_tokens: int) -> pb.WarmupResponse:
        request = pb.WarmupRequest(
            max_input_tokens=max_input_tokens, max_prefill_tokens=max_prefill_tokens, max_total_tokens=max_total_tokens
        )
        responses = await self._broadcast("Warmup", request)
        return min(responses, key=lambda r: r.num_blocks)

    async def prefill(self, batch: pb.Batch) -> StepResponse:
        response = (await self._broadcast("Prefill", pb.PrefillRequest(batch=batch)))[0]
        return StepResponse(list(response.generations), response.batch if response.HasField("batch") else None,
                            response.timings)

    async def decode(self, batches: Sequence[pb.CachedBatch]) -> StepResponse:
        response = (await self._broadcast("Decode", pb.DecodeRequest(batches=batches)))[0]
        return StepResponse(list(response.generations), response.batch if response.HasField("batch") else None,
                            response.timings)

    async def filter_batch(self, batch_id: int, request_ids: Sequence[int]) -> pb.CachedBatch:
        request = pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)
        return (await self._broadcast("FilterBatch", request))[0].batch
