"""`specula-router`: the HTTP front of a Specula deployment (started by `specula-launcher`).

Startup follows TGI: connect to shard 0, discover every shard, refuse any that belongs to another launcher run
(`--instance-id` against each shard's Info), clear their caches, read Info, derive and check the token limits,
Warmup (the KV cache size comes back), load the preloaded adapters, then serve HTTP while the batching loop runs.
Every option also reads an environment variable.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, help="Specula router: HTTP API, validation, queue and batching.")
logger = logging.getLogger("specula.router")


@dataclass(frozen=True)
class RouterConfig:
    model_id: str
    master_shard_uds_path: str
    instance_id: str = ""  # the launcher run whose shards this router may use; "": any (started by hand)
    revision: str | None = None
    huggingface_hub_cache: Path | None = None
    hostname: str = "0.0.0.0"
    port: int = 3000
    speculative_tokens: int = 0
    speculator: str | None = None
    adapter_source: str = "hub"
    max_active_adapters: int = 8
    preloaded_adapter_ids: tuple[str, ...] = ()
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    waiting_served_ratio: float = 1.2
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    payload_limit: int = 2_000_000
    cors_allow_origin: tuple[str, ...] = field(default_factory=tuple)
    json_output: bool = False
    num_shard: int = 1
    shutdown_timeout: float = 30.0
    pipeline_depth: int = 2
    validation_workers: int = 2  # threads that validate and tokenise requests off the event loop
    max_adapter_labels: int = 32  # adapters with their own metrics label; the rest are `other`
    metrics_prefix: str = "specula"  # metric names' prefix; `tgi`/`lorax` also write counters as TGI does
    step_timeout: float = 600.0  # seconds a shard may take to answer one step; 0: no limit
    prefix_caching: bool = True  # reuse the KV blocks of prompts' shared prefixes (block_allocator.py)
    chat_template: str | None = None  # --chat-template: a file or a template, overriding the model's
    adapter_dir: tuple[str, ...] = ()  # the workers' --adapter-dir, whose adapters GET /v1/models lists
    max_grammar_bytes: int = 65536  # largest grammar / JSON schema / regex text of a request (structured output)
    grammar_compile_timeout: float = 10.0  # seconds a request's grammar may take to check against the tokenizer
    # --api-key: the bearer token every route but the probes requires (auth.py). repr=False: a logged or printed
    # config never shows it.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from specula_router.schemas import ADAPTER_SOURCES, MAX_ADAPTER_ID_LENGTH

        if self.adapter_source not in ADAPTER_SOURCES:
            raise ValueError(f"--adapter-source must be one of {', '.join(ADAPTER_SOURCES)}; "
                             f"got {self.adapter_source!r}")
        if self.max_active_adapters < 1:
            raise ValueError(f"--max-active-adapters must be at least 1; got {self.max_active_adapters}")
        if len(set(self.preloaded_adapter_ids)) > self.max_active_adapters:
            raise ValueError(f"--preloaded-adapter-ids names {len(set(self.preloaded_adapter_ids))} adapters, more "
                             f"than --max-active-adapters ({self.max_active_adapters})")
        if self.validation_workers < 1:
            raise ValueError(f"--validation-workers must be at least 1; got {self.validation_workers}")
        if self.max_adapter_labels < 0:
            raise ValueError(f"--max-adapter-labels must not be negative; got {self.max_adapter_labels}")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(f"--metrics-prefix must be letters, digits and _ (not first a digit); "
                             f"got {self.metrics_prefix!r}")
        if self.step_timeout < 0:
            raise ValueError(f"--step-timeout must not be negative; got {self.step_timeout}")
        if self.max_grammar_bytes < 1:
            raise ValueError(f"--max-grammar-bytes must be at least 1; got {self.max_grammar_bytes}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"--grammar-compile-timeout must be positive; got {self.grammar_compile_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key (env API_KEY) must not be empty or blank")
        for adapter_id in self.preloaded_adapter_ids:
            if not adapter_id or len(adapter_id) > MAX_ADAPTER_ID_LENGTH:
                raise ValueError(f"--preloaded-adapter-ids: {adapter_id!r} is not an adapter id")


def split_ids(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Flag values given repeated, comma-separated or both: ["a,b", "c"] -> ("a", "b", "c")."""
    return tuple(part.strip() for value in values or () for part in value.split(",") if part.strip())


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int


