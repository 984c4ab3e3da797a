"""Loading a model worker and serving it over gRPC on a unix socket.

`load_generator` turns a model id into a ready `TextGenerator` (resolve, read config and tokenizer, load this
rank's weight slices, build the model). `serve` runs the gRPC server; the socket appears only once the model is
loaded, which is how the launcher knows the shard is ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from specula_proto import generate_pb2_grpc
from specula_proto.choices import (
    AdapterKind,
    AdapterSource,
    Device,
    Dtype,
    NgramMatch,
    SpeculationMode,
    parse_choice,
    speculator_quantize_method,
    values,
)
from specula_server.adapters.medusa import MedusaHeads, load_medusa
from specula_server.adapters.registry import AdapterRegistry
from specula_server.adapters.sources import AdapterError, detect_adapter_kind, resolve_adapter
from specula_server.distributed import ShardGroup, init_distributed
from specula_server.generator import SpeculationConfig, TextGenerator
from specula_server.gguf_checkpoint import is_gguf
from specula_server.hub import resolve_model_dir, weight_files
from specula_server.kv_cache import parse_kv_cache_dtype
from specula_server.layers.quantization import DEFAULT_GROUP_SIZE, Quantization, check_float_checkpoint
from specula_server.models import build_model
from specula_server.models.config import ModelConfig
from specula_server.service import ExceptionInterceptor, TextGenerationService, WorkerInfo, fault_policy
from specula_server.speculation.draft_model import DraftModelDrafter, find_draft_model, load_draft_model
from specula_server.speculation.drafters import PromptLookupDrafter
from specula_server.speculation.eagle3_checkpoint import find_eagle3, load_eagle3
from specula_server.speculation.eagle3_drafter import Eagle3Drafter
from specula_server.speculation.medusa import MedusaDrafter
from specula_server.speculation.mlp_speculator import MLPSpeculator, MLPSpeculatorDrafter
from specula_server.speculation.mlp_speculator_checkpoint import find_mlp_speculator, load_mlp_speculator
from specula_server.speculation.suffix import DEFAULT_CACHE_TOKENS, SUFFIX, SuffixDrafter
from specula_server.threads import worker_threads
from specula_server.tokens import eos_token_ids, load_tokenizer
from specula_server.weights import Weights

logger = logging.getLogger("specula.server")

# Each --dtype value (specula_proto.choices.Dtype) -> torch's dtype of that name.
DTYPES: dict[Dtype, torch.dtype] = {dtype: getattr(torch, dtype) for dtype in Dtype}


@dataclass(frozen=True)
class ServerConfig:
    """Everything a worker process needs, built once from the command line."""

    model_id: str
    uds_path: str
    revision: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory: int | None = None
    hub_cache: Path | None = None
    rank: int = 0
    world_size: int = 1
    master_addr: str = "localhost"
    master_port: int = 29500
    speculative_tokens: int = 0
    speculation_mode: SpeculationMode = SpeculationMode.ADAPTIVE
    ngram_min: int = 1
    ngram_max: int = 3
    ngram_match: NgramMatch = NgramMatch.LATEST
    adapter_dirs: tuple[Path, ...] = ()  # where `local` adapters may be read from
    max_active_adapters: int = 8
    speculator: str | None = None  # Medusa heads or an MLP speculator for every request: a directory or Hub id
    draft_tree_width: int = 1  # candidates per Medusa head / MLP speculator stage (1: the top-1 chain only)
    speculator_quantize: str | None = None  # an EAGLE-3 speculator's products: int8, int4 or None (its dtype)
    instance_id: str = ""  # the launcher run this shard belongs to (reported in Info); "" when started alone
    quantize: str | None = None  # quantization of the linear layers: int8, int4, w8a8, gguf or None (float)
    quantize_group_size: int = DEFAULT_GROUP_SIZE  # int4: inputs per scale and zero
    # What the KV cache stores keys and values in: auto (the compute dtype), bfloat16, float16, fp8 / fp8_e4m3
    # (float8_e4m3fn) or fp8_e5m2 (specula_proto.choices.KVCacheDtype)
    kv_cache_dtype: str = "auto"
    # Batch sizes whose decode and verification steps replay CUDA graphs (--cuda-graphs; None: the defaults,
    # empty: none): see specula_kernels.cuda_graphs
    cuda_graphs: tuple[int, ...] | None = None
    suffix_cache_tokens: int = DEFAULT_CACHE_TOKENS  # `--speculator suffix`: output tokens the global trees hold
    local_rank: int | None = None  # rank on this node, the GPU index (None: `rank`, one node)
    grpc_host: str | None = None  # also serve TCP on this address, the one the router is given (other nodes)

    def __post_init__(self) -> None:
        quantization = Quantization.parse(self.quantize, self.quantize_group_size)  # a ValueError naming the flag
        if quantization is not None and quantization.method == "gguf" and not is_gguf(self.model_id):
            raise ValueError(f"--quantize gguf serves a GGUF file's own blocks; --model-id {self.model_id} is not a "
                             ".gguf file (for a float checkpoint use --quantize int8 or int4)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(values(Dtype))}, got {self.dtype!r}")
        parse_kv_cache_dtype(self.kv_cache_dtype, DTYPES[self.dtype])  # a ValueError naming the flag
        if self.device not in values(Device):
            raise ValueError(f"device must be {' or '.join(map(repr, values(Device)))}, got {self.device!r}")
        if self.block_size < 1:
            raise ValueError("block_size must be positive")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        object.__setattr__(self, "speculation_mode", parse_choice(SpeculationMode, self.speculation_mode,
                                                                  "--speculation-mode"))
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min ({self.ngram_min}) <= ngram_max ({self.ngram_max})")
        object.__setattr__(self, "ngram_match", parse_choice(NgramMatch, self.ngram_match, "--ngram-match"))
        if self.speculator_quantize is not None:
            object.__setattr__(self, "speculator_quantize",
                               speculator_quantize_method(self.speculator_quantize, self.speculator))
        if self.draft_tree_width < 1:
            raise ValueError(f"draft tree width must be at least 1, got {self.draft_tree_width}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix cache tokens must not be negative, got {self.suffix_cache_tokens}")
        if self.cuda_graphs is not None and any(size < 1 for size in self.cuda_graphs):
            raise ValueError(f"cuda graphs batch sizes must be positive, got {list(self.cuda_graphs)}")
        if self.max_active_adapters < 1:
            raise ValueError(f"max_active_adapters must be at least 1, got {self.max_active_adapters}")

    @property
    def quantization(self) -> Quantization | None:
        return Quantization.parse(self.quantize, self.quantize_group_size)

    @property
    def torch_device(self) -> torch.device:
        local_rank = self.rank if self.local_rank is None else self.local_rank
        return torch.device("cuda", local_rank) if self.device == "cuda" else torch.device("cpu")

    def uds_url(self, rank: int) -> str:
        return f"unix://{self.uds_path}-{rank}"


def parse_cuda_graphs(value: str | None) -> tuple[int, ...] | None:
    """`--cuda-graphs` as TGI reads it: batch sizes separated by commas, `0` for none; None: the defaults.

    >>> parse_cuda_graphs("1,2,4,8"), parse_cuda_graphs("0"), parse_cuda_graphs(None)
    ((1, 2, 4, 8), (), None)
    """
    if value is None:
        return None
    try:
        sizes = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--cuda-graphs takes batch sizes separated by commas, or 0 for none; got {value!r}") from None
    return () if sizes == (0,) else sizes


def load_generator(config: ServerConfig, group: ShardGroup) -> tuple[TextGenerator, str]:
    """Loads this rank's part of the model; returns the generator and the model's Hub commit (or "")."""
    if group.rank == 0:
        model_dir = resolve_model_dir(config.model_id, config.revision, config.hub_cache)
    group.barrier()  # rank 0 downloads; the others then find the files in the cache
    if group.rank != 0:
        model_dir = resolve_model_dir(config.model_id, config.revision, config.hub_cache)
    model_config = ModelConfig.from_dir(model_dir)
    device, dtype = config.torch_device, DTYPES[config.dtype]
    weights = Weights(weight_files(model_dir), device, dtype, rank=group.rank, world_size=group.world_size,
                      quantization=config.quantization)
    check_float_checkpoint(json.loads((model_dir / "config.json").read_text()), weights.names())
    logger.info("loading %s (%s) on %s as %s%s, shard %d/%d", config.model_id, model_config.architecture,
                device, config.dtype, f" with {config.quantize} weights" if config.quantize else "", group.rank,
                group.world_size)
    model = build_model(model_config, weights, group)
    tokenizer = load_tokenizer(model_dir)
    raw_config = {"eos_token_id": list(model_config.eos_token_ids)}
    eos_ids = eos_token_ids(model_dir, raw_config)
    adapters = AdapterRegistry(model_config, rank=group.rank, world_size=group.world_size, dtype=dtype,
                               device=device, max_active=config.max_active_adapters,
                               local_roots=config.adapter_dirs, hub_cache=config.hub_cache)
    speculation = None
    if config.speculative_tokens > 0:
        lookup = PromptLookupDrafter(config.ngram_min, config.ngram_max, config.ngram_match)
        if config.speculator == SUFFIX:  # a reserved name: a directory called `suffix` is `./suffix`
            speculator, fallback = None, SuffixDrafter(lookup, cache_tokens=config.suffix_cache_tokens)
        else:
            speculator = load_speculator(config, model_config, dtype, device, group=group, tokenizer=tokenizer,
                                         eos_ids=eos_ids, target=model)
            fallback = lookup
        drafter = build_drafter(model, adapters, fallback, speculator, config.draft_tree_width)
        on_demand = speculator if isinstance(speculator, (DraftModelDrafter, Eagle3Drafter)) else None
        speculation = SpeculationConfig(drafter, config.speculative_tokens, config.speculation_mode,
                                        draft_model=on_demand)
    kv_cache_dtype = parse_kv_cache_dtype(config.kv_cache_dtype, dtype)
    if kv_cache_dtype != dtype:
        logger.info("KV cache stored as %s (--kv-cache-dtype %s), computed in %s", kv_cache_dtype,
                    config.kv_cache_dtype, dtype)
    generator = TextGenerator(model, tokenizer, eos_ids, config.block_size, device, speculation, adapters,
                              group, kv_cache_dtype=kv_cache_dtype, cuda_graphs=config.cuda_graphs)
    sha = model_dir.name if "snapshots" in model_dir.parts else ""
    return generator, sha


def load_speculator(config: ServerConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                    group: ShardGroup = ShardGroup(), tokenizer=None,
                    eos_ids: frozenset[int] = frozenset(), target=None,
                    ) -> MedusaHeads | MLPSpeculator | DraftModelDrafter | Eagle3Drafter | None:
    """The `--speculator` (a local directory or a Hub id): Medusa heads, an MLP speculator (`config.json` with
    `model_type: mlp_speculator`), an EAGLE-3 speculator (`speculators_model_type: eagle3`, whose verifier must
    be the served model; it uses the `target` model's embedding when it has none) or a draft model (a causal LM
    the server loads, with the target's `tokenizer`: checked before its weights are read, then loaded sharded
    over `group` like the target), checked against the model. Anything else is refused."""
    if not config.speculator:
        return None
    accepted = ("--speculator serves Medusa heads, an MLP speculator (config.json with model_type mlp_speculator), "
                "an EAGLE-3 speculator (speculators_model_type eagle3) or a draft model (a causal LM with the "
                "model's tokenizer)")
    eagle_path = find_eagle3(config.speculator, config.hub_cache)
    if eagle_path is not None:
        eagle = load_eagle3(eagle_path, config.model_id, model_config,
                            target.embed_tokens if target is not None else None, dtype=dtype, device=device,
                            speculator_id=config.speculator,
                            quantization=Quantization.parse(config.speculator_quantize, config.quantize_group_size,
                                                            "--speculator-quantize"))
        return Eagle3Drafter(eagle, device, config.speculator, config.draft_tree_width)
    if config.speculator_quantize is not None:
        raise ValueError(f"--speculator-quantize quantizes an EAGLE-3 speculator; {config.speculator} is not one")
    mlp_path = find_mlp_speculator(config.speculator, config.hub_cache)
    if mlp_path is not None:
        return load_mlp_speculator(mlp_path, model_config, dtype=dtype, device=device,
                                   speculator_id=config.speculator)
    draft_path = find_draft_model(config.speculator, config.hub_cache)
    if draft_path is not None:  # a causal LM with the model's tokenizer (`tokenizer`, needed here)
        return load_draft_model(draft_path, config.speculator, config.model_id, model_config, tokenizer, eos_ids,
                                dtype, device, group)
    try:
        if Path(config.speculator).is_dir():
            path = Path(config.speculator)
        else:
            path = resolve_adapter(config.speculator, AdapterSource.HUB, local_roots=(), cache_dir=config.hub_cache)
        kind = detect_adapter_kind(path, config.speculator)
    except AdapterError as error:
        raise ValueError(f"--speculator {config.speculator}: {error}; {accepted}") from error
    if kind != AdapterKind.MEDUSA:
        raise ValueError(f"--speculator {config.speculator}: a {kind} adapter; {accepted} "
                         "(LoRA adapters are chosen per request with adapter_id)")
    return load_medusa(path, model_config, dtype=dtype, device=device, adapter_id=config.speculator)


def build_drafter(model, adapters: AdapterRegistry, fallback: PromptLookupDrafter | SuffixDrafter,
                  speculator: MedusaHeads | MLPSpeculator | None, tree_width: int) -> MedusaDrafter:
    """Per request: its adapter's Medusa heads, else the server's speculator, else `fallback` (prompt lookup, or
    suffix decoding with prompt lookup behind it)."""
    if isinstance(speculator, (DraftModelDrafter, Eagle3Drafter)):  # for requests without Medusa heads of their own
        return MedusaDrafter(lambda request: adapters.medusa_heads(request.spec.adapter_id), model.compute_logits,
                             speculator, tree_width)
    if isinstance(speculator, MLPSpeculator):  # drafts for every request without Medusa heads of its own
        return MedusaDrafter(lambda request: adapters.medusa_heads(request.spec.adapter_id), model.compute_logits,
                             MLPSpeculatorDrafter(speculator, fallback, tree_width), tree_width)

    def heads_for(request):
        own = adapters.medusa_heads(request.spec.adapter_id)
        return own if own is not None else speculator

    return MedusaDrafter(heads_for, model.compute_logits, fallback, tree_width,
                         name="medusa" if speculator is not None else None)


async def serve(config: ServerConfig) -> int:
    """Serves until SIGINT/SIGTERM (exit code 0) or an unrecoverable error (exit code 1)."""
    compute = worker_threads(asyncio.get_running_loop())  # the model computes on this thread alone (threads.py)
    group = init_distributed(config.rank, config.world_size, config.master_addr, config.master_port,
                             config.torch_device)
    tcp_port = free_tcp_port(config.grpc_host) if config.grpc_host else None
    own_url = f"{config.grpc_host}:{tcp_port}" if tcp_port else config.uds_url(config.rank)
    urls = group.all_gather_object(own_url)  # shards on other nodes are reached over TCP, the others by socket
    generator, sha = await asyncio.get_running_loop().run_in_executor(compute, load_generator, config, group)
    info = WorkerInfo(
        model_id=config.model_id,
        model_sha=sha,
        device=config.torch_device,
        world_size=config.world_size,
        uds_urls=tuple(urls),
        kv_cache_memory=config.kv_cache_memory,
        instance_id=config.instance_id,
        quantize=config.quantization.method if config.quantization else "",
    )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    failures: list[BaseException] = []

    def on_fatal(error: BaseException) -> None:
        logger.error("unrecoverable error, stopping the shard: %s", error)
        failures.append(error)
        loop.call_soon_threadsafe(stop.set)

    server = grpc.aio.server(interceptors=[ExceptionInterceptor(on_fatal, fault_policy(info))])
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(TextGenerationService(generator, info, compute),
                                                              server)
    socket_path = f"{config.uds_path}-{config.rank}"
    if is_live_socket(socket_path):  # never take over another server's socket: its router would reach us
        logger.error("%s is in use by another process (a live socket); choose another --uds-path", socket_path)
        return 1
    if os.path.lexists(socket_path):  # stale: its server was killed before it could remove it
        if not stat.S_ISSOCK(os.lstat(socket_path).st_mode):  # a file a mistyped flag names: never delete it
            logger.error("%s exists and is not a socket; choose another --uds-path", socket_path)
            return 1
        os.unlink(socket_path)
    server.add_insecure_port(config.uds_url(config.rank))
    if tcp_port:
        server.add_insecure_port(own_url)
    await server.start()
    logger.info("shard %d ready on %s", config.rank, socket_path)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=5)
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    return 1 if failures else 0


def free_tcp_port(host: str) -> int:
    """A port nothing listens on at `host` right now (the shard binds it a moment later, a race we accept)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def is_live_socket(path: str) -> bool:
    """Whether a process accepts connections on the unix socket `path` (a killed server's file refuses them)."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError, NotADirectoryError):
            return False
        except OSError:
            return True  # a full backlog or a slow accept: someone listens
        return True
