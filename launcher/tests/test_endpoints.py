"""The launcher's own endpoints: per-launcher socket directories and ports, refusal of taken ones, stale sockets
and directories left by killed launchers, and children that die with a launcher killed by SIGKILL.

Two launchers with the same path or port, each with real shards, are tested end to end in
integration-tests/test_instances_e2e.py; here the "live process" is a socket this test listens on.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from specula_launcher.defaults import build_config
from specula_launcher.endpoints import (
    OWNER_FILE,
    check_master_port,
    claim_endpoints,
    is_live_socket,
    runtime_dir,
    sweep_stale_dirs,
)

LAUNCHER_DIR = Path(__file__).resolve().parent.parent
NO_GPU = dict(count_cuda_devices=lambda: 0)
FAIL_FAST_S = 20.0  # the launcher only parses flags and probes: no model, no torch


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SHARD_UDS_PATH", "MASTER_PORT", "NUM_SHARD", "PORT", "MODEL_ID", "DEVICE", "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory with a short path: pytest's tmp_path can exceed what a unix socket path may hold."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ep-", dir="/tmp") as d:
        yield Path(d)


def listening_unix(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    return server


def stale_unix(path: Path) -> None:
    """A socket file whose server is gone, as a shard killed by SIGKILL leaves it."""
    listening_unix(path).close()
    assert stat.S_ISSOCK(path.stat().st_mode)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_each_launcher_gets_its_own_directory_port_and_id(short_tmp: Path) -> None:
    config = build_config(num_shard=2, **NO_GPU)
    first, second = claim_endpoints(config, parent=short_tmp), claim_endpoints(config, parent=short_tmp)
    a, b = first.config, second.config
    assert a.shard_uds_path != b.shard_uds_path and a.instance_id != b.instance_id and len(a.instance_id) == 32
    for endpoints in (first, second):
        directory = endpoints.owned_dir
        assert directory is not None and directory.parent == short_tmp and directory.name.startswith("specula-")
        assert endpoints.config.shard_uds_path == str(directory / "shard")
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700  # other users cannot reach our shards
        assert (directory / OWNER_FILE).read_text().split()[0] == str(os.getpid())
        assert 1 <= endpoints.config.master_port <= 65535 and endpoints.config.master_port != config.port
    first.release()
    assert not first.owned_dir.exists() and second.owned_dir.exists()
    second.release()


def test_the_runtime_directory_is_xdg_when_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runtime_dir() == tmp_path
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert runtime_dir() == Path(tempfile.gettempdir())


def test_a_runtime_directory_too_long_for_a_socket_path_is_named(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    with pytest.raises(ValueError, match=r"unix sockets allow 107; set XDG_RUNTIME_DIR or TMPDIR to a shorter "
                                         r"directory, or pass --shard-uds-path \(env SHARD_UDS_PATH\)"):
        claim_endpoints(build_config(**NO_GPU), parent=deep)
    assert list(deep.iterdir()) == []  # the directory it made is gone again


def test_an_explicit_socket_path_in_use_is_refused_naming_the_flag(short_tmp: Path) -> None:
    prefix = short_tmp / "shard"
    server = listening_unix(short_tmp / "shard-1")
    try:
        config = build_config(num_shard=2, shard_uds_path=str(prefix), **NO_GPU)
        with pytest.raises(ValueError) as error:
            claim_endpoints(config)
        assert str(error.value) == (
            f"--shard-uds-path {prefix}: {prefix}-1 is in use by another process (a live socket); choose another "
            f"--shard-uds-path (env SHARD_UDS_PATH), or leave it unset for a directory of this launcher's own")
    finally:
        server.close()


def test_a_stale_socket_left_by_a_killed_launcher_is_reused(short_tmp: Path) -> None:
    prefix = short_tmp / "shard"
    stale_unix(short_tmp / "shard-0")
    assert not is_live_socket(short_tmp / "shard-0")
    endpoints = claim_endpoints(build_config(shard_uds_path=str(prefix), **NO_GPU))
    assert endpoints.config.shard_uds_path == str(prefix) and endpoints.owned_dir is None
    endpoints.release()
    assert (short_tmp / "shard-0").exists()  # the user's path: the Supervisor removes the stale file, not release


def test_an_explicit_socket_path_in_a_missing_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=rf"--shard-uds-path {tmp_path}/no/shard: no such directory {tmp_path}/no"):
        claim_endpoints(build_config(shard_uds_path=str(tmp_path / "no" / "shard"), **NO_GPU))


def test_an_explicit_master_port_in_use_is_refused_naming_the_flag() -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        with pytest.raises(ValueError) as error:
            claim_endpoints(build_config(num_shard=2, master_port=port, shard_uds_path="/tmp/x", **NO_GPU))
        assert str(error.value) == (f"--master-port {port} is in use by another process; choose another "
                                    f"--master-port (env MASTER_PORT), or leave it unset for a free port")
        # One shard never opens the port: nothing to refuse.
        claim_endpoints(build_config(master_port=port, shard_uds_path="/tmp/x", **NO_GPU))
    finally:
        listener.close()
    check_master_port(port)  # free again


def test_stale_directories_of_dead_launchers_are_swept(short_tmp: Path) -> None:
    namespace = os.readlink("/proc/self/ns/pid")

    def launcher_dir(name: str, pid: int, ns: str = namespace) -> Path:
        directory = short_tmp / name
        directory.mkdir()
        (directory / OWNER_FILE).write_text(f"{pid} {ns}\n")
        return directory

    dead = launcher_dir("specula-dead", dead_pid())
    stale_unix(dead / "shard-0")
    alive = launcher_dir("specula-alive", os.getpid())
    elsewhere = launcher_dir("specula-other-namespace", dead_pid(), ns="pid:[1]")  # its pid means nothing here
    serving = launcher_dir("specula-serving", dead_pid())  # e.g. its shards outlived it: still in use
    server = listening_unix(serving / "shard-0")
    unowned = short_tmp / "specula-no-owner-file"
    unowned.mkdir()
    try:
        sweep_stale_dirs(short_tmp)
    finally:
        server.close()
    assert not dead.exists()
    assert all(d.exists() for d in (alive, elsewhere, serving, unowned))


def run_launcher(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONPATH": str(LAUNCHER_DIR)}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "specula_launcher.cli", "--device", "cpu", *args], env=env,
                            capture_output=True, text=True, timeout=60)
    return result, time.monotonic() - started


def test_the_launcher_refuses_a_taken_path_or_port_at_once(short_tmp: Path) -> None:
    """The real command line: exit 2 with the message before any child starts."""
    server = listening_unix(short_tmp / "busy-0")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        result, seconds = run_launcher("--shard-uds-path", str(short_tmp / "busy"))
        assert result.returncode == 2 and seconds < FAIL_FAST_S, result.stdout + result.stderr
        assert (f"[launcher] error: --shard-uds-path {short_tmp}/busy: {short_tmp}/busy-0 is in use by another "
                f"process (a live socket)") in result.stdout
        assert "[shard-0]" not in result.stdout and "starting router" not in result.stdout
        result, seconds = run_launcher("--num-shard", "2", "--master-port", str(port))
        assert result.returncode == 2 and seconds < FAIL_FAST_S, result.stdout + result.stderr
        assert f"[launcher] error: --master-port {port} is in use by another process" in result.stdout
    finally:
        server.close()
        listener.close()


# A launcher stand-in: starts one child the way the Supervisor does, prints its pid, then waits to be killed.
DRIVER = r"""
import sys, time
from specula_launcher.processes import Child, ChildSpec, LogSink
child = Child(ChildSpec("shard-0", (sys.executable, "-c", "import time; time.sleep(120)"), {}), LogSink(sys.stderr))
child.start()
print(child._proc.pid, flush=True)
time.sleep(120)
"""


def test_children_die_with_a_launcher_killed_by_sigkill() -> None:
    env = {**os.environ, "PYTHONPATH": str(LAUNCHER_DIR)}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(driver.stdout.readline())
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 10
        while _is_running(child_pid):
            assert time.monotonic() < deadline, "the child outlived its launcher"
            time.sleep(0.05)
    finally:
        driver.kill()


def _is_running(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
