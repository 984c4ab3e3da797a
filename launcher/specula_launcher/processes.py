"""Child process supervision: start the shards, wait for their sockets, start the router, stop in order.

The launcher's whole life is one `Supervisor.run()`:

    remove stale sockets ─> start shard-0..n-1 ─> wait for every {uds}-{rank} ─> start router ─> monitor
                                   │ a shard exits first                              │ any child exits
                                   └──────────────> failure: stop the rest, print its tail, return 1
    SIGINT / SIGTERM at any point ─> SIGTERM router, wait (it drains) ─> SIGTERM shards, wait ─> return 0
    (a node other than node 0 of a multi-node group runs shards only: no router)
                                     (3 when the router's drain ran out and it cut requests short)

Each child runs in its own process group (a Ctrl-C in the terminal reaches only the launcher, which then stops
the children in order) with stdout and stderr merged into one pipe, and is killed by the kernel if the launcher
dies without stopping it (kill -9, the OOM killer): no orphan keeps a socket, a port or a GPU. A reader thread
per child prefixes every line with the child's name ("[shard-0] ...") or wraps it as a JSON line, and keeps the
last lines so a crash can be explained. Anything still running when its stop timeout passes is killed (SIGKILL,
whole group). A second signal during shutdown kills everything at once.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

LAUNCHER = "launcher"  # the process name on the launcher's own log lines
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The router's exit code when its drain ran past --shutdown-timeout and requests were ended with a shutdown
# error (specula_router.lifecycle.DRAIN_CUT_EXIT_CODE); the launcher then exits with it too.
DRAIN_CUT_EXIT_CODE = 3


@dataclass(frozen=True)
class ChildSpec:
    """What to run: a name for the logs, the argument vector and the complete environment."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


class LogSink:
    """Writes whole lines from several threads to one stream: "[name] line" or {"process", "line"} JSON."""

    def __init__(self, stream: TextIO, json_output: bool = False) -> None:
        self._stream = stream
        self._json_output = json_output
        self._lock = threading.Lock()

    def emit(self, process: str, line: str) -> None:
        text = json.dumps({"process": process, "line": line}) if self._json_output else f"[{process}] {line}"
        with self._lock:
            self._stream.write(text + "\n")
            self._stream.flush()


