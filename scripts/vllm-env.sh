#!/usr/bin/env bash
# Makes .cache/vllm-venv: a Python virtual environment with vLLM from PyPI (about 7 GiB with
# its CUDA build of torch), for the optional vLLM integration test and the vLLM benchmark:
#   scripts/vllm-env.sh                       # vLLM 0.33.0, the version eplbx.vllm was checked against
#   EPLBX_VLLM_VERSION=0.34.0 scripts/vllm-env.sh
#   PYTHONPATH=build/python .cache/vllm-venv/bin/python bench/python/bench_vllm_rearrange.py
# The test (tests/python/test_vllm_install.py) finds .cache/vllm-venv by itself. eplbx's own
# module is built for Debian's python3 (3.11), the same ABI as this environment's interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${EPLBX_VLLM_VERSION:-0.33.0}"
python="${EPLBX_VLLM_BASE_PYTHON:-python3}"
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "vllm-env: $python is not Python 3.11 (eplbx's module is built for Debian's 3.11); set EPLBX_VLLM_BASE_PYTHON" >&2
  exit 1
fi
"$python" -m venv .cache/vllm-venv
.cache/vllm-venv/bin/pip install -q "vllm==$version"
.cache/vllm-venv/bin/python -c 'import vllm; print("vllm-env: vLLM", vllm.__version__, "in .cache/vllm-venv")'
