"""`specula-router`: the HTTP front of a Specula deployment (started by `specula-launcher`).

The Typer command; its options, each of which also reads an environment variable, are the router's rows of the
settings table (specula_proto/settings.py). The flags become one `RouterConfig` (config.py) and startup
(startup.py: shards, token limits, Warmup, adapters, HTTP) runs it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import typer

from specula_proto.setting import Process
from specula_proto.settings import with_settings
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
@with_settings(Process.ROUTER)
def main(**settings: Any) -> None:
    """Serve the HTTP API in front of running model shards."""
    _setup_logging(settings.pop("log_level"), settings["json_output"])
    settings.update(prefix_caching=not settings.pop("no_prefix_caching"),  # every other setting is the field's own
                    preloaded_adapter_ids=split_ids(settings["preloaded_adapter_ids"]),
                    adapter_dir=split_ids(settings["adapter_dir"]),
                    cors_allow_origin=tuple(settings["cors_allow_origin"]))
    try:
        config = RouterConfig(**settings)
        code = asyncio.run(run(config))
    except ValueError as e:
        logger.error("%s", e)
        raise typer.Exit(2) from e
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
