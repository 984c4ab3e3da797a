"""The published clients (`text-generation`, `lorax-client`, `openai`, huggingface_hub's `InferenceClient`) in their
own virtualenv, for tests that check our HTTP schemas against them.

They pin an older huggingface_hub and pydantic than the server needs, so they cannot share our environment:
`.venv-clients` at the repository root is created on first use and reused after; `SPECULA_CLIENTS_PYTHON`
names an interpreter that already has them instead.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENTS_VENV = REPO_ROOT / ".venv-clients"
CLIENTS_REQUIREMENTS = REPO_ROOT / "integration-tests" / "requirements-clients.txt"
PIP_TIMEOUT_S = 600


class ClientsSetupError(RuntimeError):
    pass


def clients_env() -> dict[str, str]:
    """The environment without our PYTHONPATH: the clients must not see the server's packages."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _importable(python: str) -> bool:
    check = "import text_generation, lorax, openai, huggingface_hub; print('ok')"
    r = subprocess.run([python, "-c", check], capture_output=True, text=True, timeout=60, env=clients_env())
    return r.returncode == 0 and r.stdout.strip() == "ok"


def _run_setup(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=clients_env())
    if r.returncode != 0:
        raise ClientsSetupError(
            f"setting up the clients' virtualenv failed: {' '.join(argv)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}\n"
            f"Set SPECULA_CLIENTS_PYTHON to an interpreter that has {CLIENTS_REQUIREMENTS.name} installed.")


@functools.cache
def clients_python() -> str:
    """An interpreter that imports the published `text_generation` and `lorax` clients (set up if needed)."""
    override = os.environ.get("SPECULA_CLIENTS_PYTHON")
    if override:
        if not _importable(override):
            raise ClientsSetupError(f"SPECULA_CLIENTS_PYTHON={override} cannot import the clients")
        return override
    python = CLIENTS_VENV / "bin" / "python"
    if python.exists() and _importable(str(python)):
        return str(python)
    if not python.exists():
        _run_setup([sys.executable, "-m", "venv", str(CLIENTS_VENV)])
    _run_setup([str(python), "-m", "pip", "install", "-q", "-r", str(CLIENTS_REQUIREMENTS)])
    if not _importable(str(python)):
        raise ClientsSetupError("the clients' virtualenv was set up but cannot import them")
    return str(python)
