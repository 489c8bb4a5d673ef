#!/usr/bin/env bash
# The main job: set up, build, and plan a DeepSeek-V3-sized deployment (58 layers x 256
# experts -> 288 slots on 32 ranks, 4 nodes, 8 expert groups) from the shipped example load.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh build
echo "== eplbx plan: DeepSeek-V3 shape, examples/dsv3_load.json =="
build/bin/eplbx plan --load examples/dsv3_load.json --slots 288 --ranks 32 --nodes 4 --groups 8 \
  --out build/dsv3_plan.json
build/bin/eplbx plan --load examples/dsv3_load.json --slots 288 --ranks 32 --nodes 4 --groups 8 \
  --format table | head -n 12
echo "..."
echo "full plan (JSON): build/dsv3_plan.json"
