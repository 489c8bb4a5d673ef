#!/usr/bin/env bash
# The main job: set up, build, and run the serving demo (`eplbx demo --serve`) — 4 rank
# processes serve 300 forward steps of real expert work under a skewed, drifting gate with
# EPLB off, synchronous and asynchronous, every row a step uses checked against its map —
# and print the comparison (tokens/s, step time p50/p99, the stall per rebalance); then the
# rearrangement demo (3 rebalancing steps, every byte verified), a DeepSeek-V3-sized plan
# from the shipped load and the placement policies side by side on it. Extra arguments go to the serving demo (for example: --json,
# --plot build/serve.svg, --steps 600).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
echo "== eplbx demo --serve: 4 ranks, 8 layers x 64 experts, 1 MiB per expert, 300 steps =="
build/bin/eplbx demo --serve "$@"
echo
echo "== eplbx demo: rearrangement, 4 ranks, 8 layers x 64 experts, 3 tensors, 1 MiB per expert =="
build/bin/eplbx demo
echo
echo "== eplbx plan: DeepSeek-V3 shape, examples/dsv3_load.json =="
build/bin/eplbx plan --load examples/dsv3_load.json --slots 288 --ranks 32 --nodes 4 --groups 8 \
  --out build/dsv3_plan.json
build/bin/eplbx plan --load examples/dsv3_load.json --slots 288 --ranks 32 --nodes 4 --groups 8 \
  --format table
echo "full plan (JSON): build/dsv3_plan.json"
echo
echo "== eplbx plan: the policies side by side on the same load (docs/placement.md) =="
# DeepSeek-V3 keeps each group of experts on one node (4 nodes, hierarchical): the hot
# groups' node caps every policy; without that constraint (one node: global) they balance.
printf '%-46s %-8s %-22s %s\n' "policy" "total" "worst layer" "planned in"
dsv3=(--load examples/dsv3_load.json --slots 288 --ranks 32 --groups 8 --format table)
for row in "deepseek|4|" "balanced|4|" "incremental|4|--previous build/dsv3_plan.json" \
    "deepseek|1|" "balanced|1|"; do
  IFS='|' read -r policy nodes extra <<<"$row"
  # shellcheck disable=SC2086  # extra is one optional flag and its value
  build/bin/eplbx plan "${dsv3[@]}" --nodes "$nodes" --policy "$policy" $extra | head -3 |
    awk -v name="$policy${extra:+ from the deepseek plan}, $nodes node(s)" '
      NR == 1 { match($0, /planned in [0-9.]+ ms/); t = substr($0, RSTART + 11, RLENGTH - 11) }
      NR == 2 { total = $NF }
      NR == 3 { worst = $4 " " $5 " " $6; sub(/,$/, "", worst) }
      END { printf "%-46s %-8s %-22s %s\n", name, total, worst, t }'
done
