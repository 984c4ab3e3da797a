"""The OpenAI-compatible routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models[/{id}]`.

Registered by `server.create_app` beside the TGI routes, and, like them, a translator over a `RequestSession`
(`session.py`): each request becomes the router's one `GenerateParameters` and goes through the same admission,
validation (`Validator`, with the limits and messages of `/generate`, field names translated), scheduler, metrics
and timing headers as `/generate`; events come back as OpenAI's bodies and chunks (`openai_responses.py`,
`openai_streams.py`, `openai_chat.py`), and typed refusals (`Refused`, `GenerationError`) as OpenAI's errors.

    chat body ── model → adapter (openai_models) ── messages → chat template (chat_template) → prompt text
              └─ sampling fields → GenerateParameters ── session.admit (in flight, 429, validation, grammar) ──
              session.submit: n entries (seed + i) → scheduler → events → choices, usage / SSE chunks, [DONE]

Structured output (`grammar.py`): `response_format` (both routes) and, on chat, `tool_choice` "required" or a named
function become one llguidance grammar, checked against the tokenizer before admission (400 naming the field) and
carried by every entry of the request.

Sampling follows OpenAI: `temperature` 0 is greedy, an absent one is 1 (sampling); `n` choices of one prompt
share its admission and sample with seeds seed, seed + 1, ... (as `best_of` does). A chat prompt is tokenised
without adding special tokens again: the template writes them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from specula_router import openai_errors, openapi
from specula_router.chat_template import ChatTemplateError
from specula_router.grammar import Grammar, GrammarError, from_openai_response_format
from specula_router.openai_chat import chat_choice, parses_tools, template_messages, template_tools
from specula_router.openai_errors import OpenAIError
from specula_router.openai_models import ModelCatalog, ModelChoice, ModelNotFound, OpenAISettings
from specula_router.openai_responses import completion_logprobs, finish_reason, new_id, trim_at_stop, usage
from specula_router.openai_schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAICompletion,
    OpenAIErrorResponse,
    SamplingFields,
)
from specula_router.openai_streams import ChatChoiceStream, CompletionChoiceStream, stream_response
from specula_router.requests import ValidGenerateRequest
from specula_router.responses import ClientGone, Generation, GenerationError
from specula_router.schemas import GenerateParameters
from specula_router.session import Job, Refused, RequestSession
from specula_router.tool_call_grammar import tool_call_format, tool_call_grammar

if TYPE_CHECKING:
    from specula_router.server import RouterState

# How `/generate`'s field names read in a message about an OpenAI request: {route: {generate name: OpenAI name}}.
_CHAT_FIELDS = {"inputs": "messages", "max_new_tokens": "max_tokens", "top_n_tokens": "top_logprobs"}
_COMPLETION_FIELDS = {"inputs": "prompt", "max_new_tokens": "max_tokens", "top_n_tokens": "logprobs"}
# Fields copied unchanged into GenerateParameters.
_PASSED_THROUGH = ("frequency_penalty", "presence_penalty", "repetition_penalty", "seed", "stop",
                   "speculative_tokens", "api_token", "ignore_eos_token", "logit_bias", "merged_adapters")


def register(app: FastAPI, state: RouterState) -> None:
    """Adds the `/v1/*` routes and their error shape to `app`."""
    settings = state.openai or OpenAISettings()
    preloaded = (state.info.get("adapters") or {}).get("preloaded_adapter_ids") or ()
    api = OpenAIRoutes(state, settings, ModelCatalog(str(state.info.get("model_id", "")), settings,
                                                     state.scheduler.adapters, preloaded))
    openai_errors.install(app, state.metrics)
    errors = {code: {"model": OpenAIErrorResponse, "description": "OpenAI's error body (see docs/api.md)"}
              for code in (400, 404, 413, 422, 424, 429)}
    # A stream's events: chunks (or an error after the stream started), then `data: [DONE]`.
    sse = {"text/event-stream": {"schema": openapi.sse_event_schema("OpenAIChunk", "OpenAIErrorResponse",
                                                                    last="[DONE]")}}
    answers = {200: {"model": OpenAICompletion, "content": sse,
                     "description": "The completion; server-sent chunks when `stream`"}, **errors}

    @app.post("/v1/chat/completions", tags=["OpenAI"], responses=answers)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI chat completions; SSE chunks ending with `data: [DONE]` when `stream`."""
        return await api.chat(body, request)

    @app.post("/v1/completions", tags=["OpenAI"], responses=answers)
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI (legacy) completions of a prompt or a list of prompts."""
        return await api.complete(body, request)

    @app.get("/v1/models", tags=["OpenAI"])
    async def list_models():
        """The base model and every adapter the server can name now: loaded, preloaded and local."""
        return JSONResponse({"object": "list", "data": api.catalog.cards()})

    @app.get("/v1/models/{model:path}", tags=["OpenAI"], responses={404: errors[404]})
    async def retrieve_model(model: str):
        """One model card, or 404 `model_not_found`."""
        card = api.catalog.card(model)
        if card is None:
            return OpenAIError(404, str(ModelNotFound(model)), "model", "model_not_found").response()
        return JSONResponse(card)


class OpenAIRoutes:
    def __init__(self, state: RouterState, settings: OpenAISettings, catalog: ModelCatalog) -> None:
        self.state = state
        self.settings = settings
        self.catalog = catalog
        self.fingerprint = f"specula-{state.info.get('version') or '0'}"

    # --- chat ------------------------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, request: Request):
        async with RequestSession(self.state, request.is_disconnected) as session:
            try:
                prompt, grammar, fields = await self._chat_prompt(body)
                params = self._parameters(body, body.max_completion_tokens if body.max_completion_tokens is not None
                                          else body.max_tokens, body.top_logprobs)
                jobs = await self._admit_prompts(session, [prompt], params, body.n, body.stream, False, fields,
                                         greedy=_greedy(body), alternatives=body.logprobs, grammar=grammar)
            except OpenAIError as e:
                return e.response()
            names = {t.function.name for t in body.tools or ()} if parses_tools(body) else set()
            model = body.model or self.catalog.model_id
            stops = jobs[0].valid.stopping.stop_sequences
            if body.stream:
                choices = [ChatChoiceStream(i, stops, body.logprobs, names) for i in range(body.n)]
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                return await stream_response(session, choices, "chat.completion.chunk", new_id("chatcmpl"), model,
                                             self.fingerprint, include_usage)
            outcome = await self._collect(session)
            if isinstance(outcome, JSONResponse):
                return outcome
        generations, headers = outcome
        choices = [chat_choice(i, g, stops, body.logprobs, names) for i, g in enumerate(generations[0])]
        completion_tokens = sum(g.final.generated_tokens for g in generations[0])
        return JSONResponse({
            "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "system_fingerprint": self.fingerprint, "choices": choices,
            "usage": usage(jobs[0].valid.input_length, completion_tokens)}, headers=headers)

    async def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, str, dict[str, str]]:
        """The prompt the chat template renders for the messages, the answer's grammar ("" none), and the field
        names of `/generate` as this request calls them. Raises `OpenAIError`."""
        # `max_completion_tokens` wins when given, even 0 (refused), rather than falling back to `max_tokens`.
        newer = body.max_completion_tokens is not None
        template = self.settings.chat_template
        if template is None:
            raise OpenAIError(400, "this model has no chat template: start the server with --chat-template "
                                   "(a file or a template), or use /v1/completions", "messages", "chat_template")
        tools = template_tools(body)
        grammar = await self._chat_grammar(body, template.templates[template.template_for(tools)])
        messages = template_messages(body)
        try:
            prompt = await self.state.in_validation_worker(template.render, messages, tools, True)
        except ChatTemplateError as e:
            raise OpenAIError(422, f"the chat template refused the messages: {e}", "messages",
                              "chat_template") from None
        return prompt, grammar, dict(_CHAT_FIELDS, max_new_tokens="max_completion_tokens" if newer else "max_tokens")

    # --- completions -----------------------------------------------------------------------------------------

    async def complete(self, body: CompletionRequest, request: Request):
        async with RequestSession(self.state, request.is_disconnected) as session:
            return await self._complete(session, body)

    async def _complete(self, session: RequestSession, body: CompletionRequest):
        try:
            if body.suffix is not None:
                raise OpenAIError(400, "`suffix` is not supported: the models served here are not trained to fill "
                                       "in the middle", "suffix", "unsupported")
            if body.best_of not in (None, 1):
                raise OpenAIError(400, f"`best_of` must be 1 (or absent) here; use `n` for several choices. "
                                       f"Given: {body.best_of}", "best_of", "unsupported")
            prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if not prompts:
                raise OpenAIError(422, "`prompt` must not be an empty list", "prompt", "validation")
            params = self._parameters(body, body.max_tokens, body.logprobs)
            grammar = await self._check_grammar(self._built(from_openai_response_format, body.response_format))
            if body.echo and body.logprobs is not None and not body.stream:
                params = params.model_copy(update={"decoder_input_details": True})
            jobs = await self._admit_prompts(session, prompts, params, body.n, body.stream, True, _COMPLETION_FIELDS,
                                     greedy=_greedy(body), grammar=grammar)
        except OpenAIError as e:
            return e.response()
        model = body.model or self.catalog.model_id
        if body.stream:
            choices = [CompletionChoiceStream(p * body.n + i, job.valid.stopping.stop_sequences, body.logprobs,
                                              job.valid.inputs if body.echo else "")
                       for p, job in enumerate(jobs) for i in range(body.n)]
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await stream_response(session, choices, "text_completion", new_id("cmpl"), model,
                                         self.fingerprint, include_usage)
        outcome = await self._collect(session)
        if isinstance(outcome, JSONResponse):
            return outcome
        generations, headers = outcome
        choices = [_completion_choice(p * body.n + i, job.valid, g, body)
                   for p, (job, gens) in enumerate(zip(jobs, generations)) for i, g in enumerate(gens)]
        prompt_tokens = sum(job.valid.input_length for job in jobs)
        completion_tokens = sum(g.final.generated_tokens for gens in generations for g in gens)
        return JSONResponse({
            "id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": self.fingerprint, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens)}, headers=headers)

    # --- structured output --------------------------------------------------------------------------------------

    async def _chat_grammar(self, body: ChatCompletionRequest, template_text: str) -> str:
        """The grammar of a chat request: its `response_format`, or a forced tool call (`tool_choice` required or
        a named function) in the template's format; "" when neither constrains the answer."""
        forced = body.tool_choice not in (None, "none", "auto")
        if isinstance(body.tool_choice, str) and body.tool_choice not in ("none", "auto", "required"):
            raise OpenAIError(400, f"`tool_choice` must be none, auto, required or {{type: function, function: "
                                   f"{{name}}}}. Given: {body.tool_choice[:40]!r}", "tool_choice", "validation")
        if forced and not body.tools:
            raise OpenAIError(400, "`tool_choice` required or a named function needs `tools`", "tool_choice",
                              "validation")
        grammar = self._built(from_openai_response_format, body.response_format)
        if forced and grammar is not None:
            raise OpenAIError(400, "`response_format` json_object or json_schema cannot be combined with "
                                   "`tool_choice` required or a named function: the answer is a tool call",
                              "response_format", "validation")
        if forced:
            choice = body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
            checker = self.state.grammar_checker
            special = checker.special_tokens if checker is not None else frozenset()
            grammar = self._built(tool_call_grammar, tools, choice, tool_call_format(template_text), special,
                                  body.parallel_tool_calls is not False)
        return await self._check_grammar(grammar)

    def _built(self, build, *args) -> Grammar | None:
        """`build(*args, max_bytes)`, a refusal turned into OpenAI's 400 naming the field."""
        try:
            return build(*args, max_bytes=self.state.validator.limits.max_grammar_bytes)
        except GrammarError as e:
            raise OpenAIError(400, e.message, e.field, "validation") from None

    async def _check_grammar(self, grammar: Grammar | None) -> str:
        """The grammar's text once it compiles against the tokenizer ("" for none); else a 400 naming its field."""
        if grammar is None:
            return ""
        try:
            await self.state.check_grammar(grammar)
        except GrammarError as e:
            raise OpenAIError(400, e.message, e.field, "validation") from None
        return grammar.text

    # --- shared: parameters, admission, collection ---------------------------------------------------------------

    def _parameters(self, body: SamplingFields, max_new_tokens: int | None, top_n: int | None) -> GenerateParameters:
        """The body's fields as `/generate`'s parameters (ranges are the Validator's to check).

        Every field given is checked, even one this request then ignores (`top_p` when greedy, `top_logprobs`
        without `logprobs`, `adapter_source` for the base model): the OpenAPI document states one range per field.
        """
        try:
            choice = self.catalog.resolve(body.model, body.adapter_id, body.adapter_source)
        except ModelNotFound as e:
            raise OpenAIError(404, str(e), "model", "model_not_found") from None
        fields = {name: getattr(body, name) for name in _PASSED_THROUGH if getattr(body, name) is not None}
        fields.update(_sampling(body), details=True, max_new_tokens=max_new_tokens, top_n_tokens=top_n,
                      **_adapter(choice, body.adapter_source))
        return GenerateParameters.model_validate({k: v for k, v in fields.items() if v is not None})

    async def _admit_prompts(self, session: RequestSession, prompts: list[str], params: GenerateParameters, n: int,
                     stream: bool, add_special_tokens: bool, fields: dict[str, str], greedy: bool = False,
                     alternatives: bool = True, grammar: str = "") -> list[Job]:
        """Admits every prompt through `/generate`'s admission and submits `n` entries for each.

        `greedy`: decode greedily whatever warpers `params` held (only to be checked); `alternatives` False:
        return no alternatives whatever `top_n_tokens` held (likewise); `grammar`: the checked grammar every
        entry follows ("" none).
        """
        limit = self.state.max_concurrent_requests
        if n < 1 or n * len(prompts) > limit:
            raise OpenAIError(422, f"`n` must be >= 1, and `n` times the number of prompts at most {limit} "
                                   f"(--max-concurrent-requests). Given: n={n}, {len(prompts)} prompt(s)", "n",
                              "validation")
        try:
            for prompt in prompts:
                job = await session.admit(prompt, params, stream, add_special_tokens)
                job.valid = dataclasses.replace(_as_requested(job.valid, greedy, alternatives), grammar=grammar)
        except Refused as r:
            raise _openai_error(r, fields) from None
        for job in session.jobs:
            session.submit(job, n)
        return session.jobs

    async def _collect(self, session: RequestSession):
        """Every choice's generation ([job][choice]) and the first one's timing headers, or an error response."""
        try:
            per_job = await session.collect()
        except GenerationError as e:
            return OpenAIError(e.status, e.message, None, e.error_type).response()
        except ClientGone:
            return OpenAIError(499, "client disconnected", None, "cancelled").response()
        session.observe_duration()
        first = session.jobs[0]
        return per_job, session.timing_headers(first, first.entries[0], per_job[0][0])


