"""`specula-server`: the model worker command line (one process per tensor-parallel shard).

The launcher starts one `specula-server serve` per shard with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in the environment. Every option also reads an environment variable.
"""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import typer

app = typer.Typer(add_completion=False, help="Specula model worker (one process per tensor-parallel shard).")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'512MiB' -> 536870912; plain numbers are bytes."""
    m = _SIZE.match(text)
    if not m:
        raise typer.BadParameter(f"not a size: {text!r} (examples: 4GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


@app.callback()
def main() -> None:
    """Specula model worker."""


@app.command()
def serve(
    model_id: str = typer.Argument(..., envvar="MODEL_ID", help="Hub model id, local directory or GGUF file."),
    uds_path: str = typer.Option("/tmp/specula-server", envvar="UDS_PATH",
                                 help="Unix socket path prefix; shard r listens on PATH-r."),
    revision: str | None = typer.Option(None, envvar="REVISION", help="Hub revision (branch, tag or commit)."),
    dtype: str = typer.Option("float32", envvar="DTYPE", help="float32, bfloat16 or float16."),
    quantize: str | None = typer.Option(
        None, envvar="QUANTIZE",
        help="Weight-only quantization of the linear layers: int8 (a scale per output channel) or int4 (a scale "
             "and zero per group of inputs), done by each shard at load time from the float checkpoint; or gguf, for "
             "a .gguf model: its Q8_0, Q4_0 and Q4_1 tensors served as the file holds them (other types as float). "
             "Default: none."),
    quantize_group_size: int = typer.Option(64, envvar="QUANTIZE_GROUP_SIZE",
                                            help="int4: inputs per scale and zero (32, 64, 128 or 256)."),
    kv_cache_dtype: str = typer.Option(
        "auto", envvar="KV_CACHE_DTYPE",
        help="What the KV cache stores keys and values in: auto (the --dtype), bfloat16, float16, fp8 or "
             "fp8_e4m3 (float8 e4m3fn, also fp8_e4m3fn), fp8_e5m2. Storage only (converted on write and read, fp8 "
             "with a scale of 1.0): a narrower cache holds more blocks in --kv-cache-memory."),
    device: str = typer.Option("cpu", envvar="DEVICE", help="cpu or cuda."),
    block_size: int = typer.Option(16, envvar="BLOCK_SIZE", help="Tokens per KV cache block."),
    kv_cache_memory: str | None = typer.Option(
        None, envvar="KV_CACHE_MEMORY",
        help="KV cache size, e.g. 2GiB. Default: 1GiB on CPU, 90% of free memory after warmup on CUDA."),
    huggingface_hub_cache: Path | None = typer.Option(None, envvar="HUGGINGFACE_HUB_CACHE",
                                                         help="Hub cache directory."),
    rank: int = typer.Option(0, envvar="RANK", help="This shard's rank."),
    world_size: int = typer.Option(1, envvar="WORLD_SIZE", help="Number of shards."),
    master_addr: str = typer.Option("localhost", envvar="MASTER_ADDR", help="torch.distributed address."),
    master_port: int = typer.Option(29500, envvar="MASTER_PORT", help="torch.distributed port."),
    speculative_tokens: int = typer.Option(0, envvar="SPECULATIVE_TOKENS", min=0,
                                           help="Most draft tokens verified per request per step (0: off)."),
    speculation_mode: str = typer.Option("adaptive", envvar="SPECULATION_MODE",
                                         help="adaptive (draft lengths follow acceptance and load) or fixed."),
    ngram_min: int = typer.Option(1, envvar="NGRAM_MIN", min=1, help="Shortest n-gram prompt lookup matches."),
    ngram_max: int = typer.Option(3, envvar="NGRAM_MAX", min=1, help="Longest n-gram prompt lookup matches."),
    ngram_match: str = typer.Option("latest", envvar="NGRAM_MATCH",
                                    help="Which earlier occurrence drafts: latest or earliest."),
    speculator: str | None = typer.Option(
        None, envvar="SPECULATOR",
        help="Medusa heads, an MLP speculator, an EAGLE-3 speculator (`speculators` or original layout, for this "
             "model) or a draft model (a small causal LM with the model's tokenizer): "
             "directory or Hub id, drafting for every request that has no Medusa heads of its own."),
    draft_tree_width: int = typer.Option(
        1, envvar="DRAFT_TREE_WIDTH", min=1,
        help="Candidates per Medusa head, MLP speculator stage or EAGLE-3 depth: 1 verifies the top-1 chain, "
             "more verify a tree of the best nodes."),
    adapter_dir: list[Path] = typer.Option(
        [], envvar="ADAPTER_DIR",
        help="Directory whose subdirectories are the `local` adapters requests may name (repeatable)."),
    max_active_adapters: int = typer.Option(8, envvar="MAX_ACTIVE_ADAPTERS", min=1,
                                            help="Adapters loaded at once (slots of the LoRA stacks)."),
    cuda_graphs: str | None = typer.Option(
        None, envvar="CUDA_GRAPHS",
        help="Batch sizes whose decode and verification steps are captured as CUDA graphs, separated by commas "
             "(0: none). Default: 1, 2, 4, then multiples of 8 up to 128. CUDA only, one shard, with triton."),
    log_level: str = typer.Option("INFO", envvar="LOG_LEVEL", help="Python logging level."),
    suffix_cache_tokens: int = typer.Option(
        100_000, envvar="SUFFIX_CACHE_TOKENS", min=0,
        help="With --speculator suffix: output tokens of finished requests the global suffix trees keep for "
             "drafting (per shard, all adapters together; the oldest request's leave first)."),
    local_rank: int | None = typer.Option(
        None, envvar="LOCAL_RANK", min=0,
        help="This shard's rank on its node, the index of its GPU (default: --rank; set per node when the group "
             "spans several nodes)."),
    grpc_host: str | None = typer.Option(
        None, envvar="GRPC_HOST",
        help="Also serve gRPC over TCP on this address (a free port), and give that address to the router: for "
             "shards on a node without the router (multi-node tensor parallelism)."),
    instance_id: str = typer.Option(
        "", envvar="SPECULA_INSTANCE_ID",
        help="Id of the launcher run this shard belongs to, reported in Info; a router given another id refuses "
             "the shard. Empty when started alone."),
) -> None:
    """Load a model shard and serve it over gRPC on a unix socket."""
    from specula_server.server import ServerConfig, parse_cuda_graphs
    from specula_server.server import serve as serve_async

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    memory = parse_size(kv_cache_memory) if kv_cache_memory else (2**30 if device == "cpu" else None)
    try:
        config = ServerConfig(
            model_id=model_id, uds_path=uds_path, revision=revision, dtype=dtype, device=device,
            block_size=block_size, kv_cache_memory=memory, hub_cache=huggingface_hub_cache, rank=rank,
            world_size=world_size, master_addr=master_addr, master_port=master_port,
            speculative_tokens=speculative_tokens, speculation_mode=speculation_mode, ngram_min=ngram_min,
            ngram_max=ngram_max, ngram_match=ngram_match, adapter_dirs=tuple(adapter_dir),
            max_active_adapters=max_active_adapters, speculator=speculator, draft_tree_width=draft_tree_width,
            instance_id=instance_id, quantize=quantize, quantize_group_size=quantize_group_size,
            kv_cache_dtype=kv_cache_dtype, cuda_graphs=parse_cuda_graphs(cuda_graphs),
            local_rank=local_rank, grpc_host=grpc_host, suffix_cache_tokens=suffix_cache_tokens,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    raise typer.Exit(asyncio.run(serve_async(config)))


if __name__ == "__main__":
    app()
