"""Per-launcher endpoints: where the shards' sockets live, the torch.distributed port, and the run's id.

Two launchers on one host must never share a shard socket or a rendezvous port, or one's router ends up talking
to the other's model. `claim_endpoints` runs once, before any child starts. It fills in what the user left unset
with names no other process holds, and refuses the ones the user named when a live process holds them:

    --shard-uds-path unset   a new private directory (mode 0700), $XDG_RUNTIME_DIR/specula-XXXXXXXX or the same
                             under the temp directory, holding shard-0 .. shard-{n-1}; removed at exit
    --shard-uds-path PATH    PATH-{rank} accepting connections: refused, a live server owns it. Present but
                             refusing connections (a killed launcher's): stale, the Supervisor removes it
    --master-port unset      a port free right now (bound to port 0 and released; rank 0 binds it a few seconds
                             later, a race we accept)
    --master-port PORT       refused when something listens on it; checked with --num-shard > 1 only, since a
                             single shard never opens it

The run's instance id (a random uuid) goes to every shard and to the router, which refuses a shard reporting
another id: the last line of defence if two launchers still race to one path. With --nnodes > 1 the launchers of
one group must agree on it without talking: it is derived from the rendezvous address and port they share (two
groups cannot hold one rendezvous at once). A node other than node 0 also needs the address node 0's router
reaches its shards at (--node-host; by default its own address on the route to --master-addr). A launcher killed by
SIGKILL leaves its directory behind; the next launcher removes it (`sweep_stale_dirs`).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import shutil
import socket
import stat
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from specula_launcher.config import MAX_UDS_PATH_BYTES, LauncherConfig

DIR_PREFIX = "specula-"
# Inside each per-launcher directory: "PID PID-NAMESPACE" of the launcher that made it, for `sweep_stale_dirs`.
OWNER_FILE = "launcher.pid"
SOCKET_NAME = "shard"  # shard r listens on {directory}/shard-{r}
CONNECT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Endpoints:
    """The launcher's config with its endpoints filled in, and the directory it owns (None: the user named the
    socket path). `release()` removes that directory once the children are gone."""

    config: LauncherConfig
    owned_dir: Path | None = None

    def release(self) -> None:
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)


def claim_endpoints(config: LauncherConfig, parent: Path | None = None) -> Endpoints:
    """Fills in `shard_uds_path`, `master_port` and `instance_id`; see the module docstring.

    Raises ValueError naming the flag and its environment variable when a path or port the user named is taken.
    `parent` is where the per-launcher directory goes (default: `runtime_dir()`).
    """
    if config.shard_uds_path is not None:
        check_socket_prefix(config.shard_uds_path, config.num_shard)
    if config.master_port is not None and config.num_shard > 1 and config.node_rank == 0:
        check_master_port(config.master_port)  # node 0's shard 0 listens on it; on other nodes it is remote
    master_port = config.master_port if config.master_port is not None else free_port(avoid=config.port)
    instance_id = uuid.uuid4().hex
    if config.nnodes > 1:
        instance_id = hashlib.sha256(f"{config.master_addr}:{master_port}".encode()).hexdigest()[:32]
    node_host = config.node_host
    if config.node_rank > 0 and node_host is None:
        node_host = route_address(config.master_addr, master_port)
    owned_dir = None
    shard_uds_path = config.shard_uds_path
    if shard_uds_path is None:
        owned_dir = make_socket_dir(parent or runtime_dir(), config.num_shard)
        shard_uds_path = str(owned_dir / SOCKET_NAME)
    resolved = dataclasses.replace(config, shard_uds_path=shard_uds_path, master_port=master_port,
                                   instance_id=instance_id, node_host=node_host)
    return Endpoints(resolved, owned_dir)


def route_address(host: str, port: int) -> str:
    """This host's address on the route to `host` (a UDP socket "connected" to it sends nothing)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError as e:
        raise ValueError(f"cannot find this node's address on the route to --master-addr {host}: {e}; pass "
                         f"--node-host (env NODE_HOST)") from e


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR when it is a writable directory (per user, private, cleared at logout), else the
    temp directory ($TMPDIR, /tmp)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        return Path(xdg)
    return Path(tempfile.gettempdir())


def make_socket_dir(parent: Path, num_shard: int) -> Path:
    """A new directory for this launcher's sockets, after removing those killed launchers left in `parent`."""
    sweep_stale_dirs(parent)
    directory = Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir=parent))
    longest = f"{directory / SOCKET_NAME}-{num_shard - 1}"
    if len(longest.encode()) > MAX_UDS_PATH_BYTES:
        shutil.rmtree(directory, ignore_errors=True)
        raise ValueError(f"the shard socket {longest} would be {len(longest.encode())} bytes, unix sockets allow "
                         f"{MAX_UDS_PATH_BYTES}; set XDG_RUNTIME_DIR or TMPDIR to a shorter directory, or pass "
                         f"--shard-uds-path (env SHARD_UDS_PATH)")
    (directory / OWNER_FILE).write_text(f"{os.getpid()} {_pid_namespace()}\n")
    return directory


def check_socket_prefix(prefix: str, num_shard: int) -> None:
    """Refuses a `--shard-uds-path` whose sockets a live process serves, or whose directory does not exist."""
    parent = Path(prefix).parent
    if not parent.is_dir():
        raise ValueError(f"--shard-uds-path {prefix}: no such directory {parent}")
    for rank in range(num_shard):
        path = f"{prefix}-{rank}"
        if is_live_socket(path):
            raise ValueError(f"--shard-uds-path {prefix}: {path} is in use by another process (a live socket); "
                             f"choose another --shard-uds-path (env SHARD_UDS_PATH), or leave it unset for a "
                             f"directory of this launcher's own")


def is_live_socket(path: str | Path) -> bool:
    """Whether `path` is a unix socket some process accepts connections on. A socket file whose server is gone
    (killed without removing it) refuses connections: stale, not live."""
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
    except OSError:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(CONNECT_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # a full backlog, a slow accept, another user's socket: not ours to take
        return True


def check_master_port(port: int) -> None:
    """Refuses a `--master-port` that something on this host listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR: connections of an earlier run in TIME_WAIT don't hold the port, only a listener does.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--master-port {port} is in use by another process; choose another "
                                 f"--master-port (env MASTER_PORT), or leave it unset for a free port") from e


def free_port(avoid: int | None = None) -> int:
    """A TCP port nothing listens on right now (never `avoid`, the router's HTTP port)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        if port != avoid:
            return port


def sweep_stale_dirs(parent: Path) -> None:
    """Removes per-launcher directories in `parent` whose launcher is dead: ours (same user), made in this pid
    namespace (a pid means nothing across containers sharing a directory), and with no live socket inside.
    Best effort: anything unexpected is left alone."""
    namespace = _pid_namespace()
    if not namespace:
        return
    try:
        candidates = [p for p in parent.iterdir() if p.name.startswith(DIR_PREFIX)]
    except OSError:
        return
    for directory in candidates:
        try:
            if directory.is_symlink() or not directory.is_dir() or directory.stat().st_uid != os.getuid():
                continue
            pid, owner_namespace = (directory / OWNER_FILE).read_text().split()
            if owner_namespace != namespace or _is_alive(int(pid)):
                continue
            if any(is_live_socket(p) for p in directory.iterdir()):
                continue
        except (OSError, ValueError):
            continue
        shutil.rmtree(directory, ignore_errors=True)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _pid_namespace() -> str:
    """This process's pid namespace ("pid:[4026531836]"), or "" where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
