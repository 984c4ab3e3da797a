"""The worker's gRPC service: protobuf in, `TextGenerator` calls, protobuf out.

Protobuf objects stop here; everything behind this module works with the worker's own dataclasses.
Steps run on one dedicated thread, strictly one at a time and in arrival order (the model and KV cache are
not re-entrant), so the event loop keeps answering Health while a long forward pass runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from specula_proto import generate_pb2 as pb
from specula_proto import generate_pb2_grpc
from specula_server.adapters.merge import MergeSpec
from specula_server.adapters.sources import AdapterError
from specula_server.generator import InvalidRequestError, TextGenerator
from specula_server.params import FinishReason, SamplingParams, StoppingParams
from specula_server.request import RequestSpec, RequestUpdate, StepOutput, StepPlan, TokenInfo
from specula_server.step_outputs import StepResult
from specula_server.threads import compute_executor
from specula_server.warmup import warmup

logger = logging.getLogger("specula.service")

SEQUENCE_WAIT_S = 60.0  # how long a step waits for an earlier one before failing

_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}


@dataclass(frozen=True)
class WorkerInfo:
    model_id: str
    model_sha: str
    device: torch.device
    world_size: int
    uds_urls: tuple[str, ...]
    kv_cache_memory: int | None  # bytes for the KV cache; None: derive from free device memory
    instance_id: str = ""  # the launcher run this shard belongs to; "" when started alone
    quantize: str = ""  # --quantize: "int8", "int4", "w8a8", "gguf", or "" for float weights


class ExceptionInterceptor(grpc.aio.ServerInterceptor):
    """Logs worker exceptions and maps them to gRPC status codes.

    A step the worker cannot run (out of order, before Warmup) becomes INVALID_ARGUMENT and the worker keeps
    serving; a bad request inside a step fails alone in the step's answer.
    Anything else is INTERNAL. When `recoverable(error)` says the shard can go on (see `fault_policy`), it
    does: the router fails the requests of the failed step and lists them as finished. Otherwise `on_fatal`
    ends the process.
    """

    def __init__(self, on_fatal: Callable[[BaseException], None],
                 recoverable: Callable[[BaseException], bool] = lambda error: False) -> None:
        self.on_fatal = on_fatal
        self.recoverable = recoverable

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = handler_call_details.method

        async def wrapper(request, context: grpc.aio.ServicerContext):
            try:
                return await inner(request, context)
            except InvalidRequestError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except torch.cuda.OutOfMemoryError as e:
                logger.exception("%s ran out of device memory", method)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"out of device memory: {e}")
            except Exception as e:
                if self.recoverable(e):
                    logger.exception("%s failed; its requests fail and the shard keeps serving", method)
                else:  # an unrecoverable worker fault: report it, then stop the process
                    logger.exception("%s failed", method)
                    self.on_fatal(e)
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

        return grpc.unary_unary_rpc_method_handler(
            wrapper,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def fault_policy(info: WorkerInfo) -> Callable[[BaseException], bool]:
    """Whether the shard may keep serving after an unexpected error in an RPC (a bug met by one batch, a
    kernel refusing a shape): the failed step's requests fail, the router lists them as finished, later
    requests run as usual.

    Only a shard that runs alone may. With tensor-parallel peers, the others may be blocked in a collective
    the failed rank never reached, or have committed a step it did not; only restarting them all is safe. And
    only while its device still works: a CUDA fault poisons the context, and every later step would fail.
    """

    def recoverable(error: BaseException) -> bool:
        if info.world_size > 1:
            return False
        if info.device.type == "cuda":
            try:
                torch.cuda.synchronize(info.device)
            except Exception:
                return False
        return True

    return recoverable


class TextGenerationService(generate_pb2_grpc.TextGenerationServiceServicer):
    def __init__(self, generator: TextGenerator, info: WorkerInfo, steps: ThreadPoolExecutor | None = None) -> None:
        self.generator = generator
        self.info = info
        # One thread runs every step, in arrival order: a step queued behind the running one starts the
        # moment it ends, without a round trip through the event loop (which keeps answering Health). It is the
        # thread the model was loaded on (`threads.py`: one thread of a worker computes on every core).
        self._steps = steps or compute_executor()
        # gRPC may dispatch two RPCs that arrive together in either order; sequenced steps wait their turn.
        self._next_sequence = 1
        self._turn = asyncio.Condition()
        # Sequences of Step calls with new requests, received and not started (set: added and discarded whole
        # from the event loop and the step thread).
        self._newcomers_queued: set[int] = set()

    async def _in_thread(self, fn: Callable, *args, sequence: int = 0):
        """Runs `fn` on the step thread; a sequenced call is queued only after every earlier sequence."""
        loop = asyncio.get_running_loop()
        if not sequence:
            return await loop.run_in_executor(self._steps, fn, *args)
        async with self._turn:
            try:
                await asyncio.wait_for(self._turn.wait_for(lambda: self._next_sequence >= sequence),
                                       timeout=SEQUENCE_WAIT_S)
            except asyncio.TimeoutError:
                raise InvalidRequestError(
                    f"step {sequence} waited {SEQUENCE_WAIT_S:.0f}s for step {self._next_sequence}") from None
            if self._next_sequence != sequence:
                raise InvalidRequestError(f"step {sequence} arrived after step {self._next_sequence - 1}")
            future = loop.run_in_executor(self._steps, fn, *args)
            self._next_sequence += 1
            self._turn.notify_all()
        return await future

    async def Info(self, request, context):
        cfg = self.generator.model.config
        return pb.InfoResponse(
            model_id=self.info.model_id,
            model_sha=self.info.model_sha,
            dtype=str(self.generator.dtype).removeprefix("torch."),
            device_type=self.info.device.type,
            block_size=self.generator.block_size,
            max_position_embeddings=cfg.max_position_embeddings,
            vocab_size=cfg.vocab_size,
            world_size=self.info.world_size,
            eos_token_ids=sorted(self.generator.eos_token_ids),
            speculation=_speculation_info(self.generator),
            instance_id=self.info.instance_id,
            quantize=self.info.quantize,
            kv_cache_dtype=str(self.generator.kv_cache_dtype).removeprefix("torch."),
        )

    async def Health(self, request, context):
        if self.info.device.type == "cuda":
            torch.zeros(1, device=self.info.device)  # fails if the device is gone
        return pb.HealthResponse()

    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=list(self.info.uds_urls))

    async def Warmup(self, request, context):
        if request.max_total_tokens < 1 or request.max_prefill_tokens < 1 or request.max_input_tokens < 1:
            raise InvalidRequestError("warmup limits must all be positive")
        num_blocks = await self._in_thread(
            warmup, self.generator,
            request.max_input_tokens,
            request.max_prefill_tokens,
            request.max_total_tokens,
            self.info.kv_cache_memory,
        )
        async with self._turn:  # a router starts afresh: its steps count from 1 again
            self._next_sequence = 1
            self._turn.notify_all()
        return pb.WarmupResponse(
            max_supported_total_tokens=num_blocks * self.generator.block_size, num_blocks=num_blocks
        )

    async def Step(self, request, context):
        start = time.perf_counter_ns()
        if request.new_requests:  # the call before it, if it runs several decode steps, ends at the next one
            self._newcomers_queued.add(request.sequence)
        try:
            result, num_requests = await self._in_thread(self._step, request, sequence=request.sequence)
        finally:
            self._newcomers_queued.discard(request.sequence)
        tokens, nodes = self.generator.suffix_cache_size()
        return pb.StepResponse(generations=[generation_to_pb(o) for o in result.outputs],
                               timings=timings_to_pb(result, start), num_requests=num_requests,
                               suffix_cache_tokens=tokens, suffix_cache_nodes=nodes, decode_steps=result.steps)

    def _step(self, request: pb.StepRequest) -> tuple[StepResult, int]:
        self._newcomers_queued.discard(request.sequence)
        # Converted on the step thread, so a request refused here still answers in its step's order.
        specs, refused = [], []
        for r in request.new_requests:
            try:
                specs.append(request_from_pb(r, self.generator))
            except InvalidRequestError as e:
                refused.append(StepOutput(r.id, [], [], error=str(e)))
        updates = [RequestUpdate(u.id, tuple(u.new_blocks), u.prefill_until) for u in request.updates]
        plan = StepPlan(specs, updates, tuple(request.finished), max(1, request.decode_steps))
        result = self.generator.step(plan, lambda: bool(self._newcomers_queued))
        result.outputs[:0] = refused
        return result, len(self.generator.requests)

    async def LoadAdapter(self, request, context):
        # Off the step thread: a download or a large read must not hold up the running batches.
        registry = self.generator.adapters
        if registry is None:
            return pb.LoadAdapterResponse(loaded=False, error_status=424,
                                          error=f"adapter `{request.adapter_id}`: this worker serves no adapters")
        started = time.perf_counter()
        try:
            merge = merge_from_pb(request.merge) if request.HasField("merge") else None
            loaded = await asyncio.to_thread(registry.load, request.adapter_id, request.adapter_source or "hub",
                                             request.api_token or None, merge)
        except Exception as e:  # a broken adapter fails its own requests, never the worker
            status = e.status if isinstance(e, AdapterError) else 424
            message = str(e) if isinstance(e, AdapterError) else f"adapter `{request.adapter_id}`: {e}"
            logger.warning("adapter %s failed to load: %s", request.adapter_id, message)
            return pb.LoadAdapterResponse(loaded=False, error=message, error_status=status,
                                          load_seconds=time.perf_counter() - started)
        return pb.LoadAdapterResponse(loaded=True, kind=loaded.kind, load_seconds=loaded.load_seconds)

    async def OffloadAdapter(self, request, context):
        registry = self.generator.adapters
        offloaded = registry is not None and await asyncio.to_thread(registry.offload, request.adapter_id)
        return pb.OffloadAdapterResponse(offloaded=offloaded)


# --- conversions -------------------------------------------------------------------------------------------


def merge_from_pb(merge: pb.AdapterMerge) -> MergeSpec:
    """The merge a LoadAdapterRequest asks for; ValueError for one the router should not have sent."""
    return MergeSpec(tuple(merge.adapter_ids), tuple(merge.weights), merge.strategy or "linear", merge.density,
                     merge.majority_sign_method or "total", merge.seed)


def _speculation_info(generator: TextGenerator) -> pb.SpeculationInfo:
    spec = generator.speculation
    if spec is None:
        return pb.SpeculationInfo(max_speculative_tokens=0, method="none", mode="off")
    return pb.SpeculationInfo(max_speculative_tokens=spec.max_tokens, method=spec.drafter.name, mode=spec.mode)


def request_from_pb(r: pb.Request, generator: TextGenerator) -> RequestSpec:
    p, s = r.parameters, r.stopping_parameters
    input_ids = tuple(r.input_ids)
    if not input_ids and not r.inputs:
        raise InvalidRequestError(f"request {r.id}: empty prompt (neither inputs nor input_ids given)")
    if not input_ids:
        input_ids = tuple(generator.tokenizer.encode(r.inputs).ids)
        if r.truncate:
            input_ids = input_ids[-r.truncate :]
    if p.temperature < 0:
        raise InvalidRequestError(f"request {r.id}: temperature must be > 0, got {p.temperature}")
    sampling = SamplingParams(
        do_sample=p.do_sample,
        temperature=p.temperature or 1.0,  # proto3 default 0 means "unset"
        top_k=p.top_k,
        top_p=p.top_p or 1.0,
        typical_p=p.typical_p or 1.0,
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        seed=p.seed,
        logit_bias=_logit_bias(r, generator.model.config.vocab_size),
    )
    if not 0 < sampling.top_p <= 1 or not 0 < sampling.typical_p <= 1 or sampling.repetition_penalty <= 0:
        raise InvalidRequestError(f"request {r.id}: top_p/typical_p must be in (0, 1], repetition_penalty > 0")
    stopping = StoppingParams(s.max_new_tokens, tuple(s.stop_sequences), s.ignore_eos_token)
    return RequestSpec(
        id=r.id,
        input_ids=input_ids,
        sampling=sampling,
        stopping=stopping,
        blocks=tuple(r.blocks),
        prefill_logprobs=r.prefill_logprobs,
        top_n_tokens=r.top_n_tokens,
        speculative_tokens=r.speculative_tokens if r.HasField("speculative_tokens") else None,
        adapter_id=r.adapter_id,
        cached_tokens=r.cached_tokens,
        prefill_until=r.prefill_until,
        generated_ids=tuple(r.generated_ids),
        grammar=r.grammar,
    )


def _logit_bias(r: pb.Request, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The request's bias as sorted (id, bias) pairs. The router checks the same bounds; a NaN or an id past the
    LM head would otherwise reach the logits unnoticed (the non-finite check runs on the model's logits)."""
    bias = tuple(sorted(r.parameters.logit_bias.items()))
    if any(not 0 <= token < vocab_size or not -100.0 <= value <= 100.0 for token, value in bias):
        raise InvalidRequestError(f"request {r.id}: logit_bias needs token ids in [0, {vocab_size}) and values in "
                                  f"[-100, 100]")
    return bias


