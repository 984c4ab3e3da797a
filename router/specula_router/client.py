"""gRPC client to every shard of a model: each call is broadcast, shard 0's answer is used.

All shards run the same step in lockstep (tensor parallelism), so every RPC goes to all of them; Warmup takes
the minimum budget over shards. Steps (`step`) carry sequence numbers from 1 after Warmup, so the workers run
them in the order sent even when several are on the wire. A failing shard makes the whole call fail with
`ShardError`, which the router reports to the requests of that step as a 424. LoadAdapter and OffloadAdapter run
beside the steps and carry no step sequence number; a failed load is an answer (`loaded=False`), not an exception.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence

import grpc

from specula_proto import generate_pb2 as pb
from specula_proto import generate_pb2_grpc
from specula_router.entries import FinalEvent, TokenOut
from specula_router.merges import MergeSpec
from specula_router.step_messages import GenerationOut, NewRequest, RequestUpdate, StepResponse, StepTimings

logger = logging.getLogger("specula.router.client")


class ShardError(Exception):
    """A shard failed an RPC; the message is the shard's own error. `unreachable`: the shard could not be reached
    at all (its process is gone, e.g. on another node), not an error it answered."""

    def __init__(self, message: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class ForeignShardError(ValueError):
    """A shard belongs to another launcher run: answering with it would answer with another server's model."""


class ShardedClient:
    def __init__(self, channels: Sequence[grpc.aio.Channel]) -> None:
        self._channels = list(channels)
        self._stubs = [generate_pb2_grpc.TextGenerationServiceStub(c) for c in channels]
        self._sequence = 0  # steps numbered in the order they are sent; the workers run them in that order

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    @classmethod
    async def connect(cls, master_url: str, timeout: float = 30.0, instance_id: str = "") -> ShardedClient:
        """Connects to shard 0, asks it for every shard's URL, connects to all of them, and checks that each one
        belongs to `instance_id`'s launcher run (see `check_instance`)."""
        master = grpc.aio.insecure_channel(master_url)
        stub = generate_pb2_grpc.TextGenerationServiceStub(master)
        response = await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=timeout, wait_for_ready=True)
        await master.close()
        urls = list(response.urls) or [master_url]
        client = cls([grpc.aio.insecure_channel(u) for u in urls])
        try:
            await client.check_instance(urls, instance_id, timeout)
        except BaseException:
            await client.close()
            raise
        logger.info("connected to %d shard(s): %s", len(urls), ", ".join(urls))
        return client

    async def check_instance(self, urls: Sequence[str], instance_id: str, timeout: float) -> None:
        """Raises ForeignShardError unless every shard reports `instance_id` in Info ("": any, as long as all
        shards report the same). A shard of another launcher, reached through a shared socket path, would
        answer steps it never saw (or with another model), so it is refused before any request runs."""
        infos = await asyncio.gather(*(stub.Info(pb.InfoRequest(), timeout=timeout, wait_for_ready=True)
                                       for stub in self._stubs))
        expected, whose = (instance_id, "this router's") if instance_id else (infos[0].instance_id, "shard 0's")
        for rank, (url, info) in enumerate(zip(urls, infos)):
            if info.instance_id != expected:
                owner = f"instance {info.instance_id}" if info.instance_id else "no launcher (started alone)"
                raise ForeignShardError(
                    f"shard {rank} at {url} belongs to {owner} (serving {info.model_id}), not to {whose} instance "
                    f"{expected or '(none)'}: another server's shards use the same socket path; give each launcher "
                    f"its own --shard-uds-path, or leave it unset")

    @property
    def num_shards(self) -> int:
        return len(self._stubs)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels))

    def _call(self, method: str, request, timeout: float | None = None) -> Awaitable[list]:
        """Sends `request` to every shard now; the returned awaitable gathers the answers, in rank order.

        The calls are created before anything awaits, so a caller can start a step and then do other work
        (wake HTTP handlers) while it is on the wire.
        """
        calls = [getattr(stub, method)(request, timeout=timeout) for stub in self._stubs]
        return self._gather(method, calls)

    async def _gather(self, method: str, calls: list) -> list:
        try:
            return [await calls[0]] if len(calls) == 1 else await asyncio.gather(*calls)
        except grpc.aio.AioRpcError as e:
            for call in calls:  # the others would otherwise run on unobserved
                call.cancel()
            raise ShardError(f"{method} failed: {e.details() or e.code().name}",
                             unreachable=e.code() == grpc.StatusCode.UNAVAILABLE) from e

    async def info(self) -> pb.InfoResponse:
        return (await self._call("Info", pb.InfoRequest()))[0]

    async def health(self, timeout: float = 5.0) -> None:
        await self._call("Health", pb.HealthRequest(), timeout=timeout)

    async def warmup(self, max_input_tokens: int, max_prefill_tokens: int, max_total_tokens: int) -> pb.WarmupResponse:
        """Warms every shard up; the workers then hold no request and restart their step count at 1."""
        request = pb.WarmupRequest(
            max_input_tokens=max_input_tokens, max_prefill_tokens=max_prefill_tokens, max_total_tokens=max_total_tokens
        )
        responses = await self._call("Warmup", request)
        self._sequence = 0
        return min(responses, key=lambda r: r.num_blocks)

    def step(self, finished: Sequence[int], updates: Sequence[RequestUpdate],
             new_requests: Sequence[NewRequest], decode_steps: int = 1) -> Awaitable[StepResponse]:
        """Starts the next Step on every shard (sent before this returns); await shard 0's result."""
        request = pb.StepRequest(
            sequence=self._next_sequence(), finished=finished,
            updates=[pb.RequestUpdate(id=u.id, new_blocks=u.new_blocks, prefill_until=u.prefill_until)
                     for u in updates],
            new_requests=[encode_request(r) for r in new_requests], decode_steps=decode_steps)
        return self._step_response(self._call("Step", request))

    @staticmethod
    async def _step_response(responses: Awaitable[list]) -> StepResponse:
        return decode_step_response((await responses)[0])

    async def load_adapter(self, adapter_id: str, source: str, api_token: str = "",
                           merge: MergeSpec | None = None) -> pb.LoadAdapterResponse:
        """Loads an adapter (with `merge`: that merge of adapters, named `adapter_id`) on every shard; the answer
        is loaded only when every shard loaded it.

        Otherwise it is the first failing shard's answer, or, for a shard whose RPC failed, a 424 carrying the
        gRPC error. Shards that did load it while another failed are asked to offload it again, so no slot
        stays taken by an adapter the router considers unloaded.
        """
        request = pb.LoadAdapterRequest(adapter_id=adapter_id, adapter_source=source, api_token=api_token)
        if merge is not None:
            request.merge.CopyFrom(pb.AdapterMerge(
                adapter_ids=merge.adapter_ids, weights=merge.weights, strategy=merge.strategy, density=merge.density,
                majority_sign_method=merge.majority_sign_method, seed=merge.seed))
        results = await asyncio.gather(*(stub.LoadAdapter(request) for stub in self._stubs), return_exceptions=True)
        failure = None
        for rank, result in enumerate(results):
            if isinstance(result, grpc.aio.AioRpcError):
                failure = failure or pb.LoadAdapterResponse(
                    loaded=False, error_status=424,
                    error=f"adapter `{adapter_id}`: LoadAdapter failed on shard {rank}: "
                          f"{result.details() or result.code().name}")
            elif isinstance(result, BaseException):
                raise result
            elif not result.loaded:
                failure = failure or result
        if failure is None:
            return results[0]
        loaded = [stub for stub, r in zip(self._stubs, results) if isinstance(r, pb.LoadAdapterResponse) and r.loaded]
        if loaded:
            offload = pb.OffloadAdapterRequest(adapter_id=adapter_id)
            undone = await asyncio.gather(*(stub.OffloadAdapter(offload) for stub in loaded), return_exceptions=True)
            for error in undone:
                if isinstance(error, BaseException):
                    logger.error("could not offload the partly loaded adapter %s: %s", adapter_id, error)
        return failure

    async def offload_adapter(self, adapter_id: str) -> bool:
        """Frees an adapter on every shard; False when shard 0 did not hold it."""
        responses = await self._call("OffloadAdapter", pb.OffloadAdapterRequest(adapter_id=adapter_id))
        return responses[0].offloaded


