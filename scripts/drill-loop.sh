#!/usr/bin/env bash
# Runs N serving drills with real rank processes (docs/reliability.md, "Fault matrix"):
# `eplbx demo --serve --inject kill|stop:RANK@STEP` (45 % / 20 %), the same with a second rank
# killed or stopped during the recovery (`--inject ...,kill|stop:RANK2@recovery`, 5 ranks;
# 10 %), `--resize remove|add:RANK@STEP` (10 % / 10 %), or a sequence (5 %: two ranks lost at
# separate steps, then the first one's process started again, 6 ranks: `--inject
# kill|stop:A@S1,kill|stop:B@S2 --resize add:A@S3`) with the kind, rank, step, mode and
# commit mode drawn per drill (drill i draws the same on every run), and checks each one: exit
# 0, the loss or removal detected at its step (a new rank: joined at or after it, with steps
# to serve), the members re-placed and served on with every row they used at every step
# checked (bad_rows 0), all within a time limit (no hang). Prints a line per drill and a JSON
# summary (last line).
#
#   scripts/drill-loop.sh [N=50]      # EPLBX_CLI: the eplbx binary (build/bin/eplbx)
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-50}
cli=${EPLBX_CLI:-build/bin/eplbx}
py=$(command -v python3 || echo /usr/bin/python3)
[[ -x "$cli" ]] || { echo "drill-loop: no $cli (scripts/build.sh first)" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
failed=0
for i in $(seq 1 "$n"); do
  RANDOM=$((i * 7919))
  kind=kill; k=$((RANDOM % 20)); ((k >= 9)) && kind=stop; ((k >= 13)) && kind=twice
  ((k >= 15)) && kind=remove; ((k >= 17)) && kind=add; ((k >= 19)) && kind=sequence
  steps=50; [[ $kind == add || $kind == sequence ]] && steps=300  # while a new process starts
  rank=$((RANDOM % 4)); ranks=4
  step=$((2 + RANDOM % 46))
  modes=(async async sync off); mode=${modes[$((RANDOM % 4))]}
  spare=0; ((RANDOM % 3 == 0)) && spare=6
  if [[ $kind == twice ]]; then
    # A second rank (another one of 5) killed or stopped as the survivors' move begins.
    ranks=5; second=$(((rank + 1 + RANDOM % 4) % 5)); kinds=(kill stop)
    first=${kinds[$((RANDOM % 2))]}; again=${kinds[$((RANDOM % 2))]}
  fi
  if [[ $kind == sequence ]]; then
    ranks=6; second=$(((rank + 1 + RANDOM % 5) % 6)); kinds=(kill stop)
    first=${kinds[$((RANDOM % 2))]}; again=${kinds[$((RANDOM % 2))]}
    step2=$((step + 20 + RANDOM % 40)); step3=$((step2 + 20 + RANDOM % 40))
  fi
  args="--serve --json --ranks $ranks --layers 3 --experts 16 --slots-per-rank 6 --expert-bytes 64K
        --steps $steps --interval 8 --tokens 64 --top-k 4 --work-bytes 1K --deadline 2
        --modes $mode --spare-rows $spare"
  case $kind in
    remove | add) args+=" --resize $kind:$rank@$step" ;;
    twice) args+=" --inject $first:$rank@$step,$again:$second@recovery"; kind="$first:$rank@$step,$again:$second@recovery" ;;
    sequence)
      args+=" --inject $first:$rank@$step,$again:$second@$step2 --resize add:$rank@$step3"
      kind="$first:$rank@$step,$again:$second@$step2,add:$rank@$step3" ;;
    *) args+=" --inject $kind:$rank@$step" ;;
  esac
  # shellcheck disable=SC2086
  timeout 120 "$cli" demo $args >"$out/$i.json" 2>"$out/$i.err"
  rc=$?
  line=$("$py" - "$out/$i.json" "$rc" "$step" "$kind" "$steps" <<'EOF'
import json, sys
path, rc, step, kind, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
try:
    j = json.load(open(path))
except Exception:
    print(f"FAIL rc {rc}: no report"); sys.exit(0)
d = j.get("drill", {})
at = d.get("detected_step", -1)
on_time = step <= at < steps - 1 if kind == "add" else at == step
# A second loss during the recovery: the survivors placed twice. A sequence: three events,
# loss, loss, join.
again = d.get("placements") == 2 if "recovery" in kind else True
if kind.count(",") == 2:
    again = [e.get("kind") for e in d.get("events", [])] == ["loss", "loss", "join"]
ok = (rc == 0 and j.get("verified") and j.get("bad_rows") == 0 and on_time and again and
      "error" not in j)
when = "mid-rebalance" if d.get("interrupted_rebalance") else "between rebalances"
print(("ok" if ok else f"FAIL rc {rc}") +
      f" recovery {d.get('recovery_s', -1):.3f} s, {when}, {d.get('experts_recovered')} experts"
      f" restored, at step {at}, rows checked {j.get('rows_checked')}, bad {j.get('bad_rows')}" +
      ("" if ok else f": {j.get('error', '')[:300]}"))
EOF
)
  [[ $kind == *,* ]] || kind="$kind:$rank@$step"
  echo "drill $i: $kind --modes $mode --spare-rows $spare: $line"
  [[ $line == ok* ]] || failed=$((failed + 1))
done
"$py" - "$out" "$n" "$failed" <<'EOF'
import json, os, statistics, sys
out, n, failed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rec, mid = [], 0
for i in range(1, n + 1):
    try:
        d = json.load(open(os.path.join(out, f"{i}.json")))["drill"]
    except Exception:
        continue
    if d.get("recovery_s", 0) > 0:
        rec.append(d["recovery_s"])
    mid += 1 if d.get("interrupted_rebalance") else 0
print(json.dumps({"drills": n, "failed": failed, "mid_rebalance": mid,
                  "recovery_s_median": statistics.median(rec) if rec else None,
                  "recovery_s_max": max(rec) if rec else None}))
EOF
((failed == 0))