def tokens_to_pb(tokens: list[TokenInfo]) -> pb.Tokens:
    return pb.Tokens(
        ids=[t.id for t in tokens],
        logprobs=[t.logprob for t in tokens],
        texts=[t.text for t in tokens],
        special=[t.special for t in tokens],
    )


def generation_to_pb(out: StepOutput) -> pb.Generation:
    if out.error:  # the request failed this step: the error alone, as the contract says
        return pb.Generation(request_id=out.request_id, error=out.error)
    gen = pb.Generation(
        request_id=out.request_id,
        tokens=tokens_to_pb(out.tokens),
        top_tokens=[tokens_to_pb(t) for t in out.top_tokens],
        drafted_tokens=out.num_drafted,
        accepted_tokens=out.num_accepted,
        draft_method=out.draft_method,
        step_tokens=out.step_tokens,
        step_drafted=out.step_drafted,
        step_accepted=out.step_accepted,
    )
    if out.prefill_tokens is not None:
        gen.prefill_tokens.CopyFrom(tokens_to_pb(out.prefill_tokens))
    if out.generated_text is not None:
        g = out.generated_text
        gen.generated_text.CopyFrom(
            pb.GeneratedText(
                text=g.text,
                generated_tokens=g.generated_tokens,
                finish_reason=_FINISH_REASONS[g.finish_reason],
                seed=g.seed,
            )
        )
    return gen


def timings_to_pb(result: StepResult, start_ns: int) -> pb.Timings:
    return pb.Timings(forward_ns=result.timings.forward_ns, decode_ns=result.timings.decode_ns,
                      total_ns=time.perf_counter_ns() - start_ns)
