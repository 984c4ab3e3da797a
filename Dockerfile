# Specula server image: the launcher starts the model shards and the router (see README.md).
#
#   docker build -t specula .                          # CUDA (default)
#   docker build -t specula-cpu --build-arg BASE=cpu .  # CPU only
#   docker run --gpus all --shm-size 1g -p 8080:80 -v $PWD/data:/data specula \
#       --model-id meta-llama/Llama-3.1-8B-Instruct --speculative-tokens 3
#
# Without --model-id the image serves the small random-weight demo model bundled in the package. Every flag
# also reads an environment variable (-e MODEL_ID=..., -e NUM_SHARD=2, ...). Models are cached in /data.
# On `docker stop` the router drains in-flight requests for up to --shutdown-timeout (30 s) before the shards
# stop: give it the time with `docker stop -t 45`. `docker run --init` reaps any orphaned helper processes.
# The BASE stage is picked with BuildKit (Docker's default builder); the legacy builder builds both.

ARG BASE=cuda
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04

# --- CUDA: torch's CUDA wheels carry their own CUDA libraries; the image brings the runtime and the driver
# hook. gcc and the Python headers are there because Triton (shipped with CUDA torch) compiles small C
# launchers the first time a kernel runs. Match TORCH_INDEX_URL to CUDA_IMAGE's CUDA version.
FROM ${CUDA_IMAGE} AS base-cuda
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}

# --- CPU
FROM python:3.11-slim AS base-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}

# --- Specula itself, installed as the README installs it. pyproject pins torch==2.13.0, which the torch
# already installed above satisfies (2.13.0+cu130 / 2.13.0+cpu), so pip keeps it and adds only the other
# dependencies declared in pyproject.toml.
FROM base-${BASE}
WORKDIR /opt/specula
# The package roots listed in pyproject.toml [tool.setuptools.packages.find], plus the files it reads.
COPY pyproject.toml README.md ./
COPY proto proto
COPY kernels kernels
COPY server server
COPY router router
COPY launcher launcher
RUN pip install --no-cache-dir . && rm -rf build

ENV HUGGINGFACE_HUB_CACHE=/data PORT=80 SPECULA_HOSTNAME=0.0.0.0 PYTHONUNBUFFERED=1
VOLUME /data
WORKDIR /data
EXPOSE 80
ENTRYPOINT ["specula-launcher"]
