#!/usr/bin/env bash
# The gpu test tier (tests/test_cuda.py: compiled Triton kernels against their references, the
# engine's greedy equivalence on CUDA; the fused norm/RoPE/SiLU kernels; device-side uniforms) and the kernel benchmark, run from source on a CUDA machine.
# No `pip install -e .` there: its torch pin would replace the machine's CUDA torch. Two halves:
#   scripts/gpu_check.sh fetch         here: wheels of what GPU machines lack (pydantic, tokenizers,
#                                      pytest, matplotlib, ...) for their Python into .gpu-wheels/,
#                                      and SmolLM2-135M's config and tokenizer (no weights) into
#                                      .gpu-model/
#   scripts/gpu_check.sh run [ARGS]    there: install those wheels into a scratch folder with
#                                      --no-deps (the machine's torch and triton stay as they are),
#                                      then `pytest -m gpu` with TRITON_INTERPRET=0 and ARGS, then
#                                      `specdecode bench-kernels` and `specdecode bench-step` (dummy
#                                      weights of .gpu-model/; eager, then CUDA graphs) into
#                                      ${OUT:-bench-results}
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=.gpu-wheels
MODEL_SHAPE=.gpu-model  # bench-step's model there: the 98 MB GGUF is over what travels to the machine
GPU_PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions pyyaml
          pytest pluggy iniconfig packaging pygments
          tokenizers safetensors jinja2 markupsafe numpy gguf tqdm llguidance
          matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six)

case "${1:-}" in
  fetch)
    mkdir -p "$WHEELS"
    PIP=.venv/bin/pip; [ -x "$PIP" ] || PIP="python3 -m pip"
    $PIP download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$WHEELS" \
      --python-version "$GPU_PYTHON_VERSION" --implementation cp \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      "${PACKAGES[@]}"
    du -sh "$WHEELS"
    PYTHON=.venv/bin/python; [ -x "$PYTHON" ] || PYTHON=python3
    $PYTHON -P -c 'import sys, pathlib; from specdecode.runtime.models.loader import save_model_shape
save_model_shape("smollm2-135m", pathlib.Path(sys.argv[1]))' "$MODEL_SHAPE"
    du -sh "$MODEL_SHAPE"
    ;;
  run)
    shift
    SITE=${TMPDIR:-/tmp}/specdecode-gpu-site
    if [ ! -d "$SITE/specdecode" ]; then
      python3 -m pip install --quiet --disable-pip-version-check --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    fi
    mkdir -p "$SITE/specdecode"  # the package-dir mapping of pyproject.toml, as links
    for part in runtime kernels operator bench; do ln -sfn "$PWD/$part" "$SITE/specdecode/$part"; done
    export PYTHONPATH="$SITE" TRITON_INTERPRET=0
    python3 -P -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
    rc=0
    # the real control plane tier's plugins (conftest.py) need kubernetes, which the gpu tier does not
    python3 -P -m pytest -q -m gpu -p no:cacheprovider -p no:realk8s -p no:realk8s_operator -p no:realk8s_cluster \
      tests/test_cuda.py tests/test_kernels_fused.py tests/test_rng_device.py "$@" || rc=$?
    python3 -P -m specdecode.runtime.cli bench-kernels --output-dir "${OUT:-bench-results}" || rc=$?
    if [ -d "$MODEL_SHAPE" ]; then
      for graphs in off cuda; do  # eager, then each batch bucket's forward replayed as a CUDA graph
        python3 -P -m specdecode.runtime.cli bench-step --model "$MODEL_SHAPE" --load-format dummy --device cuda \
          --graphs "$graphs" --rounds 1 --output-dir "${OUT:-bench-results}" || rc=$?
      done
    fi
    exit $rc
    ;;
  *)
    echo "usage: scripts/gpu_check.sh fetch | run [pytest args]" >&2
    exit 2
    ;;
esac
