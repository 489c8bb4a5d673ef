#!/usr/bin/env bash
# Configures and builds eplbx into a build directory (default: build, Release).
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]
# EPLBX_TARGETS="a b" builds only those targets (and what they need).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
# shellcheck disable=SC2086  # a list of target names
cmake --build "$dir" ${EPLBX_TARGETS:+--target $EPLBX_TARGETS}
