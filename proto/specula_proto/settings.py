"""Every setting of a Specula deployment, declared once: the table the three command lines are built from.

`specula-launcher`, `specula-router` and `specula-server serve` each declare their options with
`@with_settings(Process...)`, which adds one typer parameter per setting of that process to the command (flag
names, environment variables, defaults and help all come from here), and the launcher passes a child the value
of every setting both declare (`shared_with`), under the same flag (launcher/specula_launcher/commands.py).

Rows are in the order of the commands' --help: the model, the settings of the children alone (how a child
finds its shards, its place among them and its launcher run), then the launcher's in its order. A child's `Decl`
is where it declares a setting otherwise: most often a default the launcher derives before it passes a value
(--dtype, --adapter-source), or a help written for that process.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from specula_proto.choices import Device, Dtype, listed
from specula_proto.setting import Decl, Process, Setting

LAUNCHER, ROUTER, WORKER = Process.LAUNCHER, Process.ROUTER, Process.WORKER

SETTINGS: tuple[Setting, ...] = (
    Setting("model_id", str | None, None, LAUNCHER | ROUTER | WORKER,
            "Hub model id, local directory or GGUF file (a path, or org/repo:FILE.gguf on the Hub). Default: the "
            "bundled demo model.",
            router=Decl(type=str, default=..., help="Model id, directory or GGUF file (for the tokenizer and /info)."),
            worker=Decl(type=str, default=..., argument=True, help="Hub model id, local directory or GGUF file.")),
    # The children's own: how a child finds its shards, its place among them and its launcher run.
    Setting("master_shard_uds_path", str, "/tmp/specula-server-0", ROUTER,
            "Unix socket of shard 0."),
    Setting("uds_path", str, "/tmp/specula-server", WORKER,
            "Unix socket path prefix; shard r listens on PATH-r."),
    Setting("instance_id", str, "", ROUTER | WORKER,
            "Id of the launcher run whose shards this router serves: a shard reporting another id in Info is refused "
            "at startup. Empty: any shard, as long as all report the same id.",
            env="SPECULA_INSTANCE_ID",
            worker=Decl(help="Id of the launcher run this shard belongs to, reported in Info; a router given another "
                             "id refuses the shard. Empty when started alone.")),
    Setting("pipeline_depth", int, 2, ROUTER,
            "Steps queued in the workers at once (1: no pipelining).",
            min=1, max=4),
    Setting("rank", int, 0, WORKER,
            "This shard's rank."),
    Setting("world_size", int, 1, WORKER,
            "Number of shards."),
    Setting("local_rank", int | None, None, WORKER,
            "This shard's rank on its node, the index of its GPU (default: --rank; set per node when the group spans "
            "several nodes).",
            min=0),
    Setting("grpc_host", str | None, None, WORKER,
            "Also serve gRPC over TCP on this address (a free port), and give that address to the router: for shards "
            "on a node without the router (multi-node tensor parallelism)."),
    # The launcher's, in its order; most are also a child's, which the launcher passes on.
    Setting("revision", str | None, None, LAUNCHER | ROUTER | WORKER,
            "Hub revision (branch, tag or commit).",
            router=Decl(help="Hub revision.")),
    Setting("num_shard", int, 1, LAUNCHER | ROUTER,
            "Tensor-parallel shards (one process, one GPU each).",
            at_least=1,
            router=Decl(help="Number of shards (informational).")),
    Setting("dtype", str | None, None, LAUNCHER | WORKER,
            f"{listed(Dtype)}. Default: bfloat16 on cuda, float32 on cpu.",
            worker=Decl(type=str, default=Dtype.FLOAT32.value, help=f"{listed(Dtype)}.")),
    Setting("quantize", str | None, None, LAUNCHER | WORKER,
            "Quantization of the linear layers: int8 (a scale per output channel) or int4 (a scale and zero per "
            "group of inputs), weight-only, done by each shard at load time from the float checkpoint; w8a8: int8's "
            "weights by activations quantized to int8 at each product, per block of 32 inputs (llama.cpp's q8_0 "
            "arithmetic: faster on CPUs, slightly less exact); or gguf, for a .gguf model: its Q8_0, Q4_0 and Q4_1 "
            "tensors served as the file holds them (other types as float). Default: none."),
    Setting("quantize_group_size", int, 64, LAUNCHER | WORKER,
            "int4: inputs per scale and zero (32, 64, 128 or 256)."),
    Setting("device", str | None, None, LAUNCHER | WORKER,
            f"{listed(Device)}. Default: cuda when torch sees a GPU, else cpu.",
            worker=Decl(type=str, default=Device.CPU.value, help=f"{listed(Device)}.")),
    Setting("port", int, 3000, LAUNCHER | ROUTER,
            "HTTP port of the router.",
            flags=("--port", "-p"),
            router=Decl(flags=(), help="HTTP port.")),
    Setting("hostname", str, "0.0.0.0", LAUNCHER | ROUTER,
            "Address the router listens on.",
            env="SPECULA_HOSTNAME",
            router=Decl(help="HTTP bind address.")),
    Setting("speculative_tokens", int, 0, LAUNCHER | ROUTER | WORKER,
            "Draft tokens verified per request per step (0: off). --speculate is TGI's name.",
            env=("SPECULATIVE_TOKENS", "SPECULATE"),
            flags=("--speculative-tokens", "--speculate"),
            at_least=0,
            router=Decl(env="SPECULATIVE_TOKENS", flags=(), help="Max draft tokens per step."),
            worker=Decl(env="SPECULATIVE_TOKENS", flags=(), min=0,
                        help="Most draft tokens verified per request per step (0: off).")),
    Setting("speculation_mode", str, "adaptive", LAUNCHER | WORKER,
            "adaptive (each request's draft length follows its acceptance and the load) or fixed.",
            worker=Decl(help="adaptive (draft lengths follow acceptance and load) or fixed.")),
    Setting("ngram_min", int, 1, LAUNCHER | WORKER,
            "Shortest n-gram prompt lookup matches.",
            worker=Decl(min=1)),
    Setting("ngram_max", int, 3, LAUNCHER | WORKER,
            "Longest n-gram prompt lookup matches.",
            worker=Decl(min=1)),
    Setting("ngram_match", str, "latest", LAUNCHER | WORKER,
            "Which earlier occurrence prompt lookup copies: latest or earliest.",
            worker=Decl(help="Which earlier occurrence drafts: latest or earliest.")),
    Setting("speculator", str | None, None, LAUNCHER | ROUTER | WORKER,
            "Medusa heads, an MLP speculator, an EAGLE-3 speculator (`speculators` or original layout, for this "
            "model) or a draft model (a small causal LM with the model's tokenizer): directory or Hub id, drafting "
            "for every request without Medusa heads of its own; or `suffix`, suffix decoding (drafts from the "
            "request's context and from earlier requests' outputs, prompt lookup behind it; a directory called suffix "
            "is ./suffix). With the demo model, also a member of its bundled family: draft-model, mlp-speculator or "
            "medusa.",
            router=Decl(help="Speculator served for all requests."),
            worker=Decl(help="Medusa heads, an MLP speculator, an EAGLE-3 speculator (`speculators` or original "
                             "layout, for this model) or a draft model (a small causal LM with the model's "
                             "tokenizer): directory or Hub id, drafting for every request that has no Medusa heads of "
                             "its own.")),
    Setting("suffix_cache_tokens", int, 100_000, LAUNCHER | WORKER,
            "With --speculator suffix: tokens of finished requests each shard keeps in its global suffix trees (their "
            "outputs, each after the last 24 tokens of its prompt; all adapters together; the oldest request's leave "
            "first).",
            at_least=0,
            worker=Decl(min=0,
                        help="With --speculator suffix: output tokens of finished requests the global suffix trees "
                             "keep for drafting (per shard, all adapters together; the oldest request's leave "
                             "first).")),
    Setting("speculator_quantize", str | None, None, LAUNCHER | WORKER,
            "Weight-only quantization of an EAGLE-3 speculator's products (draft layer, fc, head): int8, or int4 "
            "with --quantize-group-size. A draft only proposes, so the output stays exact whatever its precision; "
            "a smaller drafter costs less a draft. Default: none (the speculator's own dtype)."),
    Setting("draft_tree_width", int, 1, LAUNCHER | WORKER,
            "Candidates per Medusa head, MLP speculator stage or EAGLE-3 depth: 1 verifies the top-1 chain, more "
            "verify a tree of the best nodes.",
            at_least=1,
            worker=Decl(min=1)),
    Setting("adapter_source", str | None, None, LAUNCHER | ROUTER,
            "Source of a request's adapter_id when it names none: hub or local. Default: hub; local when serving the "
            "bundled demo model. --default-adapter-source is LoRAX's name.",
            env=("ADAPTER_SOURCE", "DEFAULT_ADAPTER_SOURCE"),
            flags=("--adapter-source", "--default-adapter-source"),
            router=Decl(type=str, default="hub", env="ADAPTER_SOURCE", flags=(),
                        help="Source of a request's adapter_id when it names none: hub or local.")),
    Setting("adapter_dir", list[str] | None, None, LAUNCHER | ROUTER | WORKER,
            "Directory whose subdirectories are the `local` adapters (repeat the flag or separate with commas). "
            "Default: none, local adapters are refused; the bundled demo adapters when serving the demo model.",
            router=Decl(type=list[str], default=[],
                        help="The workers' adapter directories (repeat the flag): their adapters are listed by GET "
                             "/v1/models."),
            worker=Decl(type=list[Path], default=[],
                        help="Directory whose subdirectories are the `local` adapters requests may name "
                             "(repeatable).")),
    Setting("max_active_adapters", int, 8, LAUNCHER | ROUTER | WORKER,
            "Adapters loaded at once; past it the least recently used adapter with no queued or running request is "
            "offloaded.",
            at_least=1,
            router=Decl(min=1,
                        help="Adapters loaded at once (the workers' adapter slots); past it the least recently used "
                             "adapter with no queued or running request is offloaded."),
            worker=Decl(min=1, help="Adapters loaded at once (slots of the LoRA stacks).")),
    Setting("preloaded_adapter_ids", list[str] | None, None, LAUNCHER | ROUTER,
            "Adapters loaded before the router serves (repeat the flag or separate with commas); a failure stops the "
            "launch. --lora-adapters is TGI's name.",
            env=("PRELOADED_ADAPTER_IDS", "LORA_ADAPTERS"),
            flags=("--preloaded-adapter-ids", "--lora-adapters"),
            router=Decl(type=list[str], default=[], env="PRELOADED_ADAPTER_IDS", flags=(),
                        help="Adapters to load before serving (repeat the flag or separate with commas); a failure "
                             "stops startup.")),
    Setting("max_concurrent_requests", int, 128, LAUNCHER | ROUTER,
            "Requests in flight before new ones get 429.",
            at_least=1,
            router=Decl(help="Requests in flight before 429.")),
    Setting("max_best_of", int, 2, LAUNCHER | ROUTER,
            "Largest best_of a request may ask for.",
            at_least=1,
            router=Decl(help="Largest best_of.")),
    Setting("max_stop_sequences", int, 4, LAUNCHER | ROUTER,
            "Stop sequences per request.",
            at_least=0,
            router=Decl(help="Most stop sequences.")),
    Setting("max_top_n_tokens", int, 5, LAUNCHER | ROUTER,
            "Largest top_n_tokens per request.",
            at_least=0,
            router=Decl(help="Largest top_n_tokens.")),
    Setting("max_input_tokens", int | None, None, LAUNCHER | ROUTER,
            "Longest prompt in tokens. Default: --max-total-tokens - 1.",
            env=("MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH"),
            flags=("--max-input-tokens", "--max-input-length"),
            at_least=1,
            router=Decl(env="MAX_INPUT_TOKENS", help="Longest prompt in tokens.")),
    Setting("max_total_tokens", int | None, None, LAUNCHER | ROUTER,
            "Longest prompt + generation. Default: the model's max_position_embeddings (less the speculative "
            "lookahead), lowered to what the KV cache holds.",
            at_least=2,
            router=Decl(help="Longest prompt + generation in tokens.")),
    Setting("waiting_served_ratio", float, 1.2, LAUNCHER | ROUTER,
            "Waiting/running ratio above which new requests join early.",
            router=Decl(help="Waiting/running ratio that triggers a prefill.")),
    Setting("max_batch_prefill_tokens", int | None, None, LAUNCHER | ROUTER,
            "Prompt tokens per step. Default: --max-input-tokens + 50, at most 4096; a longer prompt is prefilled in "
            "chunks.",
            at_least=1,
            router=Decl(help="Most prompt tokens in one prefill.")),
    Setting("max_batch_total_tokens", int | None, None, LAUNCHER | ROUTER,
            "KV tokens across the batch. Default: measured at warmup.",
            at_least=2,
            router=Decl(help="Cap on KV cache tokens (default: what warmup finds).")),
    Setting("max_waiting_tokens", int, 20, LAUNCHER | ROUTER,
            "Steps before waiting requests are forced into the batch.",
            at_least=0,
            router=Decl(help="Steps a waiting request may be delayed.")),
    Setting("num_scheduler_steps", int, 4, LAUNCHER | ROUTER,
            "Decode steps the workers may run per Step call while every running request decodes and none waits "
            "(vLLM's multi-step scheduling): the router's work is paid once per call, tokens arrive in groups. "
            "1: one step per call, each token sent as soon as it is sampled.",
            at_least=1),
    Setting("max_batch_size", int | None, None, LAUNCHER | ROUTER,
            "Largest running batch.",
            at_least=1,
            router=Decl(help="Most requests in a batch.")),
    Setting("shard_uds_path", str | None, None, LAUNCHER,
            "Shard socket prefix; shard r listens on PATH-r. Refused when a live process serves one of them. Default: "
            "a new directory of this launcher's own under $XDG_RUNTIME_DIR (else the temp directory), removed at "
            "exit."),
    Setting("master_addr", str, "localhost", LAUNCHER | WORKER,
            "torch.distributed address: node 0's address (reachable from every node) with --nnodes > 1.",
            worker=Decl(help="torch.distributed address.")),
    Setting("master_port", int | None, None, LAUNCHER | WORKER,
            "torch.distributed port (used with --num-shard > 1; refused when something listens on it). Default: a "
            "free port chosen at start; required with --nnodes > 1.",
            worker=Decl(type=int, default=29500, help="torch.distributed port.")),
    Setting("nnodes", int, 1, LAUNCHER,
            "Nodes one tensor-parallel group spans (torchrun's name). Each node runs `specula-launcher` with the same "
            "--num-shard (all nodes' shards), --nnodes, --master-addr and --master-port, and its own --node-rank; "
            "node 0 also runs the router, which reaches the other nodes' shards over TCP."),
    Setting("node_rank", int, 0, LAUNCHER,
            "This node's rank, 0 .. --nnodes - 1 (torchrun's)."),
    Setting("node_host", str | None, None, LAUNCHER,
            "With --node-rank > 0: the address node 0's router reaches this node's shards at (gRPC over TCP, a free "
            "port per shard). Default: this node's address on the route to --master-addr."),
    Setting("huggingface_hub_cache", Path | None, None, LAUNCHER | ROUTER | WORKER,
            "Hub cache directory.",
            router=Decl(help="Hub cache.")),
    Setting("json_output", bool, False, LAUNCHER | ROUTER,
            "Log JSON lines {\"process\", \"line\"}.",
            flags=("--json-output",),
            router=Decl(flags=(), help="Log as JSON lines.")),
    Setting("payload_limit", int, 2_000_000, LAUNCHER | ROUTER,
            "Largest request body in bytes.",
            at_least=1),
    Setting("validation_workers", int, 2, LAUNCHER | ROUTER,
            "Router threads that validate and tokenise requests off its event loop.",
            at_least=1,
            router=Decl(min=1,
                        help="Threads that validate and tokenise requests (/generate, /tokenize) off the event loop.")),
    Setting("max_adapter_labels", int, 32, LAUNCHER | ROUTER,
            "Adapters that get their own `adapter` metrics label (the first to load); the others count as `other`.",
            at_least=0,
            router=Decl(min=0,
                        help="Adapters that get their own `adapter` metrics label, the first to load successfully; "
                             "every other adapter is counted as `other`.")),
    Setting("metrics_prefix", str, "specula", LAUNCHER | ROUTER,
            "Prefix of the router's /metrics names; `tgi` (or `lorax`) gives TGI's (LoRAX's) names, so dashboards "
            "built for those servers work unchanged.",
            router=Decl(help="Prefix of the /metrics names. `tgi` (or `lorax`) gives TGI's (LoRAX's) names, written "
                             "as TGI writes them (counters without `_total`), so dashboards built for those servers "
                             "work unchanged.")),
    Setting("chat_template", str | None, None, LAUNCHER | ROUTER,
            "Chat template for /v1/chat/completions: a file, or the jinja template itself. Default: the model's own "
            "(tokenizer_config.json or chat_template.jinja); without one, chat requests get a 400.",
            router=Decl(help="Chat template for /v1/chat/completions: a file, or the jinja template itself. Default: "
                             "the model's (tokenizer_config.json or chat_template.jinja).")),
    Setting("max_grammar_bytes", int | None, None, LAUNCHER | ROUTER,
            "Largest structured-output grammar of a request (JSON schema, regex or tool-call grammar), in bytes as "
            "received. Default: the router's, 65536.",
            at_least=1,
            router=Decl(type=int, default=65536, min=1,
                        help="Largest structured-output grammar of a request, in bytes as received: the JSON schema, "
                             "regex or tool-call grammar (past it: 422, or 400 on /v1/*).")),
    Setting("grammar_compile_timeout", float | None, None, LAUNCHER | ROUTER,
            "Seconds the router may spend checking a request's grammar against the tokenizer before refusing it. "
            "Default: the router's, 10.",
            router=Decl(type=float, default=10.0,
                        help="Seconds a request's grammar may take to check against the tokenizer before it is "
                             "refused (the result is cached per grammar).")),
    Setting("cors_allow_origin", list[str] | None, None, LAUNCHER | ROUTER,
            "Allowed CORS origin (repeat the flag for several).",
            router=Decl(type=list[str], default=[], help="Allowed CORS origins.")),
    Setting("kv_cache_memory", str | None, None, LAUNCHER | WORKER,
            "KV cache size per shard, e.g. 2GiB. Default: the shard's.",
            worker=Decl(help="KV cache size, e.g. 2GiB. Default: 1GiB on CPU, 90% of free memory after warmup on "
                             "CUDA.")),
    Setting("kv_cache_dtype", str | None, None, LAUNCHER | WORKER,
            "What the KV cache stores keys and values in: auto (the --dtype), bfloat16, float16, fp8 or fp8_e4m3 "
            "(float8 e4m3fn; TGI's fp8_e4m3fn too), fp8_e5m2. Storage only, converted on write and read (fp8 with a "
            "scale of 1.0): a narrower cache holds more blocks in --kv-cache-memory (fp8: 4x float32's). Default: "
            "auto.",
            worker=Decl(type=str, default="auto",
                        help="What the KV cache stores keys and values in: auto (the --dtype), bfloat16, float16, fp8 "
                             "or fp8_e4m3 (float8 e4m3fn, also fp8_e4m3fn), fp8_e5m2. Storage only (converted on "
                             "write and read, fp8 with a scale of 1.0): a narrower cache holds more blocks in "
                             "--kv-cache-memory.")),
    Setting("cuda_graphs", str | None, None, LAUNCHER | WORKER,
            "Batch sizes whose decode and verification steps are captured as CUDA graphs, separated by commas (0: "
            "none). Default: 1, 2, 4, then multiples of 8 up to 128. CUDA only, one shard, with triton."),
    Setting("block_size", int, 16, LAUNCHER | WORKER,
            "Tokens per KV cache block.",
            at_least=1),
    Setting("shutdown_timeout", int, 30, LAUNCHER | ROUTER,
            "Seconds the router may spend draining requests on shutdown. --graceful-termination-timeout is TGI's "
            "name.",
            env=("SHUTDOWN_TIMEOUT", "GRACEFUL_TERMINATION_TIMEOUT"),
            flags=("--shutdown-timeout", "--graceful-termination-timeout"),
            at_least=0,
            router=Decl(type=float, default=30.0, env="SHUTDOWN_TIMEOUT", flags=(),
                        help="Seconds to drain in-flight requests on SIGTERM.")),
    Setting("no_prefix_caching", bool, False, LAUNCHER | ROUTER,
            "Turn off prefix caching, by which a prompt reuses the KV cache of a prefix an earlier request computed "
            "(whole blocks) and only the rest is prefilled.",
            flags=("--no-prefix-caching",)),
    Setting("step_timeout", float, 600.0, LAUNCHER | ROUTER,
            "Seconds a shard may take to answer one step (0: no limit). Past it the step's requests fail, /health "
            "turns unhealthy and every process is stopped, as for a shard that died.",
            router=Decl(help="Seconds a shard may take to answer one step (0: no limit). Past it the step's requests "
                             "fail, /health turns unhealthy and the router exits, so the launcher stops the group.")),
    Setting("log_level", str, "INFO", LAUNCHER | ROUTER | WORKER,
            "DEBUG, INFO, WARNING or ERROR.",
            router=Decl(help="Python logging level."),
            worker=Decl(help="Python logging level.")),
    Setting("api_key", str | None, None, LAUNCHER | ROUTER,
            "Require `Authorization: Bearer <key>` on every route but /health, /ping and /metrics. Prefer the API_KEY "
            "environment variable: a flag's value shows in the process list. The router gets it in its environment, "
            "never on its command line.",
            show_default=False,
            router=Decl(help="Require `Authorization: Bearer <key>` on every route but /health, /ping and /metrics. "
                             "Prefer the environment variable: a flag's value shows in the process list.")),
)

Command = TypeVar("Command", bound=Callable[..., object])


def settings_of(process: Process) -> tuple[Setting, ...]:
    """The settings `process`'s command line takes, in the table's order."""
    return tuple(setting for setting in SETTINGS if process in setting.processes)


def shared_with(child: Process) -> tuple[Setting, ...]:
    """The settings the launcher and `child` both take: the launcher hands each of its values on to the child."""
    return tuple(setting for setting in SETTINGS if (LAUNCHER | child) in setting.processes)


def check_bounds(config: object, process: Process) -> None:
    """A ValueError naming the flag for the first setting of `process` whose value in `config` (an attribute of
    the setting's name; None: not set) is below the setting's `at_least`: "--max-batch-size must be at least 1;
    got 0"."""
    for setting in settings_of(process):
        value = getattr(config, setting.name, None)
        if setting.at_least is not None and value is not None and value < setting.at_least:
            raise ValueError(f"{setting.flag} must be at least {setting.at_least}; got {value}")


def with_settings(process: Process) -> Callable[[Command], Command]:
    """Declares the options of `process`'s typer command from the table. The command is written as
    `def main(ctx: typer.Context, **settings)`: its own parameters stay first, then one keyword parameter per
    setting, which typer reads from the signature and passes back by name."""

    def declare(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        parameters = own + [setting.parameter(process) for setting in settings_of(process)]
        command.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": signature.return_annotation}
        return command

    return declare
