"""The launcher's configuration: one frozen `LauncherConfig`, built once from the command line and environment.

`build_config` is the only place that fills in derived defaults (the bundled demo model, the device, the dtype
and the token limits read from the model's `config.json`); `LauncherConfig.__post_init__` checks every value
and every relation between values, so a config that exists is a valid one. Errors are `ValueError`s that name
the command-line flag, e.g. "--max-input-tokens (4096) must be less than --max-total-tokens (4096)".

Token limits follow TGI 3, except that speculation's lookahead is reserved inside the model's positions (a
request may hold `max_total_tokens + speculative_tokens` positions while drafts are verified; LoRAX #474). For
a local model with `max_position_embeddings = 2048`, `--speculative-tokens 3` and no limit given:

    max_total_tokens         = 2048 - 3                          = 2045
    max_input_tokens         = max_total_tokens - 1              = 2044
    max_batch_prefill_tokens = min(max_input_tokens + 50, 4096)  = 2094

These defaults are checked here and shown, but only limits the user set reach the router: it derives the same
defaults and lowers them to what the KV cache holds once the workers have measured it (TGI 3 does the same), so
a model of 128k positions on a small cache starts rather than failing. For a Hub id the launcher does not
download anything: limits not given stay None.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# The small Llama model shipped inside the package (see demo_model/README.md).
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"
# Its family, shipped beside it (see demo_adapters/README.md): LoRA adapters and Medusa heads that requests name
# as local adapters, and an MLP speculator and a draft model for --speculator. Served with the demo model, this
# is the default --adapter-dir, local the default --adapter-source, and --speculator may name a member.
DEMO_ADAPTERS_DIR = Path(__file__).resolve().parent / "demo_adapters"

DTYPES = ("float32", "bfloat16", "float16")
# The worker's (specula_server.layers.quantization), checked before any start.
QUANTIZE_METHODS = ("int8", "int4", "gguf")
# The worker's --kv-cache-dtype values (specula_server.kv_cache.KV_CACHE_DTYPES), checked before any start.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e4m3fn", "fp8_e5m2")
INT4_GROUP_SIZES = (32, 64, 128, 256)
DEVICES = ("cpu", "cuda")
ADAPTER_SOURCES = ("hub", "local")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# TGI's default prefill budget: one full prompt plus a little room for a second, short one; at most 4096 tokens
# a step (a longer prompt is prefilled in chunks).
PREFILL_TOKENS_HEADROOM = 50
DEFAULT_PREFILL_CAP = 4096
# The token limits the router derives itself when the user sets none (see the module docstring).
TOKEN_LIMITS = ("max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens")
# config.json keys that hold the position limit, in order of preference (Llama-family first).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_UDS_PATH_BYTES = 107

_SIZE = re.compile(r"^\s*\d+(?:\.\d+)?\s*(?:[KMGT]i?B|B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class LauncherConfig:
    """Every setting of one launcher run; field names are the flag names with `_` for `-`.

    `shard_uds_path`, `master_port` and `instance_id` left None are filled in at launch, once, by
    `endpoints.claim_endpoints`: the children's command lines are built only from a config that went through it.
    """

    model_id: str
    dtype: str
    device: str
    quantize: str | None = None  # weight-only quantization of the linear layers: int8, int4, gguf or None
    quantize_group_size: int = 64  # int4: inputs per scale and zero
    kv_cache_dtype: str | None = None  # what the shards' KV cache stores (KV_CACHE_DTYPES); None: theirs (auto)
    cuda_graphs: str | None = None  # batch sizes captured as CUDA graphs, "1,2,4" ("0": none); None: the shards'
    revision: str | None = None
    num_shard: int = 1
    port: int = 3000
    hostname: str = "0.0.0.0"
    speculative_tokens: int = 0
    speculation_mode: str = "adaptive"
    ngram_min: int = 1
    ngram_max: int = 3
    ngram_match: str = "latest"
    speculator: str | None = None
    suffix_cache_tokens: int = 100_000  # --speculator suffix: output tokens the global suffix trees keep
    draft_tree_width: int = 1
    adapter_source: str = "hub"
    adapter_dir: tuple[str, ...] = ()  # directories whose subdirectories are the `local` adapters
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
    shard_uds_path: str | None = None  # None: a directory of this launcher's own, chosen at launch (endpoints.py)
    master_addr: str = "localhost"
    master_port: int | None = None  # None: a free port, chosen at launch (one node only)
    nnodes: int = 1  # nodes the tensor-parallel group spans; node 0 runs the router
    node_rank: int = 0  # this node's place among them
    node_host: str | None = None  # the address node 0's router reaches this node's shards at (nodes > 0)
    huggingface_hub_cache: str | None = None
    json_output: bool = False
    payload_limit: int = 2_000_000
    validation_workers: int = 2  # router threads that validate and tokenise requests
    max_adapter_labels: int = 32  # adapters with their own metrics label; the rest are `other`
    metrics_prefix: str = "specula"  # the router's metric names' prefix (`tgi`: TGI's names)
    chat_template: str | None = None  # the router's template for /v1/chat/completions (a file or a template)
    max_grammar_bytes: int | None = None  # the router's limit on a request's grammar text; None: its default
    grammar_compile_timeout: float | None = None  # seconds the router may spend checking a grammar; None: default
    cors_allow_origin: tuple[str, ...] = ()
    kv_cache_memory: str | None = None
    block_size: int = 16
    shutdown_timeout: int = 30
    step_timeout: float = 600.0  # seconds a shard may take to answer one step (0: no limit)
    prefix_caching: bool = True  # the router reuses KV blocks of shared prompt prefixes
    log_level: str = "INFO"
    # --api-key: the bearer token the router requires (TGI's). Handed to the router in its environment, never on a
    # command line (which `ps` shows); repr=False keeps it out of any printed config.
    api_key: str | None = field(default=None, repr=False)
    # Not a flag: the id of this launcher run, generated at launch and passed to every child; the router refuses
    # a shard reporting another one. None until then.
    instance_id: str | None = None
    # Not a flag: the token limits the user set (names from TOKEN_LIMITS); the others are defaults, which the
    # router derives again and fits to the KV cache.
    given_limits: tuple[str, ...] = TOKEN_LIMITS

    def __post_init__(self) -> None:
        _check_choices(self)
        _check_ranges(self)
        _check_token_relations(self)

    @property
    def local_ranks(self) -> range:
        """The global ranks of the shards this launcher runs: `num_shard / nnodes` of them, by node."""
        per_node = self.num_shard // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def runs_router(self) -> bool:
        return self.node_rank == 0

    def shard_socket(self, rank: int) -> Path:
        """The unix socket shard `rank` listens on once its model is loaded (the path must be chosen by then)."""
        assert self.shard_uds_path is not None, "the socket path is chosen at launch (endpoints.claim_endpoints)"
        return Path(f"{self.shard_uds_path}-{rank}")


def _check_choices(c: LauncherConfig) -> None:
    if not c.model_id:
        raise ValueError("--model-id must not be empty")
    if c.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {c.dtype!r}")
    if c.device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}; got {c.device!r}")
    if c.quantize is not None and c.quantize not in QUANTIZE_METHODS:
        raise ValueError(f"--quantize {c.quantize} is not supported; supported: {', '.join(QUANTIZE_METHODS)} "
                         "(int8 and int4: weight-only, quantized at load time from a float checkpoint, so for a GPTQ "
                         "or AWQ model serve its float original with --quantize int4; gguf: a GGUF file's own "
                         "Q8_0/Q4_0/Q4_1 blocks)")
    if c.quantize == "gguf" and not c.model_id.lower().endswith(".gguf"):
        raise ValueError(f"--quantize gguf serves a GGUF file's own blocks; --model-id {c.model_id} is not a .gguf "
                         "file (for a float checkpoint use --quantize int8 or int4)")
    if c.quantize_group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"--quantize-group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; "
                         f"got {c.quantize_group_size}")
    if c.kv_cache_dtype is not None and c.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {c.kv_cache_dtype!r}")
    if c.cuda_graphs is not None and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", c.cuda_graphs):
        raise ValueError(f"--cuda-graphs takes batch sizes separated by commas, or 0 for none; got {c.cuda_graphs!r}")
    if c.adapter_source not in ADAPTER_SOURCES:
        raise ValueError(f"--adapter-source must be one of {', '.join(ADAPTER_SOURCES)}; got {c.adapter_source!r}")
    if c.api_key is not None and not c.api_key.strip():
        raise ValueError("--api-key (env API_KEY) must not be empty or blank")
    if c.log_level not in LOG_LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {c.log_level!r}")
    if c.speculation_mode not in ("adaptive", "fixed"):
        raise ValueError(f"--speculation-mode must be adaptive or fixed; got {c.speculation_mode!r}")
    if c.ngram_match not in ("latest", "earliest"):
        raise ValueError(f"--ngram-match must be latest or earliest; got {c.ngram_match!r}")
    if not 1 <= c.ngram_min <= c.ngram_max:
        raise ValueError(f"need 1 <= --ngram-min ({c.ngram_min}) <= --ngram-max ({c.ngram_max})")
    if c.kv_cache_memory is not None and not _SIZE.match(c.kv_cache_memory):
        raise ValueError(f"--kv-cache-memory is not a size: {c.kv_cache_memory!r} (examples: 4GiB, 512MiB, 1000000)")
    for directory in c.adapter_dir:
        if not Path(directory).is_dir():
            raise ValueError(f"--adapter-dir {directory}: no such directory")
    if len(set(c.preloaded_adapter_ids)) > c.max_active_adapters:
        raise ValueError(f"--preloaded-adapter-ids names {len(set(c.preloaded_adapter_ids))} adapters, more than "
                         f"--max-active-adapters ({c.max_active_adapters})")
    longest = len(str(c.shard_socket(c.num_shard - 1)).encode()) if c.shard_uds_path is not None else 0
    if longest > MAX_UDS_PATH_BYTES:
        raise ValueError(f"--shard-uds-path is too long: {c.shard_socket(c.num_shard - 1)} is {longest} bytes, "
                         f"unix sockets allow {MAX_UDS_PATH_BYTES}")


def _check_ranges(c: LauncherConfig) -> None:
    at_least = {
        "--num-shard": (c.num_shard, 1), "--speculative-tokens": (c.speculative_tokens, 0),
        "--max-active-adapters": (c.max_active_adapters, 1), "--draft-tree-width": (c.draft_tree_width, 1),
        "--max-concurrent-requests": (c.max_concurrent_requests, 1), "--max-best-of": (c.max_best_of, 1),
        "--max-stop-sequences": (c.max_stop_sequences, 0), "--max-top-n-tokens": (c.max_top_n_tokens, 0),
        "--max-input-tokens": (c.max_input_tokens, 1), "--max-total-tokens": (c.max_total_tokens, 2),
        "--max-batch-prefill-tokens": (c.max_batch_prefill_tokens, 1),
        "--max-batch-total-tokens": (c.max_batch_total_tokens, 2), "--max-waiting-tokens": (c.max_waiting_tokens, 0),
        "--max-batch-size": (c.max_batch_size, 1), "--payload-limit": (c.payload_limit, 1),
        "--validation-workers": (c.validation_workers, 1), "--max-adapter-labels": (c.max_adapter_labels, 0),
        "--block-size": (c.block_size, 1), "--shutdown-timeout": (c.shutdown_timeout, 0),
        "--suffix-cache-tokens": (c.suffix_cache_tokens, 0), "--max-grammar-bytes": (c.max_grammar_bytes, 1),
    }
    for flag, (value, low) in at_least.items():
        if value is not None and value < low:
            raise ValueError(f"{flag} must be at least {low}; got {value}")
    if c.step_timeout < 0:
        raise ValueError(f"--step-timeout must not be negative; got {c.step_timeout}")
    if c.grammar_compile_timeout is not None and not c.grammar_compile_timeout > 0:
        raise ValueError(f"--grammar-compile-timeout must be positive; got {c.grammar_compile_timeout}")
    if c.waiting_served_ratio < 0:
        raise ValueError(f"--waiting-served-ratio must not be negative; got {c.waiting_served_ratio}")
    for flag, port in (("--port", c.port), ("--master-port", c.master_port)):
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"{flag} must be between 1 and 65535; got {port}")
    if c.port == c.master_port:
        raise ValueError(f"--port and --master-port are both {c.port}; the router and torch.distributed "
                         f"cannot share a port")
    _check_nodes(c)


def _check_nodes(c: LauncherConfig) -> None:
    """torchrun's rules: every node names the same --nnodes, --master-addr and --master-port, and its own
    --node-rank; the shards divide evenly among the nodes."""
    if c.nnodes < 1 or not 0 <= c.node_rank < c.nnodes:
        raise ValueError(f"need --nnodes >= 1 and 0 <= --node-rank < --nnodes; got --nnodes {c.nnodes}, "
                         f"--node-rank {c.node_rank}")
    if c.num_shard % c.nnodes:
        raise ValueError(f"--num-shard ({c.num_shard}, the shards of all nodes) must be a multiple of --nnodes "
                         f"({c.nnodes})")
    if c.nnodes > 1 and c.master_port is None:
        raise ValueError("--nnodes > 1 needs --master-port (env MASTER_PORT): every node must name the same one")


def _check_token_relations(c: LauncherConfig) -> None:
    """TGI's rules: a prompt must leave room for one new token and fit in the batch. (It need not fit in one
    prefill: a longer prompt is prefilled in chunks of --max-batch-prefill-tokens.)"""
    if c.max_input_tokens is not None and c.max_total_tokens is not None \
            and c.max_input_tokens >= c.max_total_tokens:
        raise ValueError(f"--max-input-tokens ({c.max_input_tokens}) must be less than --max-total-tokens "
                         f"({c.max_total_tokens})")
    if c.max_batch_total_tokens is not None:
        if c.max_batch_prefill_tokens is not None and c.max_batch_prefill_tokens > c.max_batch_total_tokens:
            raise ValueError(f"--max-batch-prefill-tokens ({c.max_batch_prefill_tokens}) must not exceed "
                             f"--max-batch-total-tokens ({c.max_batch_total_tokens})")
        if c.max_total_tokens is not None and c.max_total_tokens + c.speculative_tokens > c.max_batch_total_tokens:
            raise ValueError(f"--max-total-tokens ({c.max_total_tokens}) + --speculative-tokens "
                             f"({c.speculative_tokens}) must not exceed --max-batch-total-tokens "
                             f"({c.max_batch_total_tokens}): one request must fit in the batch")


def build_config(
    *,
    model_id: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    max_input_tokens: int | None = None,
    max_total_tokens: int | None = None,
    max_batch_prefill_tokens: int | None = None,
    max_batch_total_tokens: int | None = None,
    num_shard: int = 1,
    speculative_tokens: int = 0,
    cors_allow_origin: list[str] | tuple[str, ...] | None = None,
    adapter_dir: list[str] | tuple[str, ...] | None = None,
    adapter_source: str | None = None,
    speculator: str | None = None,
    preloaded_adapter_ids: list[str] | tuple[str, ...] | None = None,
    log_level: str = "INFO",
    count_cuda_devices: Callable[[], int] | None = None,
    **settings: object,
) -> LauncherConfig:
    """Fills in the derived defaults and returns the validated config.

    `settings` are the remaining `LauncherConfig` fields, passed through unchanged. `count_cuda_devices` is
    only called when the device is not given or is "cuda" (it imports torch; tests pass a stub). `adapter_dir`
    and `preloaded_adapter_ids` may be given repeated, comma-separated, or both.

    Serving the bundled demo model, the defaults bring in its family: `adapter_dir` defaults to the bundled
    demo adapters, `adapter_source` to local (so a request's `"adapter_id": "camel-case"` needs nothing else),
    and a `speculator` that is no existing path but names a member (`draft-model`, `mlp-speculator`, `medusa`)
    is that member's directory. Elsewhere `adapter_source` defaults to hub.
    """
    resolved_id, model_dir = resolve_model(model_id)
    demo = is_demo_model(model_dir)
    adapter_dirs = split_list(adapter_dir)
    if demo and not adapter_dirs and DEMO_ADAPTERS_DIR.is_dir():
        adapter_dirs = (str(DEMO_ADAPTERS_DIR),)
    if adapter_source is None:
        adapter_source = "local" if demo else "hub"
    if demo and speculator:
        speculator = demo_family_member(speculator)
    count = count_cuda_devices or _count_cuda_devices
    if device is None:
        device = "cuda" if count() > 0 else "cpu"
    elif device == "cuda":
        _check_cuda(count(), num_shard // int(settings.get("nnodes", 1)))  # type: ignore[call-overload]
    if dtype is None:
        dtype = "bfloat16" if device == "cuda" else "float32"
    max_positions = read_max_positions(model_dir) if model_dir is not None else None
    given = dict(max_input_tokens=max_input_tokens, max_total_tokens=max_total_tokens,
                 max_batch_prefill_tokens=max_batch_prefill_tokens)
    max_input_tokens, max_total_tokens, max_batch_prefill_tokens = derive_token_limits(
        max_positions, max_input_tokens, max_total_tokens, max_batch_prefill_tokens, max_batch_total_tokens,
        speculative_tokens)
    return LauncherConfig(
        model_id=resolved_id, dtype=dtype, device=device, num_shard=num_shard, max_input_tokens=max_input_tokens,
        max_total_tokens=max_total_tokens, max_batch_prefill_tokens=max_batch_prefill_tokens,
        max_batch_total_tokens=max_batch_total_tokens, speculative_tokens=speculative_tokens,
        cors_allow_origin=tuple(cors_allow_origin or ()), log_level=log_level.upper(),
        adapter_dir=adapter_dirs, adapter_source=adapter_source, speculator=speculator,
        preloaded_adapter_ids=tuple(dict.fromkeys(split_list(preloaded_adapter_ids))),  # in order, once each
        given_limits=tuple(name for name, value in given.items() if value is not None),
        **settings,  # type: ignore[arg-type]
    )


def split_list(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """A list flag given repeated, comma-separated or both: ["a,b", "c"] -> ("a", "b", "c")."""
    return tuple(part.strip() for value in values or () for part in value.split(",") if part.strip())


def resolve_model(model_id: str | None) -> tuple[str, Path | None]:
    """Returns the id to pass on and, for a local model, its directory; None means the bundled demo model."""
    if model_id is None:
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise ValueError(f"the bundled demo model is missing from {DEMO_MODEL_DIR}; rebuild it with "
                             f"`python scripts/build_demo_model.py` or pass --model-id")
        return str(DEMO_MODEL_DIR), DEMO_MODEL_DIR
    path = Path(model_id).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return model_id, gguf_model_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model-id {model_id}: the directory has no config.json")
        return str(path), path
    if path.exists():
        raise ValueError(f"--model-id {model_id}: expected a model directory, a .gguf file or a Hub id, found "
                         f"another file")
    if model_id.startswith(("/", "./", "../", "~")):
        raise ValueError(f"--model-id {model_id}: no such {'file' if model_id.endswith('.gguf') else 'directory'}")
    return model_id, None


def gguf_model_dir(path: Path) -> Path:
    """A local GGUF file, checked (architecture, tensor types, a whole file) and its metadata written as a model
    directory before any shard starts; a file Specula cannot serve is a ValueError naming it and the reason."""
    from specula_server.gguf_checkpoint import GGUFError  # imported here: only GGUF models need numpy and gguf
    from specula_server.gguf_metadata import model_directory

    try:
        return model_directory(path)
    except GGUFError as error:
        raise ValueError(f"--model-id: {error}") from error


def is_demo_model(model_dir: Path | None) -> bool:
    """Whether `model_dir` is the bundled demo model's directory."""
    if model_dir is None:
        return False
    try:
        return model_dir.resolve() == DEMO_MODEL_DIR.resolve()
    except OSError:
        return False


def demo_family_member(speculator: str) -> str:
    """`speculator` unchanged when it is an existing path, else the bundled demo family member of that name
    (`draft-model`, `mlp-speculator`, `medusa`) when there is one, else unchanged (e.g. a Hub id)."""
    if Path(speculator).expanduser().exists() or "/" in speculator:
        return speculator
    member = DEMO_ADAPTERS_DIR / speculator
    return str(member) if (member / "config.json").is_file() else speculator


def read_max_positions(model_dir: Path) -> int | None:
    """The model's position limit from its config.json, or None when it declares none."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    for key in POSITION_KEYS:
        if isinstance(raw.get(key), int):
            return raw[key]
    return None


def derive_token_limits(
    max_positions: int | None,
    max_input_tokens: int | None,
    max_total_tokens: int | None,
    max_batch_prefill_tokens: int | None,
    max_batch_total_tokens: int | None = None,
    speculative_tokens: int = 0,
) -> tuple[int | None, int | None, int | None]:
    """Fills (max_input_tokens, max_total_tokens, max_batch_prefill_tokens) that were not given.

    With a known position limit P both sequence limits are always set: total defaults to P - speculative_tokens,
    raised to one more than an explicit input limit; input defaults to total - 1; and total + speculative_tokens
    must fit in P. The prefill budget defaults to min(input + 50, 4096), capped by an explicit batch budget.
    Example, P = 2048, only `--max-input-tokens 3000`: total becomes 3001, and the error names the model's limit
    rather than a flag the user never set.
    """
    if max_positions is not None:
        if speculative_tokens >= max_positions - 1:
            raise ValueError(f"--speculative-tokens ({speculative_tokens}) leaves no room for a request in the "
                             f"model's {max_positions} positions")
        if max_total_tokens is None:
            max_total_tokens = max_positions - speculative_tokens
            if max_batch_total_tokens is not None:  # the batch's KV budget, which the router fits to
                max_total_tokens = min(max_total_tokens, max_batch_total_tokens - speculative_tokens)
            if max_input_tokens is not None:
                max_total_tokens = max(max_total_tokens, max_input_tokens + 1)
        if max_input_tokens is None:
            max_input_tokens = max_total_tokens - 1
        if max_total_tokens + speculative_tokens > max_positions:
            raise ValueError(f"--max-total-tokens ({max_total_tokens}) + --speculative-tokens ({speculative_tokens}) "
                             f"exceeds the model's max_position_embeddings ({max_positions}); lower "
                             f"--max-total-tokens or --max-input-tokens")
    if max_batch_prefill_tokens is None and max_input_tokens is not None:
        max_batch_prefill_tokens = min(max_input_tokens + PREFILL_TOKENS_HEADROOM, DEFAULT_PREFILL_CAP)
        if max_batch_total_tokens is not None:
            max_batch_prefill_tokens = min(max_batch_prefill_tokens, max_batch_total_tokens)
    return max_input_tokens, max_total_tokens, max_batch_prefill_tokens


def _check_cuda(num_devices: int, num_shard: int) -> None:
    if num_devices == 0:
        raise ValueError("--device cuda, but torch sees no CUDA device")
    if num_shard > num_devices:
        raise ValueError(f"--num-shard {num_shard} needs one GPU per shard; torch sees {num_devices}")


def _count_cuda_devices() -> int:
    import torch  # imported here: loading torch takes a second and most of the launcher never needs it

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
