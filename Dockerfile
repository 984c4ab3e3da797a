# Specula server image: the launcher starts the model shards and the router (see README.md, docs/deployment.md).
#
#   docker build -t specula .                      # CUDA (the default target, `--target cuda`)
#   docker build -t specula-cpu --target cpu .     # CPU only
#   docker run --gpus all --shm-size 1g -p 8080:80 -v $PWD/data:/data -e HF_TOKEN specula \
#       --model-id meta-llama/Llama-3.1-8B-Instruct --speculative-tokens 3
#
# The base images and torch's package index are build arguments (CPU_IMAGE, CUDA_IMAGE, TORCH_INDEX_URL): for a
# machine without the registry or PyTorch's index, see docs/deployment.md and scripts/docker-cpu-image.sh.
#
# Without --model-id the image serves the small random-weight demo model bundled in the package. Every flag
# also reads an environment variable (-e MODEL_ID=..., -e NUM_SHARD=2, ...); HF_TOKEN is read for gated models.
# HF_HOME is /data as in TGI's image, so the Hub cache (/data/hub) and a saved token survive in the volume and a
# TGI volume is reused as it is. The server runs as the unprivileged user `specula` (uid 10001): the volume must
# be writable by it (`chown -R 10001 data`, or `docker run --user $(id -u)` with a directory of your own).
# On `docker stop` the router drains in-flight requests for up to --shutdown-timeout (30 s) before the shards
# stop: give it the time with `docker stop -t 45`. `docker run --init` reaps any orphaned helper processes.
#
# No attention library (flash-attn, FlashInfer) is installed, and none is needed: attention is the paged
# attention in kernels/ written in PyTorch, and the Triton kernels use the Triton that CUDA torch brings.

# Base images, by tag (the CUDA one is explained with its stage below).
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG CPU_IMAGE=python:3.11-slim-bookworm

FROM ${CPU_IMAGE} AS base-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# g++ builds the native int8/int4 kernels for the CPU the container runs on, the first time --quantize needs them
# (kernels/specula_kernels/native.py; without it the worker uses PyTorch's slower kernels). Debian's g++ of the
# base image's release, unpinned as the CUDA stage's gcc: a pin would break with the next point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}

# --- The package sources, as pyproject.toml [tool.setuptools.packages.find] lists their roots, plus the files
# it reads; not testing/ (the test helpers, specula_testing, which the server never imports). One stage, so the
# two images below copy the same tree.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY proto /src/proto
COPY kernels /src/kernels
COPY server /src/server
COPY router /src/router
COPY launcher /src/launcher

# --- The two images, the CPU one first so that even the legacy builder never pulls the CUDA base for it.
# Docker has no include, so their last steps are written twice; launcher/tests/test_dockerfile.py
# checks that both stages carry them. pyproject pins torch==2.13.0, which the torch each base installs satisfies
# (2.13.0+cu130 / 2.13.0+cpu), so pip keeps it and adds only the other dependencies.
FROM base-cpu AS cpu
COPY --from=source /src /opt/specula
RUN pip install --no-cache-dir /opt/specula && rm -rf /opt/specula/build \
    && groupadd --gid 10001 specula && useradd --create-home --uid 10001 --gid 10001 specula \
    && mkdir -p /data && chown specula:specula /data
ENV HF_HOME=/data PORT=80 SPECULA_HOSTNAME=0.0.0.0 PYTHONUNBUFFERED=1
VOLUME /data
WORKDIR /data
# Docker lets an unprivileged process bind ports below 1024 inside a container; elsewhere set PORT=8080.
USER 10001:10001
EXPOSE 80
# Generous start period: the first start downloads the model. /health answers 503 until the shards are ready.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; \
        urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '80'), timeout=4)"]
ENTRYPOINT ["specula-launcher"]

# --- CUDA 13.0 runtime: needs an NVIDIA driver of branch 580 or newer on the host (`nvidia-smi` shows the
# version). For an older driver (branch 570: CUDA 12.8), build with CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# and TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128, where PyTorch publishes that build of the torch
# pinned below. torch's CUDA wheels carry their own CUDA libraries; the image brings the runtime and the driver
# hook. gcc and the Python headers are there because Triton compiles small C launchers the first time a kernel runs.
FROM ${CUDA_IMAGE} AS base-cuda
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ENV DEBIAN_FRONTEND=noninteractive
# Unpinned on purpose: Ubuntu's security updates replace these versions in the archive, so a pin breaks the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}

FROM base-cuda AS cuda
COPY --from=source /src /opt/specula
RUN pip install --no-cache-dir /opt/specula && rm -rf /opt/specula/build \
    && groupadd --gid 10001 specula && useradd --create-home --uid 10001 --gid 10001 specula \
    && mkdir -p /data && chown specula:specula /data
ENV HF_HOME=/data PORT=80 SPECULA_HOSTNAME=0.0.0.0 PYTHONUNBUFFERED=1
VOLUME /data
WORKDIR /data
# Docker lets an unprivileged process bind ports below 1024 inside a container; elsewhere set PORT=8080.
USER 10001:10001
EXPOSE 80
# Generous start period: the first start downloads the model. /health answers 503 until the shards are ready.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; \
        urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PORT', '80'), timeout=4)"]
ENTRYPOINT ["specula-launcher"]
