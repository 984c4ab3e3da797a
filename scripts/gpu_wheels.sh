#!/usr/bin/env bash
# Downloads the wheels the GPU check machine lacks into .gpu-wheels/ (git-ignored), for Python 3.12 on
# manylinux x86_64, so that scripts/gpu_check.sh can install them there without a network.
#
# That machine has its own torch (2.11.0+cu130), Triton, grpcio, protobuf, typer, safetensors, tokenizers,
# transformers, peft, jinja2, huggingface_hub, uvloop and pytest, but not the router's web stack, llguidance or
# gguf. Exactly those wheels come here, each without its dependencies, at the versions this repository is tested
# with, plus the small pure-Python dependencies the machine may lack or hold too old (anyio, click, requests, ...):
# scripts/gpu_check.sh installs with pip's resolver over this folder, which keeps what the machine has when it
# satisfies the requirement and takes the rest from here. protobuf and grpcio come too: the generated modules in
# proto/ refuse a runtime older than the one they were generated for (protobuf 7.35, grpcio 1.85.1). The folder travels with the working tree, whose whole carry is capped
# at 64 MiB: the script fails when the folder grows past WHEELS_MAX_MIB (default 48).
#
#   scripts/gpu_wheels.sh [--list]     # --list: print the requirements and exit
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}"
MAX_MIB="${WHEELS_MAX_MIB:-48}"

# name==version: what the project imports on the worker (llguidance, gguf) and the router (the rest), plus their
# dependencies outside the machine's list.
REQUIREMENTS=(
    fastapi==0.165.0
    starlette==1.10.0
    annotated-doc==0.0.7
    opentelemetry-api==1.45.2
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    uvicorn==0.54.0
    h11==0.16.0
    llguidance==1.9.1
    gguf==0.19.0
    anyio==4.16.0
    idna==3.20
    click==8.5.1
    typing-extensions==4.16.0
    requests==2.34.2
    urllib3==2.8.0
    certifi==2026.10.19.post1
    charset-normalizer==3.5.3
    pyyaml==6.0.4
    tqdm==4.70.1
    protobuf==7.36.2
    grpcio==1.85.3
)

if [[ "${1:-}" == "--list" ]]; then
    printf '%s\n' "${REQUIREMENTS[@]}"
    exit 0
fi

mkdir -p "$DEST"
python -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "${REQUIREMENTS[@]}"

size_kib=$(du -sk "$DEST" | cut -f1)
echo "$(find "$DEST" -name '*.whl' | wc -l) wheels, $((size_kib / 1024)) MiB in $DEST"
if (( size_kib > MAX_MIB * 1024 )); then
    echo "error: $DEST is over ${MAX_MIB} MiB" >&2
    exit 1
fi
