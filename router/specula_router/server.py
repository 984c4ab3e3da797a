"""The router's HTTP API, compatible with TGI and LoRAX (and their published clients).

Routes: `POST /` (compat: JSON array or SSE), `/generate`, `/generate_stream`, `/tokenize`, `GET /health` (and
its alias `/ping`), `/info`, `/metrics`, OpenAPI at `/docs` and `/api-doc/openapi.json`. Errors are
`{"error", "error_type"}`: 422 validation, 429 overloaded (rejected at once), 424 generation (worker or adapter
failure), 400 an adapter id the workers refuse, 401 a missing or wrong `--api-key` (`auth.py`), 413 payload too
large, 503 unhealthy, 404/405 unknown route or method (`http_errors.py`); inside a started stream an error is
an SSE event. A stream whose adapter is still loading starts only once it is loaded, so a failed load is an HTTP
status too. The routes translate: a request's life (admission, fan-out, collecting, cancelling) is a
`RequestSession` (`session.py`), shared with the OpenAI routes (`openai_api.py`).

Nothing slow runs on the event loop, which also answers /health: validation and tokenisation run in a bounded
pool of `validation_workers` threads (the tokenizer releases the GIL), and /metrics renders in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from specula_router import openai_api, openapi
from specula_router.auth import ApiKeyMiddleware, document_api_key
from specula_router.client import ShardedClient
from specula_router.grammar import Grammar
from specula_router.grammar_check import GrammarChecker
from specula_router.http_errors import PayloadLimitMiddleware, error, install_error_handlers
from specula_router.metrics import Metrics
from specula_router.openai_schemas import ChatCompletionRequest, CompletionRequest, OpenAIChunk
from specula_router.requests import ValidGenerateRequest
from specula_router.response_schemas import ErrorResponse, GenerateResponse, Info, SimpleToken, StreamResponse
from specula_router.responses import (
    KEEPALIVE_COMMENT,
    ClientGone,
    DisconnectWatch,
    GenerationError,
    generate_body,
    next_event,
    token_body,
    top_tokens_body,
)
from specula_router.scheduler import Entry, ErrorEvent, Scheduler, TokensEvent
from specula_router.schemas import CompatGenerateRequest, GenerateRequest, TokenizeRequest
from specula_router.session import Refused, RequestSession
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationError

if TYPE_CHECKING:
    from specula_router.openai_models import OpenAISettings

logger = logging.getLogger("specula.router.http")
T = TypeVar("T")


@dataclass
class RouterState:
    """What the routes need; built once at startup by `specula_router.startup`."""

    scheduler: Scheduler
    validator: Validator
    client: ShardedClient
    metrics: Metrics
    info: dict
    max_concurrent_requests: int
    compute_type: str
    in_flight: int = 0
    validation_workers: int = 2  # threads that validate and tokenise (TGI's --validation-workers)
    openai: OpenAISettings | None = None  # chat template and adapter directories of the /v1/* routes
    # Checks structured-output grammars against the tokenizer (grammar.py); None: one from the validator's tokenizer.
    grammar_checker: GrammarChecker | None = None
    validation_pool: ThreadPoolExecutor = field(init=False, repr=False)
    _metrics_render: asyncio.Future | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.validation_workers < 1:
            raise ValueError(f"--validation-workers must be at least 1; got {self.validation_workers}")
        self.validation_pool = ThreadPoolExecutor(self.validation_workers, thread_name_prefix="validation")
        if self.grammar_checker is None:
            self.grammar_checker = GrammarChecker(self.validator.tokenizer, self.validator.limits.vocab_size)

    async def check_grammar(self, grammar: Grammar) -> None:
        """Raises `GrammarError` when `grammar` does not compile against the tokenizer (or not in time)."""
        assert self.grammar_checker is not None
        await self.grammar_checker.check_or_raise(grammar)

    async def in_validation_worker(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in the validation pool: at most `validation_workers` run at once, the rest wait their turn."""
        return await asyncio.get_running_loop().run_in_executor(self.validation_pool, fn, *args)

    async def render_metrics(self) -> bytes:
        """The metrics text, rendered in a thread; scrapes that arrive during a render share its result."""
        if self._metrics_render is None or self._metrics_render.done():
            self._metrics_render = asyncio.ensure_future(asyncio.to_thread(self.metrics.render))
        return await asyncio.shield(self._metrics_render)



