"""`specula-launcher`: one command that starts the model shards and the router and supervises them.

    specula-launcher --model-id meta-llama/Llama-3.1-8B-Instruct --num-shard 2 --speculative-tokens 3

Every flag also reads an environment variable (MODEL_ID, NUM_SHARD, PORT, ...), as in TGI and LoRAX. The
flags are turned into one `LauncherConfig` (config.py), the run's own socket path, torch.distributed port and
instance id are claimed (endpoints.py), the children's command lines are built from it (commands.py), and the
`Supervisor` (processes.py) runs them until SIGINT/SIGTERM or a child fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

import typer

from specula_launcher.commands import router_spec, shard_sockets, shard_specs
from specula_launcher.compat import UnknownArgument, check_foreign
from specula_launcher.config import LauncherConfig
from specula_launcher.defaults import build_config
from specula_launcher.endpoints import claim_endpoints
from specula_launcher.processes import LAUNCHER, LogSink, Supervisor, run_with_signal_handlers

app = typer.Typer(add_completion=False, help="Start the Specula model shards and router, and supervise them.")

# The router drains in-flight requests for up to --shutdown-timeout itself; this is its time to close after.
ROUTER_CLOSE_GRACE_S = 5.0
# Shards hold no client state: they stop at once on SIGTERM (the gRPC server's own grace is 5 s).
SHARD_STOP_TIMEOUT_S = 10.0


@app.command(context_settings={
    # Arguments the CLI does not know reach `main` in ctx.args, where compat.check_foreign refuses or warns about
    # TGI/LoRAX flags by name; anything else is still a "No such option" usage error.
    "ignore_unknown_options": True, "allow_extra_args": True})
def main(
    ctx: typer.Context,
    model_id: str | None = typer.Option(
        None, envvar="MODEL_ID", help="Hub model id, local directory or GGUF file (a path, or org/repo:FILE.gguf "
                                      "on the Hub). Default: the bundled demo model."),
    revision: str | None = typer.Option(None, envvar="REVISION", help="Hub revision (branch, tag or commit)."),
    num_shard: int = typer.Option(1, envvar="NUM_SHARD", help="Tensor-parallel shards (one process, one GPU each)."),
    dtype: str | None = typer.Option(
        None, envvar="DTYPE", help="float32, bfloat16 or float16. Default: bfloat16 on cuda, float32 on cpu."),
    quantize: str | None = typer.Option(
        None, envvar="QUANTIZE",
        help="Weight-only quantization of the linear layers: int8 (a scale per output channel) or int4 (a scale "
             "and zero per group of inputs), done by each shard at load time from the float checkpoint; or gguf, for "
             "a .gguf model: its Q8_0, Q4_0 and Q4_1 tensors served as the file holds them (other types as float). "
             "Default: none."),
    quantize_group_size: int = typer.Option(
        64, envvar="QUANTIZE_GROUP_SIZE", help="int4: inputs per scale and zero (32, 64, 128 or 256)."),
    device: str | None = typer.Option(
        None, envvar="DEVICE", help="cpu or cuda. Default: cuda when torch sees a GPU, else cpu."),
    port: int = typer.Option(3000, "--port", "-p", envvar="PORT", help="HTTP port of the router."),
    hostname: str = typer.Option("0.0.0.0", envvar="SPECULA_HOSTNAME", help="Address the router listens on."),
    speculative_tokens: int = typer.Option(
        0, "--speculative-tokens", "--speculate", envvar=["SPECULATIVE_TOKENS", "SPECULATE"],
        help="Draft tokens verified per request per step (0: off). --speculate is TGI's name."),
    speculation_mode: str = typer.Option(
        "adaptive", envvar="SPECULATION_MODE",
        help="adaptive (each request's draft length follows its acceptance and the load) or fixed."),
    ngram_min: int = typer.Option(1, envvar="NGRAM_MIN", help="Shortest n-gram prompt lookup matches."),
    ngram_max: int = typer.Option(3, envvar="NGRAM_MAX", help="Longest n-gram prompt lookup matches."),
    ngram_match: str = typer.Option(
        "latest", envvar="NGRAM_MATCH", help="Which earlier occurrence prompt lookup copies: latest or earliest."),
    speculator: str | None = typer.Option(
        None, envvar="SPECULATOR",
        help="Medusa heads, an MLP speculator, an EAGLE-3 speculator (`speculators` or original layout, for this "
             "model) or a draft model (a small causal LM with the model's tokenizer): "
             "directory or Hub id, drafting for every request without Medusa heads of its own; or `suffix`, "
             "suffix decoding (drafts from the request's context and from earlier requests' outputs, prompt "
             "lookup behind it; a directory called suffix is ./suffix). With the demo model, also a member of "
             "its bundled family: draft-model, mlp-speculator or medusa."),
    suffix_cache_tokens: int = typer.Option(
        100_000, envvar="SUFFIX_CACHE_TOKENS",
        help="With --speculator suffix: tokens of finished requests each shard keeps in its global suffix trees "
             "(their outputs, each after the last 24 tokens of its prompt; all adapters together; the oldest "
             "request's leave first)."),
    draft_tree_width: int = typer.Option(
        1, envvar="DRAFT_TREE_WIDTH",
        help="Candidates per Medusa head, MLP speculator stage or EAGLE-3 depth: 1 verifies the top-1 chain, "
             "more verify a tree of the best nodes."),
    adapter_source: str | None = typer.Option(
        None, "--adapter-source", "--default-adapter-source", envvar=["ADAPTER_SOURCE", "DEFAULT_ADAPTER_SOURCE"],
        help="Source of a request's adapter_id when it names none: hub or local. Default: hub; local when "
             "serving the bundled demo model. --default-adapter-source is LoRAX's name."),
    adapter_dir: list[str] | None = typer.Option(
        None, envvar="ADAPTER_DIR",
        help="Directory whose subdirectories are the `local` adapters (repeat the flag or separate with commas). "
             "Default: none, local adapters are refused; the bundled demo adapters when serving the demo model."),
    max_active_adapters: int = typer.Option(
        8, envvar="MAX_ACTIVE_ADAPTERS",
        help="Adapters loaded at once; past it the least recently used adapter with no queued or running request "
             "is offloaded."),
    preloaded_adapter_ids: list[str] | None = typer.Option(
        None, "--preloaded-adapter-ids", "--lora-adapters", envvar=["PRELOADED_ADAPTER_IDS", "LORA_ADAPTERS"],
        help="Adapters loaded before the router serves (repeat the flag or separate with commas); a failure stops "
             "the launch. --lora-adapters is TGI's name."),
    max_concurrent_requests: int = typer.Option(
        128, envvar="MAX_CONCURRENT_REQUESTS", help="Requests in flight before new ones get 429."),
    max_best_of: int = typer.Option(2, envvar="MAX_BEST_OF", help="Largest best_of a request may ask for."),
    max_stop_sequences: int = typer.Option(4, envvar="MAX_STOP_SEQUENCES", help="Stop sequences per request."),
    max_top_n_tokens: int = typer.Option(5, envvar="MAX_TOP_N_TOKENS", help="Largest top_n_tokens per request."),
    max_input_tokens: int | None = typer.Option(
        None, "--max-input-tokens", "--max-input-length", envvar=["MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"],
        help="Longest prompt in tokens. Default: --max-total-tokens - 1."),
    max_total_tokens: int | None = typer.Option(
        None, envvar="MAX_TOTAL_TOKENS",
        help="Longest prompt + generation. Default: the model's max_position_embeddings (less the speculative "
             "lookahead), lowered to what the KV cache holds."),
    waiting_served_ratio: float = typer.Option(
        1.2, envvar="WAITING_SERVED_RATIO", help="Waiting/running ratio above which new requests join early."),
    max_batch_prefill_tokens: int | None = typer.Option(
        None, envvar="MAX_BATCH_PREFILL_TOKENS",
        help="Prompt tokens per step. Default: --max-input-tokens + 50, at most 4096; a longer prompt is prefilled in "
             "chunks."),
    max_batch_total_tokens: int | None = typer.Option(
        None, envvar="MAX_BATCH_TOTAL_TOKENS", help="KV tokens across the batch. Default: measured at warmup."),
    max_waiting_tokens: int = typer.Option(
        20, envvar="MAX_WAITING_TOKENS", help="Steps before waiting requests are forced into the batch."),
    max_batch_size: int | None = typer.Option(None, envvar="MAX_BATCH_SIZE", help="Largest running batch."),
    shard_uds_path: str | None = typer.Option(
        None, envvar="SHARD_UDS_PATH",
        help="Shard socket prefix; shard r listens on PATH-r. Refused when a live process serves one of them. "
             "Default: a new directory of this launcher's own under $XDG_RUNTIME_DIR (else the temp directory), "
             "removed at exit."),
    master_addr: str = typer.Option(
        "localhost", envvar="MASTER_ADDR",
        help="torch.distributed address: node 0's address (reachable from every node) with --nnodes > 1."),
    master_port: int | None = typer.Option(
        None, envvar="MASTER_PORT",
        help="torch.distributed port (used with --num-shard > 1; refused when something listens on it). "
             "Default: a free port chosen at start; required with --nnodes > 1."),
    nnodes: int = typer.Option(
        1, envvar="NNODES",
        help="Nodes one tensor-parallel group spans (torchrun's name). Each node runs `specula-launcher` with the "
             "same --num-shard (all nodes' shards), --nnodes, --master-addr and --master-port, and its own "
             "--node-rank; node 0 also runs the router, which reaches the other nodes' shards over TCP."),
    node_rank: int = typer.Option(0, envvar="NODE_RANK", help="This node's rank, 0 .. --nnodes - 1 (torchrun's)."),
    node_host: str | None = typer.Option(
        None, envvar="NODE_HOST",
        help="With --node-rank > 0: the address node 0's router reaches this node's shards at (gRPC over TCP, "
             "a free port per shard). Default: this node's address on the route to --master-addr."),
    huggingface_hub_cache: Path | None = typer.Option(
        None, envvar="HUGGINGFACE_HUB_CACHE", help="Hub cache directory."),
    json_output: bool = typer.Option(
        False, "--json-output", envvar="JSON_OUTPUT", help="Log JSON lines {\"process\", \"line\"}."),
    payload_limit: int = typer.Option(2_000_000, envvar="PAYLOAD_LIMIT", help="Largest request body in bytes."),
    validation_workers: int = typer.Option(
        2, envvar="VALIDATION_WORKERS", help="Router threads that validate and tokenise requests off its event loop."),
    max_adapter_labels: int = typer.Option(
        32, envvar="MAX_ADAPTER_LABELS",
        help="Adapters that get their own `adapter` metrics label (the first to load); the others count as `other`."),
    metrics_prefix: str = typer.Option(
        "specula", envvar="METRICS_PREFIX",
        help="Prefix of the router's /metrics names; `tgi` (or `lorax`) gives TGI's (LoRAX's) names, so dashboards "
             "built for those servers work unchanged."),
    chat_template: str | None = typer.Option(
        None, envvar="CHAT_TEMPLATE",
        help="Chat template for /v1/chat/completions: a file, or the jinja template itself. Default: the model's "
             "own (tokenizer_config.json or chat_template.jinja); without one, chat requests get a 400."),
    max_grammar_bytes: int | None = typer.Option(
        None, envvar="MAX_GRAMMAR_BYTES",
        help="Largest structured-output grammar of a request (JSON schema, regex or tool-call grammar), in bytes "
             "as received. Default: the router's, 65536."),
    grammar_compile_timeout: float | None = typer.Option(
        None, envvar="GRAMMAR_COMPILE_TIMEOUT",
        help="Seconds the router may spend checking a request's grammar against the tokenizer before refusing it. "
             "Default: the router's, 10."),
    cors_allow_origin: list[str] | None = typer.Option(
        None, envvar="CORS_ALLOW_ORIGIN", help="Allowed CORS origin (repeat the flag for several)."),
    kv_cache_memory: str | None = typer.Option(
        None, envvar="KV_CACHE_MEMORY", help="KV cache size per shard, e.g. 2GiB. Default: the shard's."),
    kv_cache_dtype: str | None = typer.Option(
        None, envvar="KV_CACHE_DTYPE",
        help="What the KV cache stores keys and values in: auto (the --dtype), bfloat16, float16, fp8 or fp8_e4m3 "
             "(float8 e4m3fn; TGI's fp8_e4m3fn too), fp8_e5m2. Storage only, converted on write and read (fp8 with "
             "a scale of 1.0): a narrower cache holds more blocks in --kv-cache-memory (fp8: 4x float32's). "
             "Default: auto."),
    cuda_graphs: str | None = typer.Option(
        None, envvar="CUDA_GRAPHS",
        help="Batch sizes whose decode and verification steps are captured as CUDA graphs, separated by commas "
             "(0: none). Default: 1, 2, 4, then multiples of 8 up to 128. CUDA only, one shard, with triton."),
    block_size: int = typer.Option(16, envvar="BLOCK_SIZE", help="Tokens per KV cache block."),
    shutdown_timeout: int = typer.Option(
        30, "--shutdown-timeout", "--graceful-termination-timeout",
        envvar=["SHUTDOWN_TIMEOUT", "GRACEFUL_TERMINATION_TIMEOUT"],
        help="Seconds the router may spend draining requests on shutdown. --graceful-termination-timeout is "
             "TGI's name."),
    no_prefix_caching: bool = typer.Option(
        False, "--no-prefix-caching", envvar="NO_PREFIX_CACHING",
        help="Turn off prefix caching, by which a prompt reuses the KV cache of a prefix an earlier request "
             "computed (whole blocks) and only the rest is prefilled."),
    step_timeout: float = typer.Option(
        600.0, envvar="STEP_TIMEOUT",
        help="Seconds a shard may take to answer one step (0: no limit). Past it the step's requests fail, "
             "/health turns unhealthy and every process is stopped, as for a shard that died."),
    log_level: str = typer.Option("INFO", envvar="LOG_LEVEL", help="DEBUG, INFO, WARNING or ERROR."),
    api_key: str | None = typer.Option(
        None, envvar="API_KEY", show_default=False,
        help="Require `Authorization: Bearer <key>` on every route but /health, /ping and /metrics. Prefer the "
             "API_KEY environment variable: a flag's value shows in the process list. The router gets it in its "
             "environment, never on its command line."),
) -> None:
    """Start the model shards, wait until each is ready, start the router, and supervise them."""
    settings = dict(locals())  # every parameter is the LauncherConfig field of the same name, but:
    del settings["ctx"]
    try:
        warnings = check_foreign(ctx.args, os.environ)
    except UnknownArgument as e:
        ctx.fail(f"No such option: {e.argument}" if e.argument.startswith("-") else
                 f"Got unexpected extra argument ({e.argument})")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    sink = LogSink(sys.stderr, json_output)  # the launcher's own log format, JSON lines included
    for warning in warnings:
        sink.emit(LAUNCHER, f"warning: {warning}")
    settings["prefix_caching"] = not settings.pop("no_prefix_caching")
    settings["huggingface_hub_cache"] = str(huggingface_hub_cache) if huggingface_hub_cache else None
    try:
        config = build_config(**settings)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    raise typer.Exit(launch(config))


def launch(config: LauncherConfig, stream: TextIO | None = None) -> int:
    """Runs the shards and the router described by `config` until a signal (0) or a failure (1); 2, with
    nothing started, when a socket path or port it names is in use (see endpoints.py)."""
    sink = LogSink(stream or sys.stdout, config.json_output)
    try:
        endpoints = claim_endpoints(config)
    except ValueError as e:
        sink.emit(LAUNCHER, f"error: {e}")
        return 2
    config = endpoints.config
    where = f"router on {config.hostname}:{config.port}" if config.runs_router else "router on node 0"
    nodes = f", ranks {config.local_ranks.start}..{config.local_ranks.stop - 1} on node {config.node_rank} of " \
            f"{config.nnodes}" if config.nnodes > 1 else ""
    sink.emit(LAUNCHER, f"{config.num_shard} shard(s) of {config.model_id} on {config.device} ({config.dtype})"
                        f"{nodes}, {where}")
    sink.emit(LAUNCHER, f"max_input_tokens={config.max_input_tokens} max_total_tokens={config.max_total_tokens} "
                        f"max_batch_prefill_tokens={config.max_batch_prefill_tokens} "
                        f"speculative_tokens={config.speculative_tokens}")
    if config.adapter_dir or config.preloaded_adapter_ids:
        sink.emit(LAUNCHER, f"adapters: max_active_adapters={config.max_active_adapters} "
                            f"adapter_dir={','.join(config.adapter_dir) or '-'} "
                            f"preloaded={','.join(config.preloaded_adapter_ids) or '-'}")
    owner = "this launcher's own directory, removed at exit" if endpoints.owned_dir else "--shard-uds-path"
    ranks = config.local_ranks
    sink.emit(LAUNCHER, f"shard sockets {config.shard_uds_path}-{{{ranks.start}..{ranks.stop - 1}}} ({owner}), "
                        f"torch.distributed {config.master_addr}:{config.master_port}, instance {config.instance_id}")
    try:
        supervisor = Supervisor(
            shards=shard_specs(config), router=router_spec(config) if config.runs_router else None,
            shard_sockets=shard_sockets(config), sink=sink,
            drain_timeout=config.shutdown_timeout + ROUTER_CLOSE_GRACE_S, stop_timeout=SHARD_STOP_TIMEOUT_S,
        )
        return run_with_signal_handlers(supervisor)
    finally:
        endpoints.release()


if __name__ == "__main__":
    app()