DEFAULT_PREFILL_CAP = 4096  # the default prompt tokens per step: a longer prompt is prefilled in chunks


def derive_limits(config: RouterConfig, max_position_embeddings: int, lookahead: int) -> Limits:
    """The limits the flags give, and defaults from the model's positions for the others (TGI 3's: a request
    may use every position but the lookahead's; `fit_to_kv` then lowers what the KV cache cannot hold), then
    the checks that keep every request servable. `lookahead`: the draft tokens a step may verify (the workers'
    `max_speculative_tokens`)."""
    max_total = config.max_total_tokens or max_position_embeddings - lookahead
    max_input = config.max_input_tokens or max_total - 1
    prefill = config.max_batch_prefill_tokens or min(max_input + 50, DEFAULT_PREFILL_CAP)
    if max_input >= max_total:
        raise ValueError(f"--max-input-tokens ({max_input}) must be < --max-total-tokens ({max_total})")
    if max_total + lookahead > max_position_embeddings:
        raise ValueError(
            f"--max-total-tokens ({max_total}) + the workers' speculative lookahead ({lookahead}) exceeds the model's "
            f"{max_position_embeddings} positions"
        )
    return Limits(max_input, max_total, prefill)  # a prompt longer than `prefill` is prefilled in chunks


def fit_to_kv(limits: Limits, config: RouterConfig, kv_tokens: int, lookahead: int) -> Limits:
    """The limits lowered to what the KV cache holds: one request of `max_total_tokens + lookahead` must fit
    alone (or preempting every other request could not let it finish). Limits the flags set are kept, and
    refused when they do not fit; defaults are lowered, as TGI 3 derives them from the memory it finds."""
    if kv_tokens >= limits.max_total_tokens + lookahead:
        return limits
    if config.max_total_tokens:
        raise ValueError(f"the KV cache holds {kv_tokens} tokens, fewer than one request's "
                         f"{limits.max_total_tokens + lookahead} (--max-total-tokens + speculative lookahead); lower "
                         f"--max-total-tokens or give the cache more memory (--kv-cache-memory)")
    max_total = kv_tokens - lookahead
    if config.max_input_tokens and config.max_input_tokens >= max_total:
        raise ValueError(f"the KV cache holds {kv_tokens} tokens: one request may have {max_total} with the "
                         f"speculative lookahead, not more than --max-input-tokens ({config.max_input_tokens}); lower "
                         f"it or give the cache more memory (--kv-cache-memory)")
    if max_total < 2:
        raise ValueError(f"the KV cache holds {kv_tokens} tokens, too few for any request; give it more memory "
                         f"(--kv-cache-memory)")
    max_input = config.max_input_tokens or max_total - 1
    prefill = config.max_batch_prefill_tokens or min(limits.max_batch_prefill_tokens, max_input + 50)
    logger.info("the KV cache holds %d tokens: max_total_tokens %d -> %d, max_input_tokens %d", kv_tokens,
                limits.max_total_tokens, max_total, max_input)
    return Limits(max_input, max_total, prefill)


