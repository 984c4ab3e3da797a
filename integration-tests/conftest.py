"""Fixtures of the end-to-end tier: a tiny model, the real launcher serving it, and the published clients.

Servers are session-scoped and started on first use, so the whole tier pays for each configuration once:

    server           1 shard, defaults but a small --payload-limit and --max-batch-size (so bursts queue)
    overload_server  1 shard, --max-concurrent-requests 1 (429 tests)
    tp_server        --num-shard 2 (tensor parallelism over gloo)

Tests that end a launcher (a killed shard, SIGTERM while a request runs) start their own with `launch`.
Every launcher is stopped with SIGTERM at teardown and must exit 0: a clean shutdown is part of the contract.

`clients_python` is an interpreter with the published `text-generation` and `lorax-client` installed. They pin
an older huggingface_hub than the server needs, so they live in their own virtualenv (`.venv-clients` at the
repository root, created on first use, reused after; `SPECULA_CLIENTS_PYTHON` overrides it). Client tests run a
small script with it and read the JSON it prints.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from stack import MAX_BATCH_SIZE, MAX_POSITIONS, PAYLOAD_LIMIT, LauncherProcess, started, stopped

from specula_testing import clients
from specula_testing.models import build_tiny_model

CLIENT_SCRIPT_TIMEOUT_S = 120


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every end-to-end test starts real processes: all of them are in the slow tier."""
    here = Path(__file__).resolve().parent
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(here):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A random-weight Llama with a real byte-level BPE tokenizer, in Hugging Face layout."""
    return build_tiny_model(tmp_path_factory.mktemp("model") / "llama", "llama",
                            max_position_embeddings=MAX_POSITIONS)


def _start(model_dir: Path | None, work_dir: Path, args: list[str], name: str) -> LauncherProcess:
    return started(LauncherProcess(model_dir, work_dir, args, name))


_stop = stopped  # the name the test modules import


@pytest.fixture(scope="session")
def server(model_dir, tmp_path_factory) -> Iterator[LauncherProcess]:
    args = ["--payload-limit", str(PAYLOAD_LIMIT), "--max-batch-size", str(MAX_BATCH_SIZE)]
    launcher = _start(model_dir, tmp_path_factory.mktemp("server"), args, "server")
    yield launcher
    _stop(launcher)


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.url


@pytest.fixture(scope="session")
def overload_server(model_dir, tmp_path_factory) -> Iterator[LauncherProcess]:
    launcher = _start(model_dir, tmp_path_factory.mktemp("overload"), ["--max-concurrent-requests", "1"],
                      "overload-server")
    yield launcher
    _stop(launcher)


@pytest.fixture(scope="session")
def tp_server(model_dir, tmp_path_factory) -> Iterator[LauncherProcess]:
    launcher = _start(model_dir, tmp_path_factory.mktemp("tp"), ["--num-shard", "2"], "tp-server")
    yield launcher
    _stop(launcher)


@pytest.fixture
def launch(model_dir, tmp_path) -> Iterator[Callable[..., LauncherProcess]]:
    """Starts a launcher of the test's own; each still running at the end must stop cleanly on SIGTERM."""
    started: list[LauncherProcess] = []

    def start(*args: str) -> LauncherProcess:
        launcher = _start(model_dir, tmp_path / f"launcher{len(started)}", list(args), f"launcher{len(started)}")
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        if launcher.returncode is None:
            _stop(launcher)
        launcher.close()


# --- the published clients -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def clients_python() -> str:
    """An interpreter that imports the published `text_generation` and `lorax` clients."""
    try:
        return clients.clients_python()
    except clients.ClientsSetupError as e:
        pytest.fail(str(e))


@pytest.fixture(scope="session")
def run_client(clients_python, tmp_path_factory) -> Callable[..., object]:
    """Runs `script` (Python source, dedented) with the clients' interpreter; returns the JSON it prints last.

    The script gets its arguments as `ARGS` (a dict) and should end with `print(json.dumps(...))`.
    """
    scripts = tmp_path_factory.mktemp("client-scripts")

    def run(script: str, **args: object) -> object:
        path = scripts / f"script{len(list(scripts.iterdir()))}.py"
        path.write_text("import json, sys\nARGS = json.loads(sys.argv[1])\n" + textwrap.dedent(script))
        r = subprocess.run([clients_python, str(path), json.dumps(args)], capture_output=True, text=True,
                           timeout=CLIENT_SCRIPT_TIMEOUT_S, env=clients.clients_env())
        assert r.returncode == 0, f"client script failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        lines = r.stdout.strip().splitlines()
        assert lines, f"client script printed nothing; stderr:\n{r.stderr[-3000:]}"
        return json.loads(lines[-1])

    return run
