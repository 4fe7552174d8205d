#!/usr/bin/env bash
# The README's main command: builds and runs examples/01_quickstart. It needs only CMake (3.25 or
# newer), Ninja, a C++20 compiler and the CUDA toolkit; where CMake, Ninja or g++ is missing it
# installs that one through apt. On a machine with NVIDIA GPUs it builds for their architectures
# and runs on them; otherwise it builds the host path alone and runs on CPU threads.
# Extra arguments go to the example (--help lists them; e.g. --ranks 8 --tokens 131072 --mask full).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh

need=()
if cmake_too_old; then need+=(cmake); fi
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v c++ >/dev/null 2>&1 || need+=(g++)
if ((${#need[@]})); then apt_install quickstart "${need[@]}"; fi
require_nvcc quickstart

# The GPUs' architectures (compute capability 9.0 builds 90a: the Hopper kernels), if any.
archs=""
if command -v nvidia-smi >/dev/null 2>&1; then
  archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
    awk '{gsub(/\./, ""); if ($1 == "90") $1 = "90a"; if ($1 >= 80 || $1 == "90a") print $1}' |
    sort -u | paste -sd';' || true)
fi
if [ -n "$archs" ]; then
  echo "quickstart: building for the GPUs here (CUDA architectures $archs)"
  cmake --preset quickstart -DCMAKE_CUDA_ARCHITECTURES="$archs" >/dev/null
  cmake --build --preset quickstart
  ./build/quickstart/examples/quickstart "$@"
else
  echo "quickstart: no GPU of compute capability 8.0 or newer here: the host path, on CPU threads"
  cmake --preset quickstart-cpu >/dev/null
  cmake --build --preset quickstart-cpu
  ./build/quickstart-cpu/examples/quickstart "$@"
fi
