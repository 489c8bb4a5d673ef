#!/usr/bin/env bash
# The main job: set up, build, and run `eplbx demo` — 4 rank processes on this machine move
# real expert weights between them over UCX agents for 3 rebalancing steps of drifting load,
# every byte verified — then plan a DeepSeek-V3-sized deployment from the shipped load.
# Extra arguments go to `eplbx demo` (for example: --json, --inject kill:2, --steps 10).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
echo "== eplbx demo: 4 ranks, 8 layers x 64 experts, 3 tensors, 1 MiB per expert =="
build/bin/eplbx demo "$@"
echo
echo "== eplbx plan: DeepSeek-V3 shape, examples/dsv3_load.json =="
build/bin/eplbx plan --load examples/dsv3_load.json --slots 288 --ranks 32 --nodes 4 --groups 8 \
  --out build/dsv3_plan.json
build/bin/eplbx plan --load examples/dsv3_load.json --slots 288 --ranks 32 --nodes 4 --groups 8 \
  --format table
echo "full plan (JSON): build/dsv3_plan.json"