# --- the Step messages: the router's dataclasses (step_messages.py) to and from protobuf ---------------------------

_FINISH_REASONS = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "eos_token",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
}


def encode_request(r: NewRequest) -> pb.Request:
    """The workers' message; raises ValueError, TypeError or OverflowError for a value its wire type cannot hold
    (the planner checks each new request with it, so such a request fails alone)."""
    s, t = r.sampling, r.stopping
    return pb.Request(
        id=r.id,
        input_ids=r.input_ids,
        parameters=pb.NextTokenChooserParameters(
            do_sample=s.do_sample, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, typical_p=s.typical_p,
            seed=s.seed, repetition_penalty=s.repetition_penalty, frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty, logit_bias=dict(s.logit_bias)),
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=t.max_new_tokens, stop_sequences=t.stop_sequences, ignore_eos_token=t.ignore_eos_token),
        prefill_logprobs=r.prefill_logprobs,
        top_n_tokens=r.top_n_tokens,
        blocks=r.blocks,
        adapter_id=r.adapter_id,
        speculative_tokens=r.speculative_tokens,
        cached_tokens=r.cached_tokens,
        prefill_until=r.prefill_until,
        generated_ids=r.generated_ids,
        grammar=r.grammar,
    )


def decode_step_response(response: pb.StepResponse) -> StepResponse:
    t = response.timings
    return StepResponse([_generation(g) for g in response.generations],
                        StepTimings(t.forward_ns, t.decode_ns, t.total_ns),
                        response.suffix_cache_tokens, response.suffix_cache_nodes, max(1, response.decode_steps))


def _generation(g: pb.Generation) -> GenerationOut:
    final = None
    if g.HasField("generated_text"):
        text = g.generated_text
        final = FinalEvent(text.text, _FINISH_REASONS[text.finish_reason], text.generated_tokens,
                           text.seed if text.HasField("seed") else None)
    return GenerationOut(
        request_id=g.request_id, tokens=_tokens(g.tokens), top_tokens=[_tokens(t) for t in g.top_tokens],
        prefill_tokens=_tokens(g.prefill_tokens) if g.HasField("prefill_tokens") else None, final=final,
        drafted_tokens=g.drafted_tokens, accepted_tokens=g.accepted_tokens, draft_method=g.draft_method,
        error=g.error, step_tokens=list(g.step_tokens), step_drafted=list(g.step_drafted),
        step_accepted=list(g.step_accepted))


def _tokens(tokens: pb.Tokens) -> list[TokenOut]:
    columns = zip(tokens.ids, tokens.texts, tokens.logprobs, tokens.special)
    return [TokenOut(i, t, lp, sp) for i, t, lp, sp in columns]
