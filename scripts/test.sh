#!/usr/bin/env bash
# Installs Specula with its test dependencies into the active Python environment and runs every test.
# torch is pinned to 2.13.0 in pyproject.toml, so a CPU machine with that wheel available installs it directly.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[dev]"
python -m pytest -q "$@"
