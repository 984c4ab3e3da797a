#!/usr/bin/env bash
# The CUDA path in one run on a GPU machine: environment, dependencies, imports, every CUDA test, a benchmark.
#
# Runs on the machine's own Python and torch (it need not be the pinned 2.13: the check was prepared for
# 2.11.0+cu130, Python 3.12, Triton 3.6). The project is not installed: its packages go on PYTHONPATH, and
# dependencies the machine lacks come from .gpu-wheels/ (scripts/gpu_wheels.sh fetches them on a machine with a
# network; the folder is git-ignored and travels with the working tree). Each step has its own time limit, so the
# whole check ends within about 7.5 minutes on one H100; a step that fails is reported and the next ones still run.
#
#   scripts/gpu_check.sh [--dry-run]     # --dry-run: list the steps and their commands, run nothing
#
# Writes to $OUT (default ./gpu-check-out): report.md (the summary), environment.txt, install.log, imports.log,
# pytest.log + pytest.xml, benchmark.log + benchmark.json. Exits 0 when the imports, the CUDA tests and the
# benchmark all passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-check-out}"
WHEELS="${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}"
PYTHON="${PYTHON:-python3}"
DRY_RUN=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
    esac
done
export ROOT OUT WHEELS PYTHON
export PYTHONPATH="$ROOT/server:$ROOT/kernels:$ROOT/proto:$ROOT/router:$ROOT/launcher:$ROOT/testing${PYTHONPATH:+:$PYTHONPATH}"

# Seconds per step: 20 + 75 + 45 + 210 + 90 = 440. The benchmark also gets what the earlier steps left of
# those 440 s (it writes its results after every configuration, so a limit leaves the ones that ran).
TOTAL_LIMIT=440
ENV_LIMIT=20
INSTALL_LIMIT=75
IMPORT_LIMIT=45
PYTEST_LIMIT=210
BENCH_LIMIT=90

# The project's requirements except torch (the machine's own), read from pyproject.toml.
requirements() {
    "$PYTHON" - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
for req in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]:
    if not req.replace(" ", "").startswith("torch"):
        print(req.split(";")[0].strip())
EOF
}

step_environment() {
    nvidia-smi
    "$PYTHON" -c "import sys, torch; print('python', sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    "$PYTHON" -c "import triton; print('triton', triton.__version__)"
    "$PYTHON" -m pip list
}

step_install() {
    # Only the requirements the machine does not satisfy, in one pip call; when that fails, one at a time, so
    # that one the folder lacks does not keep the others out.
    local missing
    missing=$(requirements | "$PYTHON" -c '
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
for line in sys.stdin:
    req = Requirement(line.strip())
    try:
        ok = req.specifier.contains(version(req.name), prereleases=True)
    except PackageNotFoundError:
        ok = False
    print("satisfied:" if ok else "missing:", req, file=sys.stderr)
    if not ok:
        print(req)
')
    [[ -z "$missing" ]] && return 0
    # shellcheck disable=SC2086  # one requirement per word
    "$PYTHON" -m pip install --no-index --find-links "$WHEELS" $missing && echo "ok: installed" $missing && return 0
    local failed=0
    while read -r req; do
        if "$PYTHON" -m pip install --no-index --find-links "$WHEELS" "$req"; then
            echo "ok: $req"
        else
            echo "FAILED: $req"
            failed=1
        fi
    done <<< "$missing"
    return $failed
}

step_imports() {
    "$PYTHON" - <<'EOF'
import importlib
modules = ["specula_kernels.paged_attention", "specula_kernels.triton_paged_attention", "specula_kernels.sgmv",
           "specula_server.server", "specula_server.service", "specula_server.cli", "specula_router.server",
           "specula_router.cli", "specula_launcher.cli", "specula_testing.worker"]
failed = 0
for name in modules:
    try:
        importlib.import_module(name)
        print("ok:", name)
    except Exception as error:
        failed = 1
        print("FAILED:", name, repr(error))
raise SystemExit(failed)
EOF
}

step_pytest() {
    # Every test marked cuda: they live in kernels/tests and server/tests (kernels/tests/test_gpu_check.py keeps
    # it so); only the files that hold one are collected (the others may import dev-only packages this machine
    # lacks). A file that cannot be collected is listed and does not stop the others; the step passes when no
    # collected CUDA test failed and at least one passed.
    local files
    files=$(cd "$ROOT" && grep -l "mark.cuda" kernels/tests/test_*.py server/tests/test_*.py)
    # shellcheck disable=SC2086  # one path per word
    (cd "$ROOT" && "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider --continue-on-collection-errors \
        --junitxml="$OUT/pytest.xml" -rfEs $files)
    "$PYTHON" - "$OUT/pytest.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
def uncollected(case):
    error = case.find("error")
    return error is not None and error.get("message") == "collection failure"
failed = [c for c in cases if (c.find("failure") is not None or c.find("error") is not None) and not uncollected(c)]
not_collected = [c.get("name") for c in cases if uncollected(c)]
passed = [c for c in cases if not list(c)]
print(f"cuda tests: {len(passed)} passed, {len(failed)} failed, files not collected: {not_collected or 'none'}")
raise SystemExit(1 if failed or not passed else 0)
EOF
}

step_benchmark() {
    "$PYTHON" "$ROOT/benchmark/cuda_decode.py" --json "$OUT/benchmark.json"
}

STEPS=(environment install imports pytest benchmark)
declare -A LIMIT=([environment]=$ENV_LIMIT [install]=$INSTALL_LIMIT [imports]=$IMPORT_LIMIT [pytest]=$PYTEST_LIMIT
                  [benchmark]=$BENCH_LIMIT)
declare -A LOG=([environment]=environment.txt [install]=install.log [imports]=imports.log [pytest]=pytest.log
                [benchmark]=benchmark.log)
declare -A STATUS=()

if (( DRY_RUN )); then
    echo "gpu_check dry run: writes to $OUT, Python $PYTHON, wheels from $WHEELS"
    for step in "${STEPS[@]}"; do
        echo "step $step (limit ${LIMIT[$step]} s, log $OUT/${LOG[$step]}):"
        declare -f "step_$step" | sed -n '3,$p' | sed '$d' | sed 's/^/    /'
    done
    echo "requirements installed from the wheel folder when missing:"
    requirements | sed 's/^/    /'
    echo "then: $OUT/report.md"
    exit 0
fi

mkdir -p "$OUT"
started=$(date +%s)
for step in "${STEPS[@]}"; do
    if [[ $step == benchmark ]]; then
        left=$(( TOTAL_LIMIT - ($(date +%s) - started) ))
        (( left > LIMIT[benchmark] )) && LIMIT[benchmark]=$left
    fi
    echo "== $step (limit ${LIMIT[$step]} s)"
    # The functions run in a child bash under timeout, so a step that hangs is killed at its limit.
    timeout --kill-after=10 "${LIMIT[$step]}" bash -c "$(declare -f requirements "step_$step"); step_$step" \
        > "$OUT/${LOG[$step]}" 2>&1
    rc=$?
    case $rc in
        0) STATUS[$step]="passed" ;;
        124|137) STATUS[$step]="timed out after ${LIMIT[$step]} s" ;;
        *) STATUS[$step]="failed (exit $rc)" ;;
    esac
    echo "   ${STATUS[$step]}"