def create_app(state: RouterState, payload_limit: int = 2_000_000, cors_origins: list[str] | None = None,
               api_key: str | None = None) -> FastAPI:
    """The app; with `api_key`, every route but the probes needs `Authorization: Bearer <api_key>` (auth.py)."""
    app = FastAPI(title="Specula", version=state.info.get("version") or "0.1.0", docs_url="/docs",
                  openapi_url="/api-doc/openapi.json",
                  description="LLM inference server with exact speculative decoding (TGI/LoRAX compatible).")
    app.state.router = state
    app.add_middleware(InvocationsMiddleware)  # innermost: the key and the payload limit apply to /invocations
    if api_key is not None:  # added early, so inner: CORS (outside it) answers preflights and labels its 401s
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(PayloadLimitMiddleware, limit=payload_limit)
    install_error_handlers(app, state.metrics)
    _serve_exact_openapi(app, state)
    if api_key is not None:
        document_api_key(app)

    _generation_routes(app, state)
    _service_routes(app, state)
    openai_api.register(app, state)
    return app


_ERRORS = {code: {"model": ErrorResponse} for code in (400, 413, 422, 424, 429)}


def _generation_routes(app: FastAPI, state: RouterState) -> None:
    """TGI's and LoRAX's generation routes: /generate, /generate_stream and the compat route POST /."""
    errors = _ERRORS
    sse = {"text/event-stream": {"schema": openapi.sse_event_schema("StreamResponse", "ErrorResponse")}}

    @app.post("/generate", tags=["Text Generation Inference"],
              responses={200: {"model": GenerateResponse}, **errors})
    async def generate(body: GenerateRequest, request: Request):
        """Generate tokens; answers once generation has finished."""
        return await _generate(state, body.inputs, body.parameters, request)

    @app.post("/generate_stream", tags=["Text Generation Inference"], response_class=StreamingResponse,
              responses={200: {"content": sse, "description": "One event per token"}, **errors})
    async def generate_stream(body: GenerateRequest, request: Request):
        """Generate tokens as Server-Sent Events, one event per token."""
        return await _generate_stream(state, body.inputs, body.parameters, request)

    @app.post("/", tags=["Text Generation Inference"],
              responses={200: {"model": list[GenerateResponse], "content": sse}, **errors})
    async def compat_generate(body: CompatGenerateRequest, request: Request):
        """TGI/LoRAX compat route used by the published clients: SSE when `stream`, else a JSON array."""
        if body.stream:
            return await _generate_stream(state, body.inputs, body.parameters, request)
        response = await _generate(state, body.inputs, body.parameters, request)
        if response.status_code != 200:
            return response
        return JSONResponse([json.loads(response.body)], headers=_copy_headers(response))


