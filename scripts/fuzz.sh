#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (build-fuzz/) and runs each for SECONDS (default 60)
# on a copy of its seed corpus. A crash fails the script and leaves the input in
# build-fuzz/crashes/; turn it into a regression test.
#   scripts/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
scripts/setup.sh
# Configured by scripts/build.sh (ccache as the other builds), one target built to start.
EPLBX_TARGETS=fuzz_layout CC=clang CXX=clang++ scripts/build.sh build-fuzz \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPLBX_FUZZ=ON -DEPLBX_BUILD_TESTS=OFF -DEPLBX_BUILD_BENCH=OFF \
  -DEPLBX_BUILD_PYTHON=OFF
targets="fuzz_agent_metadata fuzz_layout fuzz_protocol_record fuzz_load_file fuzz_trace
  fuzz_safetensors fuzz_backup_header fuzz_bootstrap_frames fuzz_members_map fuzz_etcd_response"
if grep -q "^EPLBX_WITH_CUDA:BOOL=ON" build-fuzz/CMakeCache.txt; then
  targets="$targets fuzz_staged_head"  # the CUDA data path is built
fi
# shellcheck disable=SC2086  # a list of target names
cmake --build build-fuzz --target $targets
mkdir -p build-fuzz/crashes
# UCX (linked through libeplbx) installs its own fatal-signal handlers; let libFuzzer's run.
export UCX_HANDLE_ERRORS=none
# One target a core at a time (each still gets SECONDS of one core); the results are read after.
parallel=$(nproc)
for target in $targets; do
  while (($(jobs -rp | wc -l) >= parallel)); do wait -n || true; done
  work=build-fuzz/corpus/$target
  rm -rf "$work" build-fuzz/$target.rc && mkdir -p "$work" && cp tests/fuzz/corpus/$target/* "$work/"
  echo "fuzz: $target started (${seconds}s)"
  (
    status=0
    build-fuzz/bin/$target -max_total_time="$seconds" -max_len=65536 -print_final_stats=1 \
      -artifact_prefix=build-fuzz/crashes/$target- "$work" >build-fuzz/$target.log 2>&1 || status=$?
    echo "$status" >build-fuzz/$target.rc
  ) &
done
wait
failed=0
for target in $targets; do
  echo "== $target =="
  grep -E "stat::number_of_executed_units|ERROR|SUMMARY|Done" build-fuzz/$target.log || true
  if [[ "$(cat build-fuzz/$target.rc 2>/dev/null)" != 0 ]] || ls build-fuzz/crashes/$target-* >/dev/null 2>&1; then
    tail -30 build-fuzz/$target.log >&2
    echo "fuzz: $target found a crash: $(ls build-fuzz/crashes/$target-* 2>/dev/null)" >&2
    failed=1
  fi
done
((failed == 0)) || exit 1
echo "fuzz: no crash"
