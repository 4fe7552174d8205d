#!/usr/bin/env bash
# Installs what building and testing ringattn needs on a Debian/Ubuntu machine that has the CUDA
# toolkit: CMake >= 3.25, Ninja, doctest, Google Benchmark, Open MPI. Packages already present are
# left alone, so a second run does nothing. Needs root (or sudo) only when something is missing.
set -euo pipefail

need=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
for p in cmake ninja-build doctest-dev libbenchmark-dev libopenmpi-dev openmpi-bin git; do
  have_pkg "$p" || need+=("$p")
done
if ((${#need[@]})); then
  echo "setup: installing ${need[*]}"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$d/nvcc" ]; then export PATH="$d:$PATH"; break; fi
  done
fi
command -v nvcc >/dev/null 2>&1 || { echo "setup: the CUDA toolkit (nvcc) is required" >&2; exit 1; }
