#!/usr/bin/env bash
# The main job: set up, build, and run the serving demo (`eplbx demo --serve`) — 4 rank
# processes serve 300 forward steps of real expert work under a skewed, drifting gate with
# EPLB off, synchronous and asynchronous, every row a step uses checked against its map —
# and print the comparison (tokens/s, step time p50/p99, the stall per rebalance); then the
# rearrangement demo (3 rebalancing steps, every byte verified) and a DeepSeek-V3-sized
# plan from the shipped load. Extra arguments go to the serving demo (for example: --json,
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
