"""The real Specula stack as a subprocess: `specula-launcher` started from the source tree, and its children.

Where it sits: `conftest.py` builds `LauncherProcess`es for the integration tests; each one is the exact
command a user runs (`python -m specula_launcher.cli --model-id DIR ...`), with PYTHONPATH pointing at the
repository's package directories so nothing needs to be installed. The launcher runs in its own process
group; its output (and its children's, which it prefixes with "[shard-0]", "[router]") goes to a log file
that is quoted whenever a test fails because of it.

    launcher (own process group) ──> shard-0 .. shard-n-1   (own process groups, started by the launcher)
                                 └─> router :port           (HTTP, loopback only)
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("server", "kernels", "proto", "router", "launcher")

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
# The router drains in-flight requests on SIGTERM for this long; short, so a stuck shutdown fails fast.
SHUTDOWN_TIMEOUT_S = 10
LOG_TAIL_CHARS = 6000
# Positions of the tiny test model: enough for requests that stay in flight for seconds (429, drain, disconnects).
MAX_POSITIONS = 2048
# --payload-limit and --max-batch-size of the main test server (a burst of more requests than that queues).
PAYLOAD_LIMIT = 20_000
MAX_BATCH_SIZE = 8


def is_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def started(launcher: LauncherProcess) -> LauncherProcess:
    """Starts `launcher` and waits until it serves; closes it if it never does."""
    launcher.start()
    try:
        launcher.wait_healthy()
    except BaseException:
        launcher.close()
        raise
    return launcher


def stopped(launcher: LauncherProcess) -> None:
    """SIGTERM, and the clean exit (0) that is part of the contract."""
    try:
        code = launcher.terminate()
    finally:
        launcher.close()
    assert code == 0, f"{launcher.name} exited with {code} on SIGTERM:\n{launcher.output()}"


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def source_env() -> dict[str, str]:
    """The environment with the repository's packages importable, offline, and unbuffered output."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT / d) for d in PACKAGE_DIRS]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


class LauncherProcess:
    """One `specula-launcher` subprocess serving `model_dir` on 127.0.0.1 with the given extra flags (no
    `--model-id` when `model_dir` is None: the launcher's default, the bundled demo model).

    The shard sockets and the torch.distributed port are the launcher's defaults (its own directory and a free
    port), as a user gets them, unless `extra_args` name them; `port` reuses an HTTP port (a restart)."""

    def __init__(self, model_dir: Path | None, work_dir: Path, extra_args: Sequence[str] = (),
                 name: str = "launcher", port: int | None = None):
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / f"{name}.log"
        self.argv = [
            sys.executable, "-m", "specula_launcher.cli",
            *(["--model-id", str(model_dir)] if model_dir is not None else []),
            "--port", str(self.port), "--hostname", "127.0.0.1", "--kv-cache-memory", "64MiB",
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file = None

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> LauncherProcess:
        self._log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, cwd=REPO_ROOT, env=source_env(), stdin=subprocess.DEVNULL,
                                     stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_stop_with_parent)
        return self

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Polls GET /health until 200; fails with the launcher's output if it exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.returncode is not None:
                raise RuntimeError(f"{self.name} exited with {self.returncode} before it was healthy:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s:\n{self.output()}")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait(self, timeout: float) -> int:
        """The launcher's exit code; raises TimeoutError (with its output) if it is still running."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} still running after {timeout:.0f}s:\n{self.output()}") from None

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM to the launcher (as a process manager would) and its exit code; kills everything on timeout."""
        if self.returncode is not None:
            return self.returncode
        os.kill(self.pid, signal.SIGTERM)
        try:
            return self.wait(timeout)
        except TimeoutError:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL to the launcher's group and to every child's group (they run in their own sessions)."""
        if self.proc is None:
            return
        for pid in descendants(self.pid):
            _killpg(pid)
        _killpg(self.pid)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        if self.returncode is None:
            self.kill()
        if self._log_file is not None:
            self._log_file.close()

    # --- inspection ----------------------------------------------------------------------------------------

    def output(self, tail: int | None = LOG_TAIL_CHARS) -> str:
        """The last `tail` characters (all with None) of everything the launcher and its children printed."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "<no output>"
        return text if tail is None else text[-tail:]

    def shard_uds_path(self) -> Path:
        """The socket prefix the launcher gave its shards (shard r listens on PREFIX-r), from shard 0's argv."""
        argv = _cmdline(self.children()["shard-0"])
        return Path(argv[argv.index("--uds-path") + 1])

    def children(self) -> dict[str, int]:
        """The launcher's live children by their log name: {"shard-0": pid, ..., "router": pid}."""
        named = {}
        for pid in child_pids(self.pid):
            argv = _cmdline(pid)
            if "specula_router.cli" in argv:
                named["router"] = pid
            elif "specula_server.cli" in argv:
                named[f"shard-{_environ(pid).get('RANK', '?')}"] = pid
        return named


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc (Linux)."""
    pids = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            pids += [int(p) for p in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return pids


def descendants(pid: int) -> list[int]:
    out, todo = [], child_pids(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += child_pids(p)
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM it when the test process dies, even by SIGKILL (Linux only).

    Without this a test run killed from outside would leave launchers (and their model shards) running, since
    they sit in their own process groups where no terminal signal reaches them.
    """
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
