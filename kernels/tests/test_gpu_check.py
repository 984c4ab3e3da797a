"""scripts/gpu_check.sh and scripts/gpu_wheels.sh, checked on CPU: the dry run lists every step without running
one, every CUDA test is where the check looks, and every requirement is on the GPU machine or in its wheels."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the GPU machine has of the project's requirements, as listed for it (torch 2.11.0+cu130, Python 3.12).
ON_THE_GPU_MACHINE = {"grpcio", "protobuf", "typer", "prometheus-client", "safetensors", "tokenizers",
                      "huggingface-hub", "jinja2", "tqdm", "numpy"}


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def dry_run(out: Path) -> str:
    """The dry run's listing (its requirements read by this Python: the script needs 3.11's tomllib)."""
    if sys.version_info < (3, 11):
        pytest.skip("gpu_check.sh reads pyproject.toml with Python 3.11's tomllib")
    result = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run"],
                            env={"OUT": str(out), "PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_dry_run_lists_every_step_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    text = dry_run(out)
    for step in ("environment", "install", "imports", "pytest", "benchmark"):
        assert f"step {step} (limit" in text, text
    assert "pytest -m cuda" in text and "benchmark/cuda_decode.py" in text and "--no-index" in text
    limits = [int(s) for s in re.findall(r"\(limit (\d+) s", text)]
    assert sum(limits) <= 7.5 * 60, limits  # bounded: the whole check within 8 minutes, with room to start
    assert not out.exists()


def test_every_cuda_test_is_where_the_check_runs_them():
    marked = {p.relative_to(ROOT).parts[:2] for tests in ("kernels", "server", "router", "launcher")
              for p in (ROOT / tests / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text()}
    marked |= {("integration-tests",) for p in (ROOT / "integration-tests").rglob("*.py")
               if "mark.cuda" in p.read_text()}
    assert marked == {("kernels", "tests"), ("server", "tests")}
    assert "kernels/tests/test_*.py server/tests/test_*.py" in (ROOT / "scripts/gpu_check.sh").read_text()


def test_every_requirement_is_on_the_gpu_machine_or_in_its_wheels(tmp_path):
    listed = subprocess.run(["bash", str(ROOT / "scripts/gpu_wheels.sh"), "--list"], capture_output=True, text=True,
                            check=True, timeout=60).stdout.split()
    wheels = {requirement_name(r) for r in listed}
    assert all("==" in r for r in listed), listed  # pinned: the versions the project is tested with
    text = dry_run(tmp_path / "out")
    dependencies = text.split("requirements installed from the wheel folder when missing:\n")[1].split("then:")[0]
    needed = {requirement_name(r.strip()) for r in dependencies.splitlines()}
    assert "fastapi" in needed and "torch" not in needed
    assert needed - ON_THE_GPU_MACHINE - wheels == set()


def test_the_wheel_folder_is_ignored_and_small():
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", ".gpu-wheels/a.whl"], timeout=30)
    assert ignored.returncode == 0
    folder = ROOT / ".gpu-wheels"
    if not folder.is_dir():
        pytest.skip("scripts/gpu_wheels.sh has not been run here")
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 48 * 2**20, size  # the working tree's whole carry is capped at 64 MiB
