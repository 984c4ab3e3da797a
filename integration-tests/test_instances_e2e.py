"""Several servers on one host: each launcher answers with its own model, never another's.

Before, every launcher used /tmp/specula-server-{rank} and port 29500 by default, so a second launcher took over
the first one's sockets and its router answered with the other model ("Prefill failed: step 2 arrived after step
132"). Now a launcher left to its defaults gets a socket directory and a free rendezvous port of its own; one
told to use a path or port that a live process holds refuses at once, naming the flag; a launcher killed by
SIGKILL takes its children with it and leaves only stale sockets, which a restart reuses; and a router refuses
shards of another launcher run (their Info carries the run's instance id).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from stack import (
    MAX_POSITIONS,
    REPO_ROOT,
    LauncherProcess,
    _cmdline,
    _environ,
    free_port,
    is_alive,
    source_env,
    started,
    stopped,
)
from wire import REQUEST_TIMEOUT_S, generate, wait_until

from specula_testing.models import build_tiny_model

PROMPT = "def main():\n    return"
NUM_TOKENS = 12
FAIL_FAST_S = 30.0  # a refused launcher starts no child: this is its Python start-up, not a model load


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """The same architecture and tokenizer as `model_dir`, other random weights: other greedy tokens."""
    return build_tiny_model(tmp_path_factory.mktemp("other-model") / "llama", "llama", seed=1,
                            max_position_embeddings=MAX_POSITIONS)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory for explicit socket paths, short enough for a unix socket whatever pytest's tmp_path is."""
    with tempfile.TemporaryDirectory(prefix="specula-test-") as d:
        yield Path(d)


def greedy_ids(url: str) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy continuation ids) served at `url`."""
    r = generate(url, PROMPT, max_new_tokens=NUM_TOKENS, ignore_eos_token=True, details=True,
                 decoder_input_details=True)
    assert r.status_code == 200, r.text
    details = r.json()["details"]
    return [t["id"] for t in details["prefill"]], [t["id"] for t in details["tokens"]]


def reference_greedy(model_dir: Path, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """What `model_dir`'s weights generate greedily, by transformers, one full forward per token."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(num_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def child_argument(launcher: LauncherProcess, child: str, flag: str) -> str:
    argv = _cmdline(launcher.children()[child])
    return argv[argv.index(flag) + 1]


