"""`specula-server`: the model worker command line (one process per tensor-parallel shard).

The launcher starts one `specula-server serve` per shard with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
in the environment. Every option also reads an environment variable; the options are the worker's rows of the
settings table (specula_proto/settings.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import typer

from specula_proto.setting import Process
from specula_proto.settings import with_settings

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
@with_settings(Process.WORKER)
def serve(**settings: Any) -> None:
    """Load a model shard and serve it over gRPC on a unix socket."""
    from specula_server.server import ServerConfig, parse_cuda_graphs
    from specula_server.server import serve as serve_async

    logging.basicConfig(level=settings.pop("log_level").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    memory = settings["kv_cache_memory"]
    default_memory = 2**30 if settings["device"] == "cpu" else None
    try:  # every other setting is the ServerConfig field of the same name
        settings.update(kv_cache_memory=parse_size(memory) if memory else default_memory,
                        cuda_graphs=parse_cuda_graphs(settings["cuda_graphs"]),
                        hub_cache=settings.pop("huggingface_hub_cache"),
                        adapter_dirs=tuple(settings.pop("adapter_dir")))
        config = ServerConfig(**settings)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    raise typer.Exit(asyncio.run(serve_async(config)))


if __name__ == "__main__":
    app()
