"""`specula-launcher`: one command that starts the model shards and the router and supervises them.

    specula-launcher --model-id meta-llama/Llama-3.1-8B-Instruct --num-shard 2 --speculative-tokens 3

Every flag also reads an environment variable (MODEL_ID, NUM_SHARD, PORT, ...), as in TGI and LoRAX; the flags
are the launcher's rows of the settings table (specula_proto/settings.py), which also declares the router's and
the workers'. They are turned into one `LauncherConfig` (config.py), the run's own socket path, torch.distributed
port and instance id are claimed (endpoints.py), the children's command lines are built from it (commands.py),
and the `Supervisor` (processes.py) runs them until SIGINT/SIGTERM or a child fails.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

import typer

from specula_launcher.commands import router_spec, shard_sockets, shard_specs
from specula_launcher.compat import UnknownArgument, check_foreign
from specula_launcher.config import LauncherConfig
from specula_launcher.defaults import build_config
from specula_launcher.endpoints import claim_endpoints
from specula_launcher.processes import LAUNCHER, LogSink, Supervisor, run_with_signal_handlers
from specula_proto.setting import Process
from specula_proto.settings import with_settings

app = typer.Typer(add_completion=False, help="Start the Specula model shards and router, and supervise them.")

# The router drains in-flight requests for up to --shutdown-timeout itself; this is its time to close after.
ROUTER_CLOSE_GRACE_S = 5.0
# Shards hold no client state: they stop at once on SIGTERM (the gRPC server's own grace is 5 s).
SHARD_STOP_TIMEOUT_S = 10.0


@app.command(context_settings={
    # Arguments the CLI does not know reach `main` in ctx.args, where compat.check_foreign refuses or warns about
    # TGI/LoRAX flags by name; anything else is still a "No such option" usage error.
    "ignore_unknown_options": True, "allow_extra_args": True})
@with_settings(Process.LAUNCHER)
def main(ctx: typer.Context, **settings: Any) -> None:
    """Start the model shards, wait until each is ready, start the router, and supervise them."""
    try:
        warnings = check_foreign(ctx.args, os.environ)
    except UnknownArgument as e:
        ctx.fail(f"No such option: {e.argument}" if e.argument.startswith("-") else
                 f"Got unexpected extra argument ({e.argument})")
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    sink = LogSink(sys.stderr, settings["json_output"])  # the launcher's own log format, JSON lines included
    for warning in warnings:
        sink.emit(LAUNCHER, f"warning: {warning}")
    # Every setting is the LauncherConfig field of the same name, but:
    settings["prefix_caching"] = not settings.pop("no_prefix_caching")
    hub_cache = settings["huggingface_hub_cache"]
    settings["huggingface_hub_cache"] = str(hub_cache) if hub_cache else None
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
