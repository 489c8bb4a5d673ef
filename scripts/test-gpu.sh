#!/usr/bin/env bash
# Builds eplbx with CUDA and runs everything that needs a GPU (docs/transfer.md, "Device
# memory"), then prints a short summary. Meant for the lent H200 machine (nvcc, CMake, ninja,
# PyTorch and pybind11 there; no package registry, no UCX), where it builds from Debian
# packages carried with the working tree:
#
#   here, once:  scripts/test-gpu.sh --fetch      # .cache/gpu-* (ignored), ~18 MB in all
#   there:       device run, carry [".cache/gpu-debs", ".cache/gpu-vllm", ".cache/gpu-nixl.tar.xz"],
#                command "scripts/test-gpu.sh"
#
# --fetch downloads (apt-get, pip; nothing installed here): the Debian packages below into
# .cache/gpu-debs; vLLM 0.33.0's wheel, of which bench/python/gpu_carry.py keeps its EPLB files
# (vllm/distributed/eplb/, nixl_utils.py) in .cache/gpu-vllm; NIXL 1.5.1's wheels for the
# device's Python (3.12; EPLBX_GPU_PYTHON=3.13 for another), `nixl` with both CUDA backends,
# trimmed by gpu_carry.py to what a UCX agent loads, as .cache/gpu-nixl.tar.xz.
#
# Steps: unpack the .deb files into .cache/gpu-prefix (dpkg -x, never into /); configure
# build-gpu with -DEPLBX_WITH_CUDA=ON against that prefix and the machine's python3; build the
# CUDA tests, the transfer peer, the CLI and the Python module; run
#   1. eplbx_cuda_tests: transfers between processes on one GPU (cudaMalloc and cuMem memory,
#      every byte checked), by cuda_ipc and, as two hosts (EPLBX_HOST_ID), by cuda_staged; a
#      peer killed mid-transfer; the section and refusal checks;
#   2. the Python communicator on CUDA tensors driven as vLLM's asynchronous mode drives it
#      (set_stream, transfers from another thread);
#   3. eplbx bench xfer --memory cuda (cuda_ipc READ/WRITE of 1-64 MiB rows, batch 1 and 16,
#      beside device-to-device copies; cuda_staged READ/WRITE beside pinned host <-> device
#      copies; all in the same run) -> $OUT/bench-cuda.json; then single rows again with
#      --inline-copy 0 (every transfer through the path's poller thread, as before the
#      caller's thread waited for a transfer posted alone) -> $OUT/bench-cuda-poller.json;
#   4. bench/python/bench_cuda_communicator.py: 4 ranks on the GPU, EplbxCommunicator beside
#      vLLM's gloo-staged communicator (reimplemented), every row checked
#      -> $OUT/bench-python-cuda.json;
#   5. bench/python/bench_vllm_nixl.py: 4 ranks on the GPU, vLLM's own NixlEplbCommunicator
#      (its files from the wheel, NIXL from PyPI) beside EplbxCommunicator, both driven by
#      vLLM's own rearrange_expert_weights_inplace, every row checked
#      -> $OUT/bench-vllm-nixl.json;
#   6. (no device needed, but many cores) eplbx_plan_bench at EP256 and the DeepSeek-V3
#      shape: balanced and incremental (layers over every core, and on one thread) against
#      deepseek in the same run (issue 34, item 3) -> $OUT/bench-plan.json.
# Without a device every step says "no CUDA device: ..." and device tests are skipped.
# Must finish within 8 minutes on one H200 with 16 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
DEBS=(libucx0 libucx-dev libnuma1 libibverbs1 librdmacm1 libgtest-dev nlohmann-json3-dev
      libcli11-dev libbenchmark-dev libbenchmark1debian)
