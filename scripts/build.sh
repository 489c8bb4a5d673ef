#!/usr/bin/env bash
# Configures and builds eplbx into a build directory (default: build, Release).
#   scripts/build.sh [BUILD_DIR] [extra cmake args...]
# EPLBX_TARGETS="a b" builds only those targets (and what they need).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build}
shift || true
# ccache, where installed (scripts/setup.sh): the package build (scripts/test-package.sh)
# compiles the library with the Release build's flags and takes its objects from the cache.
# CCACHE_BASEDIR and CCACHE_NOHASHDIR: a clean clone elsewhere (CI's) hits the objects of
# another checkout of the same sources (paths are hashed relative to the checkout).
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=true
fi
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "$@" >/dev/null
# shellcheck disable=SC2086  # a list of target names
cmake --build "$dir" ${EPLBX_TARGETS:+--target $EPLBX_TARGETS}
