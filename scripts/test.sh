#!/usr/bin/env bash
# Installs Specula with its test dependencies into the active Python environment and runs every test.
# torch is pinned to 2.13.0 in pyproject.toml, so a CPU machine with that wheel available installs it directly.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[dev]"
# Optional: suffix decoding's native trees (Arctic Inference's C++ suffix tree, docs/speculation.md). A source
# package whose declared build environment installs an unpinned torch (its vLLM integration is an extra), so it
# is built against the torch installed above, without build isolation or dependencies (about 30 s on 2 cores).
# If it does not build, suffix decoding runs on its Python trees and the native backend's tests are skipped.
if python -m pip install -q "setuptools>=61" wheel numpy nanobind==2.9.2 cmake ninja \
    && python -m pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0; then
    :
else
    echo "scripts/test.sh: arctic-inference did not build; suffix decoding will use its Python trees" >&2
fi
# Lint first (the rules are pyproject.toml's [tool.ruff]): a finding fails the run like a failing test.
python -m ruff check .
python -m pytest -q "$@"