async def run(config: RouterConfig) -> int:
    import uvicorn

    from specula_router.adapters import AdapterManager
    from specula_router.block_allocator import BlockAllocator
    from specula_router.client import ShardedClient
    from specula_router.grammar_check import GrammarChecker
    from specula_router.lifecycle import DRAIN_CUT_EXIT_CODE, DrainingServer
    from specula_router.metrics import Metrics
    from specula_router.openai_models import OpenAISettings
    from specula_router.scheduler import Scheduler, SchedulerConfig
    from specula_router.server import RouterState, create_app
    from specula_router.validation import Validator
    from specula_router.validation_limits import ValidationLimits
    from specula_server.hub import resolve_model_dir
    from specula_server.tokens import load_tokenizer

    client = await ShardedClient.connect(f"unix://{config.master_shard_uds_path}", instance_id=config.instance_id)
    info = await client.info()
    lookahead = info.speculation.max_speculative_tokens  # the workers', whatever this router was told
    limits, num_blocks = await _warm_up(client, config, info)

    model_dir = resolve_model_dir(config.model_id, config.revision, config.huggingface_hub_cache,
                                  allow_patterns=("*.json", "tokenizer.model", "*.jinja"))
    tokenizer = load_tokenizer(model_dir)
    validator = Validator(tokenizer, ValidationLimits(
        max_input_tokens=limits.max_input_tokens, max_total_tokens=limits.max_total_tokens,
        max_stop_sequences=config.max_stop_sequences, max_best_of=config.max_best_of,
        max_top_n_tokens=config.max_top_n_tokens, max_speculative_tokens=lookahead,
        max_position_embeddings=info.max_position_embeddings, vocab_size=info.vocab_size or None,
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens, max_grammar_bytes=config.max_grammar_bytes),
        default_adapter_source=config.adapter_source)
    # Grammars are checked against the tokenizer as the workers compile them: their vocabulary and EOS ids.
    grammar_checker = GrammarChecker(tokenizer, info.vocab_size or None, info.eos_token_ids,
                                     config.grammar_compile_timeout)
    metrics = Metrics(prefix=config.metrics_prefix, max_adapter_labels=config.max_adapter_labels)
    metrics.set_model_info(info.dtype, info.quantize, info.kv_cache_dtype, info.device_type)
    adapters = AdapterManager(client, metrics, config.max_active_adapters, config.adapter_source)
    if config.preloaded_adapter_ids:
        logger.info("preloading adapters: %s", ", ".join(config.preloaded_adapter_ids))
        await adapters.preload(config.preloaded_adapter_ids)
    scheduler = Scheduler(client, BlockAllocator(num_blocks, info.block_size, config.prefix_caching), SchedulerConfig(
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens, waiting_served_ratio=config.waiting_served_ratio,
        max_waiting_tokens=config.max_waiting_tokens, max_batch_size=config.max_batch_size,
        lookahead=lookahead, pipeline_depth=config.pipeline_depth,
        speculation_method=info.speculation.method or "none", step_timeout=config.step_timeout or None),
        metrics, adapters)
    state = RouterState(scheduler, validator, client, metrics, info_body(config, info, limits, num_blocks),
                        config.max_concurrent_requests, "gpu" if info.device_type == "cuda" else "cpu",
                        validation_workers=config.validation_workers, grammar_checker=grammar_checker,
                        openai=OpenAISettings(_chat_template(model_dir, config.chat_template),
                                              tuple(Path(d) for d in config.adapter_dir)))
    app_ = create_app(state, config.payload_limit, list(config.cors_allow_origin), api_key=config.api_key)
    if config.api_key is not None:
        logger.info("API key required on every route but /health, /ping and /metrics")
    server = DrainingServer(uvicorn.Config(app_, host=config.hostname, port=config.port, log_config=None),
                            scheduler, config.shutdown_timeout)
    failures: list[BaseException] = []

    def on_loop_done(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("batching loop failed: %r", task.exception())
            failures.append(task.exception())
            server.should_exit = True

    loop_task = asyncio.create_task(scheduler.run())
    loop_task.add_done_callback(on_loop_done)
    logger.info("serving on http://%s:%d", config.hostname, config.port)
    await server.serve()
    loop_task.cancel()
    await adapters.close()
    await client.close()
    if failures:
        return 1
    return DRAIN_CUT_EXIT_CODE if server.num_cut else 0


async def _warm_up(client, config: RouterConfig, info) -> tuple[Limits, int]:
    """The limits, and the KV blocks the router may hand out, from the workers' Info and Warmup. The speculative
    lookahead and the block size are the workers' (`info`), whatever this router was told."""
    lookahead = info.speculation.max_speculative_tokens
    if config.speculative_tokens and config.speculative_tokens != lookahead:
        logger.warning("--speculative-tokens is %d but the workers verify up to %d draft tokens per step; "
                       "the router follows the workers", config.speculative_tokens, lookahead)
    limits = derive_limits(config, info.max_position_embeddings, lookahead)
    # Warmup drops every request in the workers and restarts their step count: no ClearCache is needed.
    warm = await client.warmup(limits.max_input_tokens, limits.max_batch_prefill_tokens,
                               limits.max_total_tokens + lookahead)
    num_blocks = warm.num_blocks
    if config.max_batch_total_tokens:
        num_blocks = min(num_blocks, config.max_batch_total_tokens // info.block_size)
    # Blocks grow with the sequences (a request is admitted with its prompt's and first step's), but the longest
    # request must still fit alone: limits are lowered to the cache, or refused when a flag set them.
    limits = fit_to_kv(limits, config, num_blocks * info.block_size, lookahead)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens", num_blocks, info.block_size,
                num_blocks * info.block_size)
    return limits, num_blocks


def _chat_template(model_dir: Path, override: str | None):
    """The model's chat template (or --chat-template), read once at startup; logged, since chat depends on it."""
    from specula_router.chat_template import load_chat_template

    template = load_chat_template(model_dir, override)
    if template is None:
        logger.info("no chat template: /v1/chat/completions answers 400 until --chat-template is given")
    else:
        logger.info("chat template from %s", template.source)
    return template


def info_body(config: RouterConfig, info, limits: Limits, num_blocks: int) -> dict:
    """The `/info` answer, built through its schema so the documented and served shapes cannot drift."""
    from importlib.metadata import PackageNotFoundError, version

    from specula_router.response_schemas import AdapterInfo, Info, SpeculationInfo

    try:
        specula_version = version("specula")
    except PackageNotFoundError:
        specula_version = "0.0.0+source"
    speculation = SpeculationInfo(
        method=info.speculation.method,
        max_speculative_tokens=info.speculation.max_speculative_tokens,
        mode=info.speculation.mode or "off",
        reserved_lookahead_tokens=info.speculation.max_speculative_tokens,
        speculator=config.speculator,
    )
    body = Info(
        model_id=config.model_id, model_sha=info.model_sha or None, model_dtype=info.dtype,
        model_device_type=info.device_type, quantize=info.quantize or None,
        kv_cache_dtype=info.kv_cache_dtype or None,
        max_concurrent_requests=config.max_concurrent_requests,
        max_best_of=config.max_best_of, max_stop_sequences=config.max_stop_sequences,
        max_top_n_tokens=config.max_top_n_tokens, max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens, max_position_embeddings=info.max_position_embeddings,
        waiting_served_ratio=config.waiting_served_ratio, max_batch_total_tokens=num_blocks * info.block_size,
        max_batch_prefill_tokens=limits.max_batch_prefill_tokens, max_waiting_tokens=config.max_waiting_tokens,
        max_batch_size=config.max_batch_size, validation_workers=config.validation_workers,
        num_shard=info.world_size,
        block_size=info.block_size, prefix_caching=config.prefix_caching, speculation=speculation,
        version=specula_version,
        adapters=AdapterInfo(max_active_adapters=config.max_active_adapters, adapter_source=config.adapter_source,
                             preloaded_adapter_ids=list(dict.fromkeys(config.preloaded_adapter_ids))),
    )
    return body.model_dump(mode="json")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        import json

        return json.dumps({"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                           "message": record.getMessage()})


def _setup_logging(level: str, json_output: bool) -> None:
    handler = logging.StreamHandler(sys.stdout)
    if json_output:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])


@app.command()
def main(
    model_id: str = typer.Option(..., envvar="MODEL_ID",
                                 help="Model id, directory or GGUF file (for the tokenizer and /info)."),
    master_shard_uds_path: str = typer.Option("/tmp/specula-server-0", envvar="MASTER_SHARD_UDS_PATH",
                                              help="Unix socket of shard 0."),
    instance_id: str = typer.Option(
        "", envvar="SPECULA_INSTANCE_ID",
        help="Id of the launcher run whose shards this router serves: a shard reporting another id in Info is "
             "refused at startup. Empty: any shard, as long as all report the same id."),
    revision: str | None = typer.Option(None, envvar="REVISION", help="Hub revision."),
    huggingface_hub_cache: Path | None = typer.Option(None, envvar="HUGGINGFACE_HUB_CACHE", help="Hub cache."),
    hostname: str = typer.Option("0.0.0.0", envvar="SPECULA_HOSTNAME", help="HTTP bind address."),
    port: int = typer.Option(3000, envvar="PORT", help="HTTP port."),
    speculative_tokens: int = typer.Option(0, envvar="SPECULATIVE_TOKENS", help="Max draft tokens per step."),
    speculator: str | None = typer.Option(None, envvar="SPECULATOR", help="Speculator served for all requests."),
    adapter_source: str = typer.Option("hub", envvar="ADAPTER_SOURCE",
                                       help="Source of a request's adapter_id when it names none: hub or local."),
    max_active_adapters: int = typer.Option(
        8, envvar="MAX_ACTIVE_ADAPTERS", min=1,
        help="Adapters loaded at once (the workers' adapter slots); past it the least recently used adapter "
             "with no queued or running request is offloaded."),
    preloaded_adapter_ids: list[str] = typer.Option(
        [], envvar="PRELOADED_ADAPTER_IDS",
        help="Adapters to load before serving (repeat the flag or separate with commas); a failure stops startup."),
    max_concurrent_requests: int = typer.Option(128, envvar="MAX_CONCURRENT_REQUESTS",
                                                help="Requests in flight before 429."),
    max_best_of: int = typer.Option(2, envvar="MAX_BEST_OF", help="Largest best_of."),
    max_stop_sequences: int = typer.Option(4, envvar="MAX_STOP_SEQUENCES", help="Most stop sequences."),
    max_top_n_tokens: int = typer.Option(5, envvar="MAX_TOP_N_TOKENS", help="Largest top_n_tokens."),
    max_input_tokens: int | None = typer.Option(None, "--max-input-tokens", "--max-input-length",
                                                   envvar="MAX_INPUT_TOKENS", help="Longest prompt in tokens."),
    max_total_tokens: int | None = typer.Option(None, envvar="MAX_TOTAL_TOKENS",
                                                   help="Longest prompt + generation in tokens."),
    waiting_served_ratio: float = typer.Option(1.2, envvar="WAITING_SERVED_RATIO",
                                               help="Waiting/running ratio that triggers a prefill."),
    max_batch_prefill_tokens: int | None = typer.Option(None, envvar="MAX_BATCH_PREFILL_TOKENS",
                                                           help="Most prompt tokens in one prefill."),
    max_batch_total_tokens: int | None = typer.Option(None, envvar="MAX_BATCH_TOTAL_TOKENS",
                                                         help="Cap on KV cache tokens (default: what warmup finds)."),
    max_waiting_tokens: int = typer.Option(20, envvar="MAX_WAITING_TOKENS",
                                           help="Steps a waiting request may be delayed."),
    max_batch_size: int | None = typer.Option(None, envvar="MAX_BATCH_SIZE", help="Most requests in a batch."),
    payload_limit: int = typer.Option(2_000_000, envvar="PAYLOAD_LIMIT", help="Largest request body in bytes."),
    cors_allow_origin: list[str] = typer.Option([], envvar="CORS_ALLOW_ORIGIN", help="Allowed CORS origins."),
    json_output: bool = typer.Option(False, envvar="JSON_OUTPUT", help="Log as JSON lines."),
    num_shard: int = typer.Option(1, envvar="NUM_SHARD", help="Number of shards (informational)."),
    shutdown_timeout: float = typer.Option(30.0, envvar="SHUTDOWN_TIMEOUT",
                                           help="Seconds to drain in-flight requests on SIGTERM."),
    log_level: str = typer.Option("INFO", envvar="LOG_LEVEL", help="Python logging level."),
    pipeline_depth: int = typer.Option(2, envvar="PIPELINE_DEPTH", min=1, max=4,
                                       help="Steps queued in the workers at once (1: no pipelining)."),
    validation_workers: int = typer.Option(
        2, envvar="VALIDATION_WORKERS", min=1,
        help="Threads that validate and tokenise requests (/generate, /tokenize) off the event loop."),
    max_adapter_labels: int = typer.Option(
        32, envvar="MAX_ADAPTER_LABELS", min=0,
        help="Adapters that get their own `adapter` metrics label, the first to load successfully; "
             "every other adapter is counted as `other`."),
    metrics_prefix: str = typer.Option(
        "specula", envvar="METRICS_PREFIX",
        help="Prefix of the /metrics names. `tgi` (or `lorax`) gives TGI's (LoRAX's) names, written as TGI writes "
             "them (counters without `_total`), so dashboards built for those servers work unchanged."),
    step_timeout: float = typer.Option(
        600.0, envvar="STEP_TIMEOUT",
        help="Seconds a shard may take to answer one step (0: no limit). Past it the step's requests fail, "
             "/health turns unhealthy and the router exits, so the launcher stops the group."),
    no_prefix_caching: bool = typer.Option(
        False, "--no-prefix-caching", envvar="NO_PREFIX_CACHING",
        help="Turn off prefix caching, by which a prompt reuses the KV cache of a prefix an earlier request "
             "computed (whole blocks) and only the rest is prefilled."),
    chat_template: str | None = typer.Option(
        None, envvar="CHAT_TEMPLATE",
        help="Chat template for /v1/chat/completions: a file, or the jinja template itself. Default: the model's "
             "(tokenizer_config.json or chat_template.jinja)."),
    adapter_dir: list[str] = typer.Option(
        [], envvar="ADAPTER_DIR",
        help="The workers' adapter directories (repeat the flag): their adapters are listed by GET /v1/models."),
    max_grammar_bytes: int = typer.Option(
        65536, envvar="MAX_GRAMMAR_BYTES", min=1,
        help="Largest structured-output grammar of a request, in bytes as received: the JSON schema, regex or "
             "tool-call grammar (past it: 422, or 400 on /v1/*)."),
    grammar_compile_timeout: float = typer.Option(
        10.0, envvar="GRAMMAR_COMPILE_TIMEOUT",
        help="Seconds a request's grammar may take to check against the tokenizer before it is refused (the "
             "result is cached per grammar)."),
    api_key: str | None = typer.Option(
        None, envvar="API_KEY", show_default=False,
        help="Require `Authorization: Bearer <key>` on every route but /health, /ping and /metrics. Prefer the "
             "environment variable: a flag's value shows in the process list."),
) -> None:
    """Serve the HTTP API in front of running model shards."""
    _setup_logging(log_level, json_output)
    try:
        config = RouterConfig(
            model_id=model_id, master_shard_uds_path=master_shard_uds_path, instance_id=instance_id, revision=revision,
            huggingface_hub_cache=huggingface_hub_cache, hostname=hostname, port=port,
            speculative_tokens=speculative_tokens, speculator=speculator, adapter_source=adapter_source,
            max_active_adapters=max_active_adapters, preloaded_adapter_ids=split_ids(preloaded_adapter_ids),
            max_concurrent_requests=max_concurrent_requests, max_best_of=max_best_of,
            max_stop_sequences=max_stop_sequences, max_top_n_tokens=max_top_n_tokens, max_input_tokens=max_input_tokens,
            max_total_tokens=max_total_tokens, waiting_served_ratio=waiting_served_ratio,
            max_batch_prefill_tokens=max_batch_prefill_tokens, max_batch_total_tokens=max_batch_total_tokens,
            max_waiting_tokens=max_waiting_tokens, max_batch_size=max_batch_size, payload_limit=payload_limit,
            cors_allow_origin=tuple(cors_allow_origin), json_output=json_output, num_shard=num_shard,
            shutdown_timeout=shutdown_timeout, pipeline_depth=pipeline_depth,
            validation_workers=validation_workers, max_adapter_labels=max_adapter_labels, step_timeout=step_timeout,
            metrics_prefix=metrics_prefix,
            prefix_caching=not no_prefix_caching,
            chat_template=chat_template, adapter_dir=split_ids(adapter_dir), api_key=api_key,
            max_grammar_bytes=max_grammar_bytes, grammar_compile_timeout=grammar_compile_timeout,
        )
        code = asyncio.run(run(config))
    except ValueError as e:
        logger.error("%s", e)
        raise typer.Exit(2) from e
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
