"""Router startup, as TGI's: connect to shard 0, discover every shard, refuse any that belongs to another launcher
run (`--instance-id` against each shard's Info), clear their caches, read Info, derive and check the token limits,
Warmup (the KV cache size comes back), load the preloaded adapters, then serve HTTP while the batching loop runs.

`run` is what the `specula-router` command (`cli.py`) calls with its `RouterConfig`; `info_body` builds `/info`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from specula_proto.limits import default_input_tokens, default_prefill_tokens, default_total_tokens
from specula_router.config import RouterConfig

logger = logging.getLogger("specula.router")


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int


def derive_limits(config: RouterConfig, max_position_embeddings: int, lookahead: int) -> Limits:
    """The limits the flags give, and defaults from the model's positions for the others (TGI 3's: a request
    may use every position but the lookahead's; `fit_to_kv` then lowers what the KV cache cannot hold), then
    the checks that keep every request servable. `lookahead`: the draft tokens a step may verify (the workers'
    `max_speculative_tokens`)."""
    max_total = config.max_total_tokens or default_total_tokens(max_position_embeddings, lookahead)
    max_input = config.max_input_tokens or default_input_tokens(max_total)
    prefill = config.max_batch_prefill_tokens or default_prefill_tokens(max_input)
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
    max_total = default_total_tokens(kv_tokens, lookahead)
    if config.max_input_tokens and config.max_input_tokens >= max_total:
        raise ValueError(f"the KV cache holds {kv_tokens} tokens: one request may have {max_total} with the "
                         f"speculative lookahead, not more than --max-input-tokens ({config.max_input_tokens}); lower "
                         f"it or give the cache more memory (--kv-cache-memory)")
    if max_total < 2:
        raise ValueError(f"the KV cache holds {kv_tokens} tokens, too few for any request; give it more memory "
                         f"(--kv-cache-memory)")
    max_input = config.max_input_tokens or default_input_tokens(max_total)
    prefill = config.max_batch_prefill_tokens or default_prefill_tokens(max_input, limits.max_batch_prefill_tokens)
    logger.info("the KV cache holds %d tokens: max_total_tokens %d -> %d, max_input_tokens %d", kv_tokens,
                limits.max_total_tokens, max_total, max_input)
    return Limits(max_input, max_total, prefill)


async def run(config: RouterConfig) -> int:
    """Connects to the workers, warms them up, builds the router and serves until shut down; the exit code."""
    from specula_router.client import ShardedClient

    client = await ShardedClient.connect(f"unix://{config.master_shard_uds_path}", instance_id=config.instance_id)
    info = await client.info()
    limits, num_blocks = await _warm_up(client, config, info)
    state, adapters = await _build_state(config, client, info, limits, num_blocks)
    return await _serve(config, state, adapters)


async def _build_state(config: RouterConfig, client, info, limits: Limits, num_blocks: int):
    """The router's parts over the connected workers: `(RouterState, AdapterManager)`."""
    from specula_router.adapters import AdapterManager
    from specula_router.block_allocator import BlockAllocator
    from specula_router.grammar_check import GrammarChecker
    from specula_router.metrics import Metrics
    from specula_router.openai_models import OpenAISettings
    from specula_router.scheduler import Scheduler, SchedulerConfig
    from specula_router.server import RouterState
    from specula_router.validation import Validator
    from specula_router.validation_limits import ValidationLimits
    from specula_server.hub import resolve_model_dir
    from specula_server.tokens import load_tokenizer

    lookahead = info.speculation.max_speculative_tokens  # the workers', whatever this router was told
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
        lookahead=lookahead, pipeline_depth=config.pipeline_depth, num_scheduler_steps=config.num_scheduler_steps,
        speculation_method=info.speculation.method or "none", step_timeout=config.step_timeout or None),
        metrics, adapters)
    state = RouterState(scheduler, validator, client, metrics, info_body(config, info, limits, num_blocks),
                        config.max_concurrent_requests, "gpu" if info.device_type == "cuda" else "cpu",
                        validation_workers=config.validation_workers, grammar_checker=grammar_checker,
                        openai=OpenAISettings(_chat_template(model_dir, config.chat_template),
                                              tuple(Path(d) for d in config.adapter_dir)))
    return state, adapters


async def _serve(config: RouterConfig, state, adapters) -> int:
    """Serves HTTP and runs the batching loop until shutdown; 1 when the loop failed, else the drain's code."""
    import uvicorn

    from specula_router.lifecycle import DRAIN_CUT_EXIT_CODE, DrainingServer
    from specula_router.server import create_app

    scheduler = state.scheduler
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
    await state.client.close()
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