done
elapsed=$(( $(date +%s) - started ))

{
    echo "# GPU check"
    echo
    echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git'), ${elapsed} s in all"
    echo
    echo '```'
    grep -E '^(python|torch|triton) ' "$OUT/environment.txt" || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    echo '```'
    echo
    echo "| step | result | log |"
    echo "|---|---|---|"
    for step in "${STEPS[@]}"; do
        echo "| $step | ${STATUS[$step]} | ${LOG[$step]} |"
    done
    echo
    echo "## Install"
    echo '```'
    grep -E '^(ok|FAILED|missing):' "$OUT/install.log" || echo "every requirement satisfied"
    echo '```'
    echo "## Imports"
    echo '```'
    cat "$OUT/imports.log"
    echo '```'
    echo "## CUDA tests"
    echo '```'
    grep -E '^(FAILED|ERROR|SKIPPED)|passed|failed|^cuda tests:' "$OUT/pytest.log" | tail -40 || true
    echo '```'
    echo "## Benchmark"
    "$PYTHON" - "$OUT/benchmark.json" <<'EOF' || echo "(no benchmark results)"
import json, sys
report = json.load(open(sys.argv[1]))
print(f"{report['gpu']}, torch {report['torch']}, random Llama {report['model']}, bfloat16, "
      f"{report['prompt_tokens']}-token prompts, {report['new_tokens']} new tokens per stream; graphs captured: "
      f"{report.get('graphs_captured', 'none: ' + str(report.get('graphs_unavailable')))} "
      f"(captured ahead in {report.get('capture_s')} s)\n")
print("| step path | speculation | streams | tokens/s | ms/step | accepted/drafted | same tokens as SDPA |")
print("|---|---|---|---|---|---|---|")
for r in report["runs"]:
    print(f"| {r['attention']} | {r['speculation']} | {r['streams']} | {r['tokens_per_s']} | {r['ms_per_step']} | "
          f"{r['accepted']}/{r['drafted']} | {r.get('same_tokens_as_sdpa', '')} |")
for e in report["errors"]:
    print(f"\nFAILED {e['run']}: {e['error']}\n```\n{e['trace'][-3000:]}\n```")
EOF
} > "$OUT/report.md"
cat "$OUT/report.md"

[[ "${STATUS[imports]}" == passed && "${STATUS[pytest]}" == passed && "${STATUS[benchmark]}" == passed ]]
