#!/usr/bin/env bash
# Runs the kernel tests against Triton 3.6's front end: the oldest Triton found on our GPU
# machines. The default tier runs them on the Triton the .venv has (newer); an API that only the
# newer one has would pass there and fail on those machines. Interpreter only (TRITON_INTERPRET=1):
# it checks the language surface the kernels use, not code generation — that needs a GPU.
# Triton 3.6 (with numpy 2.2: its interpreter calls int() on one-element arrays, which newer
# numpy refuses) goes into a folder of its own that shadows the .venv's on PYTHONPATH.
#   scripts/check_triton36.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SPECDECODE_VENV:-.venv}
TARGET="$VENV/triton-3.6"
[ -x "$VENV/bin/python" ] || { echo "check_triton36.sh: run scripts/bootstrap.sh first" >&2; exit 2; }
if [ ! -f "$TARGET/triton/__init__.py" ]; then
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --target "$TARGET" "triton==3.6.0" "numpy==2.2.6"
fi
export PYTHONPATH="$PWD/$TARGET" TRITON_INTERPRET=1
"$VENV/bin/python" -P -c 'import triton; assert triton.__version__.startswith("3.6"), triton.__file__; print("triton", triton.__version__, "from", triton.__file__)'
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_kernels_ngram.py tests/test_kernels_verify.py tests/test_kernels_fused.py "$@"