debs=.cache/gpu-debs
if [[ "${1:-}" == "--fetch" ]]; then
  mkdir -p "$debs"
  (cd "$debs" && apt-get download "${DEBS[@]}") || { echo "test-gpu: apt-get download failed" >&2; exit 1; }
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  pip=(python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels")
  "${pip[@]}" vllm==0.33.0 || { echo "test-gpu: pip download vllm failed" >&2; exit 1; }
  python3 bench/python/gpu_carry.py vllm-files "$wheels"/vllm-0.33.0-*.whl .cache/gpu-vllm || exit 1
  rm -f "$wheels"/vllm-*.whl
  py=${EPLBX_GPU_PYTHON:-3.12}
  "${pip[@]}" --python-version "$py" --platform manylinux_2_28_x86_64 \
      nixl==1.5.1 nixl-cu12==1.5.1 nixl-cu13==1.5.1 || { echo "test-gpu: pip download nixl failed" >&2; exit 1; }
  python3 bench/python/gpu_carry.py trim-nixl .cache/gpu-nixl.tar.xz "$wheels"/nixl*.whl || exit 1
  du -shc "$debs" .cache/gpu-vllm .cache/gpu-nixl.tar.xz
  exit 0
fi
out=${OUT:-$PWD/build-gpu/out}
mkdir -p "$out"
log() { echo "== test-gpu: $* ==" >&2; }
start=$(date +%s)

# ---- dependencies from the carried packages ---------------------------------------------
prefix=$PWD/.cache/gpu-prefix
if compgen -G "$debs/*.deb" >/dev/null; then
  rm -rf "$prefix" && mkdir -p "$prefix"
  for f in "$debs"/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$f" "$prefix"
    else  # a .deb is an ar archive holding data.tar.xz
      tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$OLDPWD/$f") && tar -xf "$tmp"/data.tar.* -C "$prefix"
      rm -rf "$tmp"
    fi
  done
  # UCX's CMake package and module directory name /usr; point them at the prefix.
  sed -i "s|set(prefix \"/usr\")|set(prefix \"$prefix/usr\")|" \
    "$prefix"/usr/lib/x86_64-linux-gnu/cmake/ucx/ucx-targets.cmake
  export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export UCX_MODULE_DIR=$prefix/usr/lib/x86_64-linux-gnu/ucx
  prefixes="$prefix/usr;$prefix/usr/lib/x86_64-linux-gnu/cmake;$prefix/usr/share/cmake"
  log "dependencies from $debs ($(ls "$debs" | wc -l) packages) in $prefix"
else
  prefixes=""
  log "no $debs: using the system's packages (scripts/test-gpu.sh --fetch makes them)"
fi

# ---- build ------------------------------------------------------------------------------
python=${EPLBX_PYTHON:-$(command -v python3)}  # the one with torch (there: the image's)
pybind=$("$python" -m pybind11 --cmakedir 2>/dev/null || true)
[[ -d /usr/local/cuda/bin ]] && export PATH=/usr/local/cuda/bin:$PATH
jobs=$(nproc)
log "configure (CUDA on, python $("$python" -c 'import sys; print(sys.version.split()[0])'))"
if ! cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DEPLBX_WITH_CUDA=ON \
    -DEPLBX_BUILD_BENCH=ON -DCMAKE_PREFIX_PATH="$prefixes" -DPython_EXECUTABLE="$python" \
    ${pybind:+-Dpybind11_DIR="$pybind"} >"$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"
  log "FAILED: configure"
  exit 1
fi
grep -E "eplbx: (CUDA|Python)" "$out/configure.log" >&2
log "build ($jobs jobs)"
if ! cmake --build build-gpu -j "$jobs" --target eplbx_cuda_tests eplbx_xfer_peer eplbx_cli eplbx_plan_bench \
    $(grep -q "Python module NOT built" "$out/configure.log" || echo _eplbx) -- -k 0 >"$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -30
  log "FAILED: build"
  exit 1
fi
log "built in $(($(date +%s) - start)) s"
# What the module was linked with (a C++ runtime linked into it statically would show here).
module=$(ls build-gpu/python/eplbx/_eplbx*.so 2>/dev/null | head -1)
{ c++ --version 2>&1 | head -1
  env | grep -E '^(CC|CXX|CFLAGS|CXXFLAGS|CPPFLAGS|LDFLAGS)=' || true
  if [[ -n "$module" ]]; then
    echo "module: $(nm -D --defined-only "$module" 2>/dev/null | grep -c ' [TWV] ') exported symbols," \
         "$(nm -D --defined-only "$module" 2>/dev/null | grep -c 'codecvt') of libstdc++'s codecvt;" \
         "needs: $(ldd "$module" 2>/dev/null | awk '{print $1}' | grep -E 'stdc|ucp|gcc' | tr '\n' ' ')"
  fi; } >&2

# ---- device checks ----------------------------------------------------------------------
status=0
summary=()
log "1. eplbx_cuda_tests"
if timeout 240 build-gpu/bin/eplbx_cuda_tests 2>&1 | tee "$out/cuda-tests.log" | grep -E "^\[  |Skipped|no CUDA|Failure|refusal" ; then :; fi
if grep -q "^\[  PASSED  \]" "$out/cuda-tests.log" && ! grep -q "^\[  FAILED  \]" "$out/cuda-tests.log"; then
  summary+=("cuda tests: $(grep -c '^\[       OK \]' "$out/cuda-tests.log") passed, $(grep -cE '^\[  SKIPPED \] .*\([0-9]+ ms\)' "$out/cuda-tests.log") skipped")
else
  summary+=("cuda tests: FAILED (see cuda-tests.log)")
  status=1
fi

log "2. Python communicator on CUDA tensors"
if [[ -f build-gpu/python/eplbx/vllm.py ]]; then
  (cd tests/python && PYTHONPATH=$PWD/../../build-gpu/python PYTHONUNBUFFERED=1 timeout 180 \
     "$python" -m unittest -v test_vllm_communicator.VllmCommunicatorTest.test_cuda_tensors_with_set_stream_from_another_thread_every_row \
     test_vllm_communicator.VllmCommunicatorTest.test_tensor_checks_name_the_device_and_refuse_mixed_memory) \
     >"$out/python.log" 2>&1
  rc=$?
  tail -5 "$out/python.log" >&2
  if ((rc == 0)); then
    summary+=("python cuda: $(grep -q 'skipped' "$out/python.log" && echo 'ok, SKIPPED (see python.log)' || echo ok)")
  else
    summary+=("python cuda: FAILED (see python.log)")
    status=1
  fi
else
  summary+=("python cuda: not built (no pybind11 for $python)")
  status=1
fi

log "3. bench xfer --memory cuda"
if timeout 200 build-gpu/bin/eplbx bench xfer --memory cuda --json --sizes 1M,4M,16M,64M \
    --batches 1,16 --seconds 0.3 >"$out/bench-cuda.json" 2>"$out/bench-cuda.err"; then
  "$python" - "$out/bench-cuda.json" <<'EOF' >&2 || true
import json, sys
j = json.load(open(sys.argv[1]))
if "skipped" in j:
    print("bench:", j["skipped"]); sys.exit(0)
print("device:", j.get("device"), "driver", j.get("cuda_driver_version"))
for r in j["results"]:
    print(f'{r["op"]:5} {r["path"]} {r["block_bytes"] >> 20:3} MiB x{r["batch"]:<3} '
          f'{r["gbps"]:8.1f} GB/s  d2d {r["device_copy_gbps"]:8.1f}  ratio {r["ratio_to_device_copy"]:.2f}')
for r in j.get("pinned_host_copy", []):
    print(f'pinned {r["block_bytes"] >> 20:3} MiB  h2d {r["host_to_device_gbps"]:.1f}  d2h {r["device_to_host_gbps"]:.1f} GB/s')
for r in j.get("staged", []):
    print(f'{r["op"]:5} {r["path"]} {r["block_bytes"] >> 20:3} MiB x1   '
          f'{r["gbps"]:8.1f} GB/s  pinned {r["pinned_host_copy_gbps"]:8.1f}  ratio {r["ratio_to_pinned_host_copy"]:.2f}'
          f'  host rows over {r["link_path"]} {r["link_host_rows_gbps"]:6.1f}  ratio to slower {r["ratio_to_bound"]:.2f}')
EOF
  summary+=("bench: bench-cuda.json")
  if timeout 60 build-gpu/bin/eplbx bench xfer --memory cuda --json --sizes 1M,16M --batches 1 \
      --seconds 0.3 --inline-copy 0 >"$out/bench-cuda-poller.json" 2>>"$out/bench-cuda.err"; then
    "$python" - "$out/bench-cuda.json" "$out/bench-cuda-poller.json" <<'EOF' >&2 || true
import json, sys
rows = {}
for label, f in (("caller waits", sys.argv[1]), ("poller", sys.argv[2])):
    for r in json.load(open(f)).get("results", []):
        if r["batch"] == 1 and r["path"] == "cuda_ipc" and r["block_bytes"] in (1 << 20, 16 << 20):
            rows.setdefault((r["op"], r["block_bytes"] >> 20), {})[label] = r["ratio_to_device_copy"]
for (op, mib), v in sorted(rows.items()):
    print(f"single row {op:5} {mib:2} MiB: ratio to the device copy, caller waits "
          f"{v.get('caller waits', float('nan')):.2f}, poller {v.get('poller', float('nan')):.2f}")
EOF
  fi
else
  tail -5 "$out/bench-cuda.err" >&2
  summary+=("bench: FAILED (see bench-cuda.err)")
  status=1
fi

log "4. Python: EplbxCommunicator on CUDA tensors beside the gloo-staged baseline"
if [[ -f build-gpu/python/eplbx/vllm.py ]] && PYTHONPATH=$PWD/build-gpu/python PYTHONUNBUFFERED=1 \
    timeout 240 "$python" bench/python/bench_cuda_communicator.py --json \
    >"$out/bench-python-cuda.json" 2>"$out/bench-python-cuda.err"; then
  cat "$out/bench-python-cuda.json" >&2
  summary+=("python bench: bench-python-cuda.json")
else
  tail -5 "$out/bench-python-cuda.err" >&2
  summary+=("python bench: FAILED (see bench-python-cuda.err)")
  status=1
fi

log "5. Python: vLLM's NIXL communicator beside EplbxCommunicator, in vLLM's own loop"
if [[ -f .cache/gpu-nixl.tar.xz && -d .cache/gpu-vllm && -f build-gpu/python/eplbx/vllm.py ]] &&
    "$python" bench/python/gpu_carry.py unpack .cache/gpu-nixl.tar.xz build-gpu/nixl >&2 &&
    PYTHONPATH=$PWD/build-gpu/python PYTHONUNBUFFERED=1 timeout 200 "$python" \
      bench/python/bench_vllm_nixl.py --vllm-files .cache/gpu-vllm --nixl build-gpu/nixl --json \
      >"$out/bench-vllm-nixl.json" 2>"$out/bench-vllm-nixl.err"; then
  "$python" -c 'import json, sys; j = json.load(open(sys.argv[1])); print(json.dumps({k: j.get(k) for k in ("skipped", "gpu", "torch_cuda", "seconds", "speed_vs_nixl", "nixl_wrong_rows", "device_copy_gbps", "copy_once_floor_s")}))' "$out/bench-vllm-nixl.json" >&2
  summary+=("vllm nixl bench: bench-vllm-nixl.json")
else
  tail -5 "$out/bench-vllm-nixl.err" 2>/dev/null >&2
  summary+=("vllm nixl bench: FAILED or not carried (see bench-vllm-nixl.err; scripts/test-gpu.sh --fetch)")
  status=1
fi

log "6. planning at scale on $(nproc) cores: balanced and incremental against deepseek"
if timeout 150 build-gpu/bin/eplbx_plan_bench \
    --benchmark_filter='PlanPolicy/(ep256|dsv3)_(deepseek|balanced|incremental)(_1thread)?$' \
    --benchmark_min_time=0.3 --benchmark_format=json >"$out/bench-plan.json" 2>"$out/bench-plan.err"; then
  "$python" - "$out/bench-plan.json" <<'EOF' >&2 || true
import json, sys
j = json.load(open(sys.argv[1]))
t = {b["name"]: b["real_time"] for b in j["benchmarks"]}
print("cores:", j["context"].get("num_cpus"))
for shape in ("ep256", "dsv3"):
    base = t[f"PlanPolicy/{shape}_deepseek"]
    print(f"{shape}: deepseek {base:.2f} ms; " + "; ".join(
        f"{p}{s} {t[f'PlanPolicy/{shape}_{p}{s}']:.2f} ms = {t[f'PlanPolicy/{shape}_{p}{s}'] / base:.1f}x"
        for p in ("balanced", "incremental") for s in ("", "_1thread")))
EOF
  summary+=("plan bench: bench-plan.json")
else
  tail -5 "$out/bench-plan.err" >&2
  summary+=("plan bench: FAILED (see bench-plan.err)")
  status=1
fi

log "summary ($(($(date +%s) - start)) s)"
for s in "${summary[@]}"; do echo "  $s"; done
exit $status
