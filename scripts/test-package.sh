#!/usr/bin/env bash
# The Python package as a user installs it (issue 32, item 1): a fresh virtual environment
# over Debian's Python (--system-site-packages: numpy, torch), `pip wheel .` then
# `pip install` of that wheel; then, from another directory and with no PYTHONPATH: `import
# eplbx`, the vllm.general_plugins entry point from the package metadata, no torch needed to
# import, and the Python test suites against the installed package.
#   scripts/test-package.sh
# The wheel's CMake build lives in build-wheel/ and is kept: a second run recompiles nothing
# that did not change (and with ccache, a first run reuses the Release build's objects).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
scripts/setup.sh
venv=$root/build-venv
rm -rf "$venv" "$root/build-wheel/dist"
/usr/bin/python3 -m venv --system-site-packages "$venv"
echo "== pip wheel . (scikit-build-core; build dir build-wheel) =="
launcher=()
if command -v ccache >/dev/null; then
  launcher=(--config-settings=cmake.define.CMAKE_CXX_COMPILER_LAUNCHER=ccache)
  export CCACHE_BASEDIR=$root CCACHE_NOHASHDIR=true  # as scripts/build.sh
fi
"$venv/bin/pip" wheel -q --no-deps -w "$root/build-wheel/dist" --config-settings=build-dir=build-wheel/cmake \
  "${launcher[@]}" "$root"
wheel=$(ls "$root"/build-wheel/dist/eplbx-*.whl)
echo "built $(basename "$wheel")"
"$venv/bin/pip" install -q --no-deps "$wheel"
cd "$(mktemp -d)"
echo "== import eplbx from $(pwd), no PYTHONPATH =="
env -u PYTHONPATH "$venv/bin/python" - <<'PY'
import importlib.metadata as md
import os
import sys

import eplbx

where = os.path.dirname(eplbx.__file__)
assert where.startswith(sys.prefix), f"eplbx imported from {where}, not the environment {sys.prefix}"
assert "torch" not in sys.modules, "import eplbx imported torch"
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "eplbx"]
assert len(eps) == 1 and eps[0].value == "eplbx.vllm:_plugin", eps
assert eps[0].load().__name__ == "_plugin"
sgl = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "eplbx"]
assert len(sgl) == 1 and sgl[0].value == "eplbx.sglang:_plugin", sgl
assert md.version("eplbx") == "0.1.0", md.version("eplbx")
import numpy as np

p = eplbx.plan(np.ones((2, 12)), slots=16, ranks=4)
assert p.phy2log.shape == (2, 16)
print(f"ok: eplbx {md.version('eplbx')} from {where}; entry points {eps[0].value}, {sgl[0].value}; plan {p.phy2log.shape}")
PY
echo "== the Python test suites against the installed package =="
cd "$root/tests/python"
env -u PYTHONPATH "$venv/bin/python" -m unittest test_plan test_serving test_inplace test_sglang test_vllm_install test_vllm_communicator
