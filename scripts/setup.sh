#!/usr/bin/env bash
# Installs the Debian packages eplbx needs to build and test, only those that are missing.
# Safe to run repeatedly; needs root (or sudo) only when something must be installed.
set -euo pipefail

PACKAGES=(cmake ninja-build g++ libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev
          nlohmann-json3-dev clang-format libucx-dev ucx-utils pybind11-dev python3-dev
          python3-numpy python3-torch python3-matplotlib clang libclang-rt-14-dev iproute2
          libxxhash-dev python3-venv ccache libcurl4-openssl-dev etcd-server etcd-client)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "setup: installing ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
$SUDO apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
