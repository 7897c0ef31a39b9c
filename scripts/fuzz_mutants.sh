#!/usr/bin/env bash
# Shows that the engine fuzzer's default seeds catch fixes 1, 2 and 5 of issue 26 when each is
# reverted on its own, in a scratch copy of the working tree (this checkout is never touched):
#   1  the look-ahead's decode rows are scheduled in admission order (scheduler.py), so a decode
#      row never preempts one already scheduled;
#   2  a sequence preempted and then finished or aborted before the next launch is only "gone" in
#      the pipeline's TailPlan (pipeline.py);
#   5  the look-ahead reserves each deciding sequence's own draft cap, not the global K (llm_engine.py).
# Each mutant runs tests/test_engine_fuzz.py with the default seeds (-x: up to the first failure)
# and must fail; the script prints the failure and exits non-zero if any mutant survives.
# Usage: scripts/fuzz_mutants.sh [extra pytest args]   (after `make bootstrap`)
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
SCRATCH="$(mktemp -d)"
trap 'rm -rf "$SCRATCH"' EXIT

declare -A FILE OLD NEW
FILE[1]=runtime/engine/scheduler.py
OLD[1]='        for seq in [seq for seq in self.running if seq.seq_id in wanted]:'
NEW[1]='        for seq in seqs:'
FILE[2]=runtime/parallel/pipeline.py
OLD[2]='            self._preempted.pop(seq.seq_id, None)
'
NEW[2]=''
FILE[5]=runtime/engine/llm_engine.py
OLD[5]='        k = self.load_control.max_k(len(self.scheduler.running)) if self.proposer is not None else 0
        return sum(1 + draft_cap(item.seq, k, self.max_model_len) for item in deciding)'
NEW[5]='        return len(deciding) * (1 + (self.load_control.k if self.proposer is not None else 0))'

survived=()
for fix in 1 2 5; do
  dir="$SCRATCH/revert-$fix"
  mkdir -p "$dir/_pkg/specdecode"
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$dir"
  for part in runtime kernels operator; do ln -s "$dir/$part" "$dir/_pkg/specdecode/$part"; done
  "$PY" -P - "$dir/${FILE[$fix]}" "${OLD[$fix]}" "${NEW[$fix]}" <<'EOF' || exit 2
import sys
path, old, new = sys.argv[1:]
text = open(path).read()
if text.count(old) != 1:
    sys.exit(f"{path}: the fixed code to revert was not found once; update scripts/fuzz_mutants.sh")
open(path, "w").write(text.replace(old, new))
EOF
  echo "=== fix $fix reverted (${FILE[$fix]})"
  started=$SECONDS
  # PYTHONPATH puts the scratch copy's packages before the editable install of this checkout
  (cd "$dir" && PYTHONPATH="$dir/_pkg" "$PY" -P -m pytest tests/test_engine_fuzz.py -x -q -p no:randomly \
     --no-header -W ignore::DeprecationWarning "$@" > "$dir/pytest.log" 2>&1)
  rc=$?
  if [ $rc -eq 1 ]; then
    echo "caught in $((SECONDS - started)) s:"
    grep -E "^(FAILED|E +(AssertionError: fuzz seed|replay:|.*Error))" "$dir/pytest.log" | head -6
  else
    echo "SURVIVED (pytest exit $rc after $((SECONDS - started)) s):"; tail -5 "$dir/pytest.log"
    survived+=("$fix")
  fi
done
if [ ${#survived[@]} -gt 0 ]; then
  echo "mutants not caught: ${survived[*]}"; exit 1
fi
echo "every reverted fix was caught by the default seeds"
