#!/usr/bin/env bash
# Sets up, builds and runs every test:
#   1. clang-format check over the whole tree;
#   2. Release build, all tests (ctest);
#   3. ASan + UBSan build, all tests (skip with --no-sanitize).
set -euo pipefail
cd "$(dirname "$0")/.."
sanitize=1
for arg in "$@"; do
  case "$arg" in
    --no-sanitize) sanitize=0 ;;
    *) echo "usage: scripts/test.sh [--no-sanitize]" >&2; exit 2 ;;
  esac
done
scripts/setup.sh

echo "== format check (clang-format) =="
git ls-files -co --exclude-standard '*.h' '*.cc' | xargs clang-format --dry-run -Werror

echo "== Release build + tests =="
scripts/build.sh build
ctest --test-dir build --output-on-failure -j2

if ((sanitize)); then
  echo "== ASan + UBSan build + tests =="
  scripts/build.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPLBX_SANITIZE=ON \
    -DEPLBX_BUILD_BENCH=OFF
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j2
fi