def test_two_launchers_with_default_flags_each_answer_with_their_own_model(model_dir, other_model_dir, tmp_path):
    launchers = [LauncherProcess(d, tmp_path / name, ["--num-shard", "2"], name)
                 for d, name in ((model_dir, "first"), (other_model_dir, "second"))]
    try:
        for launcher in launchers:  # both start at once: neither waits for the other to be up
            launcher.start()
        for launcher in launchers:
            launcher.wait_healthy()
        prefixes = [launcher.shard_uds_path() for launcher in launchers]
        ports = [_environ(launcher.children()["shard-0"])["MASTER_PORT"] for launcher in launchers]
        ids = [child_argument(launcher, "router", "--instance-id") for launcher in launchers]
        assert prefixes[0].parent != prefixes[1].parent and ports[0] != ports[1] and ids[0] != ids[1]
        assert all(child_argument(launcher, "shard-1", "--instance-id") == i for launcher, i in zip(launchers, ids))

        served = []
        for launcher, own_dir in zip(launchers, (model_dir, other_model_dir)):
            info = httpx.get(f"{launcher.url}/info", timeout=REQUEST_TIMEOUT_S).json()
            assert info["model_id"] == str(own_dir) and info["num_shard"] == 2
            prompt_ids, tokens = greedy_ids(launcher.url)
            assert tokens == reference_greedy(own_dir, prompt_ids, NUM_TOKENS), launcher.name
            served.append(tokens)
        assert served[0] != served[1], "the two models should not generate alike"

        # A router pointed at the first launcher's shards with the second run's id refuses them.
        result = subprocess.run(
            [sys.executable, "-m", "specula_router.cli", "--model-id", str(other_model_dir), "--hostname",
             "127.0.0.1", "--port", str(free_port()), "--master-shard-uds-path", f"{prefixes[0]}-0",
             "--instance-id", ids[1]],
            cwd=REPO_ROOT, env=source_env(), capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, result.stdout + result.stderr
        assert (f"shard 0 at unix://{prefixes[0]}-0 belongs to instance {ids[0]} (serving {model_dir}), not to this "
                f"router's instance {ids[1]}") in result.stdout + result.stderr
        assert greedy_ids(launchers[0].url)[1] == served[0]  # the refused router changed nothing
    finally:
        for launcher in launchers:
            if launcher.returncode is None:
                stopped(launcher)
            launcher.close()
    assert not any(prefix.parent.exists() for prefix in prefixes), "a launcher's socket directory was left behind"


def test_a_socket_path_or_master_port_in_use_is_refused_at_once(model_dir, other_model_dir, tmp_path, short_dir):
    prefix, master_port = short_dir / "shard", free_port()
    owner = started(LauncherProcess(model_dir, tmp_path / "owner", ["--num-shard", "2", "--shard-uds-path",
                                                                    str(prefix), "--master-port", str(master_port)],
                                    "owner"))
    try:
        answer = greedy_ids(owner.url)[1]
        refusals = {
            "--shard-uds-path": (["--shard-uds-path", str(prefix)],
                                 f"--shard-uds-path {prefix}: {prefix}-0 is in use by another process (a live "
                                 f"socket); choose another --shard-uds-path (env SHARD_UDS_PATH)"),
            "--master-port": (["--num-shard", "2", "--master-port", str(master_port)],
                              f"--master-port {master_port} is in use by another process; choose another "
                              f"--master-port (env MASTER_PORT)"),
        }
        for flag, (args, message) in refusals.items():
            intruder = LauncherProcess(other_model_dir, tmp_path / "intruder", args, f"intruder{flag}").start()
            try:
                began = time.monotonic()
                code = intruder.wait(timeout=FAIL_FAST_S)
                assert code == 2 and time.monotonic() - began < FAIL_FAST_S, intruder.output()
                assert f"[launcher] error: {message}" in intruder.output(), intruder.output()
                assert "[shard-0]" not in intruder.output()  # nothing was started
            finally:
                intruder.close()
        # The owner never noticed: its sockets are still there and it answers with its own model.
        assert all(Path(f"{prefix}-{rank}").exists() for rank in range(2))
        assert greedy_ids(owner.url)[1] == answer
    finally:
        stopped(owner)


def test_a_restart_after_kill_9_reuses_the_stale_sockets(model_dir, tmp_path, short_dir):
    prefix = short_dir / "shard"
    args = ["--num-shard", "2", "--shard-uds-path", str(prefix), "--master-port", str(free_port())]
    killed = started(LauncherProcess(model_dir, tmp_path / "killed", args, "killed"))
    try:
        children = killed.children()
        answer = greedy_ids(killed.url)[1]
        os.kill(killed.pid, signal.SIGKILL)  # the launcher only, as the OOM killer would
        killed.wait(timeout=10)
        # Its children die with it (they run in sessions of their own, out of reach of a terminal's signals).
        wait_until(lambda: not any(is_alive(pid) for pid in children.values()), timeout=20,
                   what="the killed launcher's children to be gone")
    finally:
        killed.close()
    sockets = [Path(f"{prefix}-{rank}") for rank in range(2)]
    assert all(s.exists() for s in sockets), "SIGKILL leaves the socket files: the restart must reuse them"

    restarted = started(LauncherProcess(model_dir, tmp_path / "restarted", args, "restarted", port=killed.port))
    try:
        assert greedy_ids(restarted.url)[1] == answer
        assert f"removing {sockets[0]}, stale" in restarted.output(tail=None)
    finally:
        stopped(restarted)

