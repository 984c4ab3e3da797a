"""`specula-router`: the HTTP front of a Specula deployment (started by `specula-launcher`).

The Typer command and its options; every option also reads an environment variable. The flags become one
`RouterConfig` (config.py) and startup (startup.py: shards, token limits, Warmup, adapters, HTTP) runs it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import typer

from specula_router.config import RouterConfig, split_ids
from specula_router.startup import run

app = typer.Typer(add_completion=False, help="Specula router: HTTP API, validation, queue and batching.")
logger = logging.getLogger("specula.router")


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
