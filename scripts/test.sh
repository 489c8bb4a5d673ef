#!/usr/bin/env bash
# Sets up, builds and runs every test:
#   1. clang-format check over the whole tree;
#   2. Release build, all tests (ctest); the Python package built by pip and its tests
#      (scripts/test-package.sh);
#   3. ASan + UBSan build with clang (the whole tree builds with GCC and clang), all tests;
#   4. TSan build: the protocol, agent and rearrangement tests that run ranks as threads, and
#      the multi-process transfer tests;
#   5. libFuzzer: every fuzz target for about 60 s (scripts/fuzz.sh).
# --no-sanitize skips 3-5.
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
echo "== the Python package: pip wheel . and install in a fresh virtual environment =="
scripts/test-package.sh
if grep -q "^EPLBX_WITH_CUDA:BOOL=ON" build/CMakeCache.txt; then
  echo "== CUDA data path compiled and linked (device tests skip without a GPU; scripts/test-gpu.sh runs them) =="
else
  echo "== CUDA toolkit not found: the CUDA data path is not built =="
fi

if ((sanitize)); then
  echo "== ASan + UBSan build (clang) + tests =="
  # Built with clang: the whole tree (but the Python module, not built under sanitizers)
  # compiles with both GCC (above) and clang 14.
  CC=clang CXX=clang++ scripts/build.sh build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DEPLBX_SANITIZE=ON
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j2

  echo "== TSan build + transfer, protocol and rearrangement tests =="
  # Only what this pass runs (the CLI, Python module and CLI tests are not run under TSan).
  cuda_targets=""
  if grep -q "^EPLBX_WITH_CUDA:BOOL=ON" build/CMakeCache.txt; then
    cuda_targets="eplbx_cuda_tests eplbx_fake_cuda"
  fi
  EPLBX_TARGETS="eplbx_unit_tests eplbx_multiproc_tests $cuda_targets" \
    scripts/build.sh build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPLBX_TSAN=ON -DEPLBX_BUILD_BENCH=OFF
  # UCX's memory hooks do not mix with TSan's interceptors; suppressions: tests/sanitizers/tsan.supp
  export UCX_MEM_EVENTS=no UCX_HANDLE_ERRORS=none
  export TSAN_OPTIONS="suppressions=$PWD/tests/sanitizers/tsan.supp halt_on_error=1"
  # Ranks as threads: protocol, loopback agents, UCX agents (path choice), fault-injecting
  # wrappers, Rearranger (with faults), communicator, store, etcd (its watch thread).
  build-tsan/bin/eplbx_unit_tests --gtest_filter='LayerProtocol*:Record*:Loopback*:Rearranger*:EplbComm*:TcpStore*:Coordinator*:PathChoice*:Fault*:Pipeline*:Swap*:Balancer*:Recovery*:Settle*:ServingGroup*:Etcd*:ShmCopier*'
  # Real processes over real UCX (tcp, shm, CMA, mapped files): 57 transfer tests, ~4 min under TSan.
  build-tsan/bin/eplbx_multiproc_tests
  # The cuda_ipc path (its poller thread, Disconnect) between processes, on the stand-in driver.
  if [[ -n "$cuda_targets" ]]; then
    EPLBX_CUDA_DRIVER=$PWD/build-tsan/lib/libeplbx_fake_cuda.so build-tsan/bin/eplbx_cuda_tests
  fi
  unset UCX_MEM_EVENTS UCX_HANDLE_ERRORS TSAN_OPTIONS

  echo "== fuzzing (libFuzzer, ~60 s per target) =="
  scripts/fuzz.sh 60
fi
