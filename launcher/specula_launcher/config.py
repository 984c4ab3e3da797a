"""The launcher's configuration: one frozen `LauncherConfig`, built once from the command line and environment.

`build_config` (defaults.py) is the only place that fills in derived defaults (the bundled demo model, the device,
the dtype and the token limits read from the model's `config.json`); `LauncherConfig.__post_init__` checks every
value and every relation between values, so a config that exists is a valid one. Errors are `ValueError`s that
name the command-line flag, e.g. "--max-input-tokens (4096) must be less than --max-total-tokens (4096)".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from specula_proto.choices import (
    AdapterSource,
    Device,
    Dtype,
    KVCacheDtype,
    LogLevel,
    NgramMatch,
    QuantizeMethod,
    SpeculationMode,
    StrEnum,
    parse_choice,
    quantize_method,
    speculator_quantize_method,
)
from specula_proto.setting import Process
from specula_proto.settings import check_bounds

INT4_GROUP_SIZES = (32, 64, 128, 256)

# The token limits the router derives itself when the user sets none (see defaults.py).
TOKEN_LIMITS = ("max_input_tokens", "max_total_tokens", "max_batch_prefill_tokens")
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
    dtype: Dtype
    device: Device
    quantize: QuantizeMethod | None = None  # weight-only quantization of the linear layers; None: float weights
    quantize_group_size: int = 64  # int4: inputs per scale and zero
    kv_cache_dtype: KVCacheDtype | None = None  # what the shards' KV cache stores; None: theirs (auto)
    cuda_graphs: str | None = None  # batch sizes captured as CUDA graphs, "1,2,4" ("0": none); None: the shards'
    revision: str | None = None
    num_shard: int = 1
    port: int = 3000
    hostname: str = "0.0.0.0"
    speculative_tokens: int = 0
    speculation_mode: SpeculationMode = SpeculationMode.ADAPTIVE
    ngram_min: int = 1
    ngram_max: int = 3
    ngram_match: NgramMatch = NgramMatch.LATEST
    speculator: str | None = None
    suffix_cache_tokens: int = 100_000  # --speculator suffix: output tokens the global suffix trees keep
    speculator_quantize: str | None = None  # int8 or int4: an EAGLE-3 speculator's products
    draft_tree_width: int = 1
    adapter_source: AdapterSource = AdapterSource.HUB
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
    num_scheduler_steps: int = 4  # decode steps the workers may run per Step call (the router's)
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
    log_level: LogLevel = LogLevel.INFO
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
        for name, choices in (("speculation_mode", SpeculationMode), ("ngram_match", NgramMatch),
                              ("adapter_source", AdapterSource)):  # the members, from the flags' strings
            object.__setattr__(self, name, parse_choice(choices, getattr(self, name), "--" + name.replace("_", "-")))
        _check_choices(self)
        _check_ranges(self)
        _check_token_relations(self)

    @property
    def local_ranks(self) -> range:
        """The global ranks of the shards this launcher runs: `num_shard / nnodes` of them, by node."""
        per_node = self.num_shard // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def no_prefix_caching(self) -> bool:
        """--no-prefix-caching, the flag the children take (prefix caching is on unless it is given)."""
        return not self.prefix_caching

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
    _set_choice(c, "dtype", Dtype)
    _set_choice(c, "device", Device)
    if c.quantize is not None:
        object.__setattr__(c, "quantize", quantize_method(c.quantize))
    if c.quantize == "gguf" and not c.model_id.lower().endswith(".gguf"):
        raise ValueError(f"--quantize gguf serves a GGUF file's own blocks; --model-id {c.model_id} is not a .gguf "
                         "file (for a float checkpoint use --quantize int8 or int4)")
    if c.speculator_quantize is not None:
        object.__setattr__(c, "speculator_quantize", speculator_quantize_method(c.speculator_quantize, c.speculator))
    if c.quantize_group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"--quantize-group-size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}; "
                         f"got {c.quantize_group_size}")
    if c.kv_cache_dtype is not None:
        _set_choice(c, "kv_cache_dtype", KVCacheDtype)
    if c.cuda_graphs is not None and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", c.cuda_graphs):
        raise ValueError(f"--cuda-graphs takes batch sizes separated by commas, or 0 for none; got {c.cuda_graphs!r}")
    if c.api_key is not None and not c.api_key.strip():
        raise ValueError("--api-key (env API_KEY) must not be empty or blank")
    _set_choice(c, "log_level", LogLevel)
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


def _set_choice(c: LauncherConfig, name: str, choices: type[StrEnum]) -> None:
    """Field `name` as its member of `choices` (a ValueError naming the flag and the choices otherwise)."""
    object.__setattr__(c, name, parse_choice(choices, getattr(c, name), "--" + name.replace("_", "-")))


def _check_ranges(c: LauncherConfig) -> None:
    check_bounds(c, Process.LAUNCHER)  # the settings table's
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