def _greedy(body: SamplingFields) -> bool:
    return body.temperature == 0


def _sampling(body: SamplingFields) -> dict:
    """OpenAI's sampling: temperature 0 is greedy (top_p and top_k are then only checked, see `_as_requested`),
    absent samples at 1."""
    if _greedy(body):
        return {"do_sample": False, "top_p": body.top_p, "top_k": body.top_k}
    return {"do_sample": True, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}


def _as_requested(valid: ValidGenerateRequest, greedy: bool, alternatives: bool) -> ValidGenerateRequest:
    """The validated request without what was sent only to be checked: a greedy request's warpers (which would
    turn sampling on), and alternatives the client did not ask for."""
    if greedy:
        valid = dataclasses.replace(valid, sampling=dataclasses.replace(
            valid.sampling, do_sample=False, temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0))
    if not alternatives:
        valid = dataclasses.replace(valid, top_n_tokens=0)
    return valid


def _adapter(choice: ModelChoice, source: str | None) -> dict:
    """The adapter fields; the body's `adapter_source` goes along for the base model too, to be checked."""
    return {"adapter_id": choice.adapter_id, "adapter_source": choice.adapter_source or source}


def _openai_error(refused: Refused, fields: dict[str, str]) -> OpenAIError:
    """`/generate`'s refusal, with the OpenAI request's field names in its message and `param`."""
    if refused.field is not None:  # a validation error
        message = refused.message
        for generate_name, openai_name in fields.items():
            message = message.replace(f"`{generate_name}`", f"`{openai_name}`")
        return OpenAIError(refused.status, message, fields.get(refused.field, refused.field), refused.error_type)
    body = openai_errors.from_tgi(refused.status, {"error": refused.message, "error_type": refused.error_type})
    return OpenAIError(refused.status, body["error"]["message"], None, body["error"]["code"])


def _completion_choice(index: int, valid: ValidGenerateRequest, g: Generation, body: CompletionRequest) -> dict:
    generated = trim_at_stop(g.final.generated_text, valid.stopping.stop_sequences)
    prefix = valid.inputs if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        logprobs = completion_logprobs(g.tokens, g.top_tokens, body.logprobs, len(prefix))
        if body.echo:  # the prompt's tokens first, without alternatives (the prefill has none)
            prompt = completion_logprobs(g.prefill, [None] * len(g.prefill), body.logprobs)
            logprobs = {key: prompt[key] + logprobs[key] for key in logprobs}
    return {"index": index, "text": prefix + generated, "logprobs": logprobs,
            "finish_reason": finish_reason(g.final.finish_reason)}