def _service_routes(app: FastAPI, state: RouterState) -> None:
    """/tokenize and the service's probes: /health (also GET / and /ping), /info, /metrics."""
    errors = _ERRORS
    @app.post("/tokenize", tags=["Text Generation Inference"],
              responses={200: {"model": list[SimpleToken]}, **{code: errors[code] for code in (413, 422, 429)}})
    async def tokenize(body: TokenizeRequest):
        """Tokenize the inputs with the model's tokenizer; the input limits of `/generate` apply."""
        async with RequestSession(state) as session:
            try:
                session.hold()  # a long input is as costly to tokenise here as in /generate: same admission
                tokens = await state.in_validation_worker(state.validator.tokenize, body.inputs,
                                                          body.add_special_tokens, body.parameters.truncate)
            except Refused as e:
                return error(e.status, e.message, e.error_type)
            except ValidationError as e:
                return error(422, e.message, "validation")
        return JSONResponse([t if isinstance(t, dict) else t.model_dump() for t in tokens])

    @app.get("/health", tags=["Text Generation Inference"], response_class=Response,
             responses={200: {"description": "Healthy (empty body)", "content": {}}, 503: {"model": ErrorResponse}})
    async def health():
        """200 when the workers answer; 503 otherwise. Does not wait behind a running step."""
        if state.scheduler.failure is not None:  # a shard stopped answering: unhealthy until restarted
            return error(503, state.scheduler.failure, "healthcheck")
        last = state.scheduler.last_step_ok
        if last is not None and time.monotonic() - last < 5.0:
            return Response(status_code=200)
        try:
            await state.client.health(timeout=5.0)
        except Exception as e:  # any failure to reach a shard means unhealthy
            logger.warning("health check failed: %s", e)
            return error(503, "unhealthy", "healthcheck")
        return Response(status_code=200)

    # TGI answers GET / as /health.
    app.add_api_route("/", health, methods=["GET"], tags=["Text Generation Inference"], response_class=Response,
                      responses={200: {"description": "Healthy (empty body)", "content": {}},
                                 503: {"model": ErrorResponse}}, summary="Health (TGI's GET /)")
    # TGI's alias of /health (the probe some hosting platforms call); open like it under --api-key.
    app.add_api_route("/ping", health, methods=["GET"], tags=["Text Generation Inference"], response_class=Response,
                      responses={200: {"description": "Healthy (empty body)", "content": {}},
                                 503: {"model": ErrorResponse}}, summary="Ping")

    @app.get("/info", tags=["Text Generation Inference"], responses={200: {"model": Info}})
    async def info():
        """Model, limits and speculation configuration."""
        return JSONResponse(state.info)

    @app.get("/metrics", tags=["Text Generation Inference"], response_class=Response,
             responses={200: {"description": "Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        """Prometheus metrics, rendered off the event loop."""
        return Response(await state.render_metrics(), media_type=CONTENT_TYPE_LATEST)


def _serve_exact_openapi(app: FastAPI, state: RouterState) -> None:
    """Serve FastAPI's document made exact and narrowed to this deployment's limits (`openapi.py`)."""
    generate_base = app.openapi
    openai_bodies = (ChatCompletionRequest, CompletionRequest, OpenAIChunk)

    def exact() -> dict:
        if app.openapi_schema is None:
            limits = state.validator.limits
            app.openapi_schema = openapi.document(generate_base(), openapi.DeploymentLimits(
                max_best_of=limits.max_best_of, max_top_n_tokens=limits.max_top_n_tokens,
                max_stop_sequences=limits.max_stop_sequences, max_input_tokens=limits.max_input_tokens,
                max_total_tokens=limits.max_total_tokens, max_speculative_tokens=limits.max_speculative_tokens,
                max_top_k=state.validator.max_top_k, max_concurrent_requests=state.max_concurrent_requests),
                (CompatGenerateRequest, GenerateRequest, TokenizeRequest, StreamResponse, *openai_bodies))
        return app.openapi_schema

    app.openapi = exact


def _copy_headers(response: Response) -> dict:
    return {k: v for k, v in response.headers.items() if k.startswith("x-")}


async def _generate(state: RouterState, inputs: str, parameters, request: Request) -> JSONResponse:
    async with RequestSession(state, request.is_disconnected) as session:
        try:
            job = await session.admit(inputs, parameters, stream=False)
            session.submit(job, job.valid.best_of)
            [generations] = await session.collect()
        except (Refused, GenerationError) as e:
            return error(e.status, e.message, e.error_type)
        except ClientGone:
            return error(499, "client disconnected", "cancelled")
    valid = job.valid
    ranked = sorted(zip(generations, job.entries), key=lambda ge: ge[0].sum_logprob, reverse=True)
    texts = [(valid.inputs if valid.return_full_text else "") + g.final.generated_text for g, _ in ranked]
    best, best_entry = ranked[0]
    others = [(t, g) for t, (g, _) in zip(texts[1:], ranked[1:])]
    body = generate_body(texts[0], best, others, valid.input_length, valid.details, valid.top_n_tokens > 0,
                         best_entry.num_cached_tokens)
    headers = session.timing_headers(job, best_entry, best)
    session.observe_duration()
    return JSONResponse(body, headers=headers)


async def _generate_stream(state: RouterState, inputs: str, parameters, request: Request):
    async with RequestSession(state, request.is_disconnected) as session:
        try:
            job = await session.admit(inputs, parameters, stream=True)
            [entry] = session.submit(job)
            first = await session.adapter_loaded()
        except (Refused, GenerationError) as e:
            return error(e.status, e.message, e.error_type)
        except ClientGone:
            return error(499, "client disconnected", "cancelled")
        return StreamingResponse(_events(session.keep_open(), job.valid, entry, first),
                                 media_type="text/event-stream", headers=session.stream_headers())


class InvocationsMiddleware:
    """SageMaker's `POST /invocations`, as TGI serves it: one route for every request shape, dispatched by the
    body: `messages` goes to /v1/chat/completions, `prompt` to /v1/completions, anything else to `/` (TGI's
    compat route: `inputs`, `parameters`, `stream`)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/invocations" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:  # the payload limit (an outer middleware) has bounded it already
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        try:
            fields = json.loads(body) if body else {}
        except ValueError:
            fields = {}
        shape = fields if isinstance(fields, dict) else {}
        path = "/v1/chat/completions" if "messages" in shape else "/v1/completions" if "prompt" in shape else "/"
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "path": path, "raw_path": path.encode()}, replay, send)


def _sse(payload: dict) -> str:
    # allow_nan=False: NaN and Infinity are not JSON; `responses.py` already wrote non-finite floats as null.
    return f"data:{json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def _events(session: RequestSession, valid: ValidGenerateRequest, entry: Entry,
                  first: object | None = None) -> AsyncIterator[str]:
    """One SSE event per token; the last carries the generated text and details (TGI's stream format). Closes
    `session` when the stream ends, however it ends.

    `first` is an event already taken from the entry (while waiting for its adapter), sent before the rest.
    """
    text_prefix = valid.inputs if valid.return_full_text else ""
    watch = DisconnectWatch(session.is_disconnected)
    index = 0  # TGI's `index`: the token's position in the generation, 1-based, across speculative blocks
    try:
        while True:
            if first is not None:
                event, first = first, None
            else:
                event = await next_event(entry, watch, keepalive=True)
            if event is None:  # waiting (in the queue, preempted): a comment, which SSE clients skip
                yield KEEPALIVE_COMMENT
                continue
            if isinstance(event, ErrorEvent):
                yield _sse({"error": event.message, "error_type": event.error_type})
                return
            if not isinstance(event, TokensEvent):
                continue
            final = event.final
            for i, token in enumerate(event.tokens):
                top = event.top_tokens[i] if i < len(event.top_tokens) else None
                index += 1
                body = token_body(token, skipped=event.skipped[i], alternatives=top)
                payload = {"index": index, "token": body, "generated_text": None, "details": None}
                if top is not None:
                    payload["top_tokens"] = top_tokens_body(top)
                last = i == len(event.tokens) - 1
                if last and final is not None:
                    payload["generated_text"] = text_prefix + final.generated_text
                    if valid.details:
                        payload["details"] = {"finish_reason": final.finish_reason, "prompt_tokens": valid.input_length,
                                              "generated_tokens": final.generated_tokens, "seed": final.seed,
                                              "input_length": valid.input_length,  # TGI's name of prompt_tokens
                                              "cached_tokens": entry.num_cached_tokens}
                yield _sse(payload)
            if final is not None:
                session.observe_duration()
                return
    except ClientGone:
        return
    finally:
        session.close()