class Child:
    """One running child process, its output reader and the tail of its output."""

    def __init__(self, spec: ChildSpec, sink: LogSink, tail_lines: int = 20) -> None:
        self.spec = spec
        self._sink = sink
        self._tail: deque[str] = deque(maxlen=tail_lines)
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self) -> None:
        self._proc = subprocess.Popen(
            list(self.spec.argv), env=dict(self.spec.env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,  # own process group: Ctrl-C reaches only us
            preexec_fn=die_with_parent(),
        )
        self._reader = threading.Thread(target=self._read_output, name=f"output-{self.name}", daemon=True)
        self._reader.start()

    def _read_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self._tail.append(line)
            self._sink.emit(self.name, line)
        self._proc.stdout.close()

    @property
    def is_started(self) -> bool:
        return self._proc is not None

    @property
    def returncode(self) -> int | None:
        """None while running (or never started), else the exit code (-N: killed by signal N)."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def send_signal(self, sig: int) -> None:
        """Signals the child's whole process group, so its own helpers stop with it."""
        if self.is_running:
            assert self._proc is not None
            try:
                os.killpg(self._proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # exited between the check and the signal

    def wait(self, timeout: float) -> None:
        """Reaps the process and lets the reader finish, so `tail()` holds everything it printed."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self._reader is not None:
            self._reader.join(timeout)  # a grandchild may hold the pipe open: don't wait forever

    def tail(self) -> list[str]:
        return list(self._tail)


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'killed by SIGKILL'."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Supervisor:
    """Runs shards then the router, and stops them router-first; see the module docstring."""

    def __init__(
        self,
        shards: Sequence[ChildSpec],
        router: ChildSpec | None,
        shard_sockets: Sequence[Path],
        sink: LogSink,
        drain_timeout: float,
        stop_timeout: float = 10.0,
        poll_interval: float = 0.1,
        progress_interval: float = 5.0,
    ) -> None:
        assert len(shards) == len(shard_sockets) and shards, "one socket per shard, at least one shard"
        self._shards = [Child(spec, sink) for spec in shards]
        self._router = Child(router, sink) if router is not None else None
        self._sockets = list(shard_sockets)
        self._sink = sink
        self._drain_timeout = drain_timeout
        self._stop_timeout = stop_timeout
        self._poll = poll_interval
        self._progress_interval = progress_interval
        # Written by signal handlers: plain attributes only (no locks, which the interrupted code may hold).
        self._num_stop_requests = 0
        self._stop_reason = ""

    @property
    def children(self) -> list[Child]:
        """The shards in rank order, then the router (if this launcher runs one)."""
        return [*self._shards, *self._routers]

    @property
    def _routers(self) -> list[Child]:
        return [self._router] if self._router is not None else []

    def request_stop(self, reason: str = "stop requested") -> None:
        """Asks `run` to shut down; safe to call from a signal handler. A second call forces SIGKILL."""
        self._stop_reason = reason
        self._num_stop_requests += 1

    def run(self) -> int:
        """Runs until stopped (0; `DRAIN_CUT_EXIT_CODE` when the drain was cut) or until a child fails (1)."""
        try:
            self._remove_sockets(at_start=True)
            failed = self._start_shards()
            if failed is None and not self._num_stop_requests:
                if self._router is not None:
                    self._log("starting router")
                    self._router.start()
                else:
                    self._log("shards only: the router runs on node 0")
                failed = self._monitor()
        except BaseException as e:
            self._log(f"launcher error: {e!r}; stopping")
            self._shutdown()
            if isinstance(e, OSError):
                return 1
            raise
        if failed is not None:
            self._log(f"{failed.name} exited unexpectedly ({describe_exit(failed.returncode or 0)}); "
                      f"stopping the others")
            self._shutdown()
            self._report(failed)
            return 1
        self._log(f"{self._stop_reason}: shutting down")
        self._shutdown()
        if self._router is not None and self._router.returncode == DRAIN_CUT_EXIT_CODE:
            self._log("the router's drain was cut by --shutdown-timeout: the requests still in flight were "
                      "ended with a shutdown error")
            return DRAIN_CUT_EXIT_CODE
        return 0

    def _start_shards(self) -> Child | None:
        """Starts every shard and waits for its socket; returns the shard that died first, if any."""
        for child in self._shards:
            child.start()
        started = time.monotonic()
        pending = {child.name.replace("-", " "): path for child, path in zip(self._shards, self._sockets)}
        next_progress = started + self._progress_interval
        while pending:
            if self._num_stop_requests:
                return None
            dead = self._first_exited(self._shards)
            if dead is not None:
                return dead
            for name, path in list(pending.items()):
                if path.exists():
                    self._log(f"{name} ready ({path})")
                    del pending[name]
            if pending and time.monotonic() >= next_progress:
                for name in pending:
                    self._log(f"waiting for {name} ({time.monotonic() - started:.0f}s)")
                next_progress += self._progress_interval
            if pending:
                time.sleep(self._poll)
        self._log(f"all {len(self._shards)} shard(s) ready in {time.monotonic() - started:.1f}s")
        return None

    def _monitor(self) -> Child | None:
        while not self._num_stop_requests:
            dead = self._first_exited([*self._routers, *self._shards])
            if dead is not None:
                return dead
            time.sleep(self._poll)
        return None

    @staticmethod
    def _first_exited(children: Sequence[Child]) -> Child | None:
        return next((c for c in children if c.is_started and c.returncode is not None), None)

    def _shutdown(self) -> None:
        """Router first (it drains in-flight requests), then the shards; SIGKILL after each timeout."""
        requests_before = self._num_stop_requests
        if any(r.is_running for r in self._routers):
            self._log(f"stopping router (drains for up to {self._drain_timeout:.0f}s)")
        self._stop(self._routers, self._drain_timeout, requests_before)
        if any(c.is_running for c in self._shards):
            self._log("stopping shards")
        self._stop(self._shards, self._stop_timeout, requests_before)
        self._remove_sockets()
        self._log("all processes stopped")

    def _stop(self, children: Sequence[Child], timeout: float, requests_before: int) -> None:
        for child in children:
            child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(c.is_running for c in children) and time.monotonic() < deadline:
            if self._num_stop_requests > requests_before:  # another Ctrl-C: don't wait any longer
                self._log("second signal: killing")
                break
            time.sleep(min(self._poll, 0.05))
        for child in children:
            if child.is_running:
                self._log(f"{child.name} still running, sending SIGKILL")
                child.send_signal(signal.SIGKILL)
        for child in children:
            child.wait(timeout=2.0)

    def _report(self, child: Child) -> None:
        tail = child.tail()
        self._log(f"{child.name} failed: {describe_exit(child.returncode or 0)}; "
                  f"last {len(tail)} line(s) of its output:")
        for line in tail:
            self._log(f"  | {line}")

    def _remove_sockets(self, at_start: bool = False) -> None:
        """Removes the shards' sockets; at start, only stale ones are left (the launcher refused live ones)."""
        for path in self._sockets:
            try:
                mode = path.lstat().st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISSOCK(mode):  # never delete what is not a socket: a mistyped flag names a file
                if at_start:
                    raise OSError(f"{path} exists and is not a socket; choose another --shard-uds-path")
                continue
            if at_start:
                self._log(f"removing {path}, stale (left by a shard that was killed)")
            path.unlink(missing_ok=True)

    def _log(self, line: str) -> None:
        self._sink.emit(LAUNCHER, line)


def die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel SIGKILL the child when the thread starting it ends: the launcher's
    main thread, so when the launcher dies (Linux; None elsewhere).

    Children run in their own sessions, out of reach of whatever ends the launcher; without this a launcher
    killed with SIGKILL would leave its shards serving their sockets and its router holding its port. libc's
    prctl is looked up here, in the parent: the child, forked from a process with threads, should only call it.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return in_child


def run_with_signal_handlers(supervisor: Supervisor) -> int:
    """Runs `supervisor` with SIGINT and SIGTERM turned into stop requests (main thread only)."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def on_signal(signum: int, _frame: object) -> None:
        supervisor.request_stop(f"received {signal.Signals(signum).name}")

    for sig in signals:
        signal.signal(sig, on_signal)
    try:
        return supervisor.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
