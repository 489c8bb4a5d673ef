#!/usr/bin/env bash
# The README's main command, run as a user runs it (issue 17, item 17): `scripts/demo.sh`
# must exit 0 and print every part it promises. Runs from the source tree on the Release
# build directory `build` (what the script itself builds).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp)
trap 'rm -f "$out"' EXIT
scripts/demo.sh >"$out" 2>&1
rc=$?
fail=0
if ((rc != 0)); then
  echo "FAIL: scripts/demo.sh exited $rc"
  fail=1
fi
for want in "== eplbx demo --serve" "tokens/s" "oracle " \
    "every row a step used checked against its map: yes" \
    "verified: yes, weights intact: yes" "== eplbx plan: DeepSeek-V3 shape" \
    "balancedness (mean / max rank load, 1 = perfect): total" "  rank 31 " \
    "full plan (JSON): build/dsv3_plan.json" "policies side by side" \
    "balanced, 4 node(s)" "incremental from the deepseek plan, 4 node(s)"; do
  if ! grep -qF -- "$want" "$out"; then
    echo "FAIL: scripts/demo.sh did not print: $want"
    fail=1
  fi
done
for mode in off sync async; do
  if ! grep -qE "^$mode +[0-9]+ +[0-9.]+ " "$out"; then
    echo "FAIL: the serving table has no row for $mode"
    fail=1
  fi
done
if ((fail)); then
  tail -n 40 "$out"
  echo "0 passed, 1 failed"
  exit 1
fi
echo "scripts/demo.sh exited 0 and printed every part ($(wc -l <"$out") lines)"
