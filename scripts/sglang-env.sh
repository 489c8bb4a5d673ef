#!/usr/bin/env bash
# Makes .cache/sglang-venv: a Python virtual environment with SGLang from PyPI, for the
# optional SGLang integration test and the SGLang benchmark:
#   scripts/sglang-env.sh                       # SGLang 0.5.23, the version eplbx.sglang was checked against
#   PYTHONPATH=build/python .cache/sglang-venv/bin/python bench/python/bench_sglang_update.py
# SGLang needs torch 2.x (Debian's 1.13 is too old for it): the environment sees the packages
# of .cache/vllm-venv (torch 2.14 and most of what SGLang imports; scripts/vllm-env.sh makes it,
# and this script runs it when it is missing) through a .pth file, then gets SGLang itself
# without its dependencies (its full set pins a CUDA torch and serving stack its updater does
# not use) and the few modules its EPLB code imports that vLLM does not bring.
# The test (tests/python/test_sglang.py) finds .cache/sglang-venv by itself.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${EPLBX_SGLANG_VERSION:-0.5.23}"
if [[ ! -x .cache/vllm-venv/bin/python ]]; then
  scripts/vllm-env.sh
fi
site=$(.cache/vllm-venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
base=$(.cache/vllm-venv/bin/python -c 'import sys; print(sys._base_executable)')
rm -rf .cache/sglang-venv
"$base" -m venv .cache/sglang-venv
own=$(.cache/sglang-venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" > "$own/vllm-venv.pth"
.cache/sglang-venv/bin/pip install -q --no-deps "sglang==$version" ipython traitlets
.cache/sglang-venv/bin/python -c '
import sglang
from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
print("sglang-env: SGLang", sglang.__version__, "in .cache/sglang-venv")'
