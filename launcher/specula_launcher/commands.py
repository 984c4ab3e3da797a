"""The command lines and environments of the launcher's children, built from a `LauncherConfig`.

Shards (one per rank, identical arguments, the rank in the environment as torch.distributed expects):

    python -m specula_server.cli serve MODEL --uds-path $XDG_RUNTIME_DIR/specula-XXXXXXXX/shard
        ... every setting the launcher shares with the worker, under the same flag: --dtype float32 --device cpu
        --block-size 16 --max-active-adapters 8 [--revision R] [--adapter-dir DIR ...] [--kv-cache-memory SIZE] ...
        [--quantize Q --quantize-group-size G]
        [--speculative-tokens N --speculation-mode M --ngram-min A --ngram-max B --ngram-match W
         --draft-tree-width K [--speculator S] [--suffix-cache-tokens T]]
        --instance-id ID
    env: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOG_LEVEL (+ the launcher's own environment,
    less API_KEY); on a node other than node 0 also GRPC_HOST, the address node 0's router reaches it at

Router (connects to shard 0, which lists the others through ServiceDiscovery):

    python -m specula_router.cli --model-id MODEL --master-shard-uds-path $XDG_RUNTIME_DIR/specula-XXXXXXXX/shard-0
        --instance-id ID ... every setting the launcher shares with the router, under the same flag
        (--hostname 0.0.0.0 --port 3000 ...; see `router_command`)
    env: API_KEY when --api-key is set (+ the launcher's own environment)

The socket path, MASTER_PORT and the instance id are the ones `endpoints.claim_endpoints` chose for this run;
the router refuses any shard whose Info reports another instance id.

Which settings each child shares with the launcher is the settings table's word (specula_proto/settings.py).
Flags whose value is None are left out so the child applies its own default; boolean flags are bare.
`--max-active-adapters` goes to both: the router never asks for more adapters than the workers have slots.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from specula_launcher.config import TOKEN_LIMITS, LauncherConfig
from specula_launcher.processes import ChildSpec
from specula_proto.setting import Process
from specula_proto.settings import shared_with

# The router's (and TGI's) variable for --api-key.
API_KEY_ENV = "API_KEY"

# The settings handed to a child in its environment instead (by shard_env and router_env below).
SHARD_ENV_SETTINGS = frozenset({"master_addr", "master_port", "log_level"})
ROUTER_ENV_SETTINGS = frozenset({"api_key"})
# Shard settings that only matter with another one: int4's group size, and what drafts when speculation is on.
SPECULATION_SETTINGS = frozenset({"speculative_tokens", "speculation_mode", "ngram_min", "ngram_max", "ngram_match",
                                  "speculator", "speculator_quantize", "draft_tree_width", "suffix_cache_tokens"})


def shard_command(config: LauncherConfig) -> list[str]:
    """The worker command line; the same for every rank: every setting the launcher shares with the worker
    (specula_proto/settings.py) that has a value and matters, under the same flag."""
    assert config.shard_uds_path is not None, "the socket path is chosen at launch (endpoints.claim_endpoints)"
    argv = [sys.executable, "-m", "specula_server.cli", "serve", config.model_id, "--uds-path", config.shard_uds_path]
    for setting in shared_with(Process.WORKER):
        if _shard_needs(config, setting.name):
            argv += _flag(setting.name, getattr(config, setting.name))
    argv += _flag("instance_id", config.instance_id)
    if not config.runs_router:  # node 0's router reaches these shards over TCP
        argv += _flag("grpc_host", config.node_host)
    return argv


def _shard_needs(config: LauncherConfig, name: str) -> bool:
    """Whether the shards' command line carries the setting `name` (when it has a value)."""
    if name == "model_id" or name in SHARD_ENV_SETTINGS:
        return False  # the positional argument; the environment
    if name == "quantize_group_size":
        return config.quantize is not None or (config.speculator_quantize is not None and config.speculative_tokens > 0)
    if name == "suffix_cache_tokens":
        return config.speculative_tokens > 0 and config.speculator == "suffix"
    return name not in SPECULATION_SETTINGS or config.speculative_tokens > 0


def shard_env(config: LauncherConfig, rank: int, base_env: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment (HF_TOKEN, proxies, ...) plus this shard's place in the process group.

    API_KEY is left out: only the router checks it, and a secret a process does not need is one it cannot leak."""
    assert config.master_port is not None, "the master port is chosen at launch (endpoints.claim_endpoints)"
    return {
        **{k: v for k, v in base_env.items() if k != API_KEY_ENV},
        "RANK": str(rank), "LOCAL_RANK": str(rank - config.local_ranks.start),
        "WORLD_SIZE": str(config.num_shard), "MASTER_ADDR": config.master_addr,
        "MASTER_PORT": str(config.master_port), "LOG_LEVEL": config.log_level,
        "PYTHONUNBUFFERED": "1",  # lines reach the launcher as they are printed, not when a buffer fills
    }


def router_command(config: LauncherConfig) -> list[str]:
    """The router command line: the fixed connection flags, then every setting the launcher shares with the
    router (specula_proto/settings.py) that has a value, under the same flag."""
    argv = [sys.executable, "-m", "specula_router.cli", "--model-id", config.model_id,
            "--master-shard-uds-path", str(config.shard_socket(0)), *_flag("instance_id", config.instance_id)]
    for setting in shared_with(Process.ROUTER):
        name = setting.name
        if name == "model_id" or name in ROUTER_ENV_SETTINGS:
            continue
        if name in TOKEN_LIMITS and name not in config.given_limits:
            continue  # a default: the router derives it again, and fits it to the KV cache
        argv += _flag(name, getattr(config, name))
    return argv


def router_env(config: LauncherConfig, base_env: Mapping[str, str]) -> dict[str, str]:
    """The launcher's environment, with API_KEY set to --api-key (or removed without one).

    The key travels in the environment rather than as `--api-key` on the router's command line: a process's
    arguments are readable by every user of the host (`ps`, /proc/PID/cmdline), its environment only by its owner.
    """
    env = {k: v for k, v in base_env.items() if k != API_KEY_ENV}
    if config.api_key is not None:
        env[API_KEY_ENV] = config.api_key
    return {**env, "PYTHONUNBUFFERED": "1"}


def shard_specs(config: LauncherConfig, base_env: Mapping[str, str] | None = None) -> list[ChildSpec]:
    env = os.environ if base_env is None else base_env
    argv = tuple(shard_command(config))
    return [ChildSpec(f"shard-{rank}", argv, shard_env(config, rank, env)) for rank in config.local_ranks]


def router_spec(config: LauncherConfig, base_env: Mapping[str, str] | None = None) -> ChildSpec:
    return ChildSpec("router", tuple(router_command(config)),
                     router_env(config, os.environ if base_env is None else base_env))


def shard_sockets(config: LauncherConfig) -> list[Path]:
    return [config.shard_socket(rank) for rank in config.local_ranks]


def _flag(name: str, value: object) -> list[str]:
    """`max_batch_size=8` -> ["--max-batch-size", "8"]; None -> []; True -> ["--name"]; a tuple repeats."""
    flag = "--" + name.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, (tuple, list)):
        return [part for item in value for part in (flag, str(item))]
    return [flag, str(value)]
