#!/usr/bin/env bash
# Installs what building and testing ringattn needs on a Debian/Ubuntu machine that has the CUDA
# toolkit: CMake >= 3.25, Ninja, doctest, Google Benchmark, Open MPI, git, clang with libFuzzer.
# It checks for each capability (a command, a header, a library), not for package names, so a
# machine that has a tool from elsewhere (CMake from pip, a preinstalled image) is left alone and
# needs no network. Needs root (or sudo) only when something is missing. Sourced by scripts/test.sh
# and quickstart.sh.
set -euo pipefail

need=()
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }
cmake_version=$(cmake --version 2>/dev/null | head -n1 | awk '{print $3}')
if [ -z "$cmake_version" ] || ! version_ge "$cmake_version" 3.25; then need+=(cmake); fi
command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
command -v git >/dev/null 2>&1 || need+=(git)
has_header() { for d in /usr/include /usr/local/include; do [ -f "$d/$1" ] && return 0; done; return 1; }
has_header doctest/doctest.h || need+=(doctest-dev)
libraries() { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } # /sbin: not on a user's PATH
if ! has_header benchmark/benchmark.h || ! libraries | grep -q libbenchmark; then
  need+=(libbenchmark-dev)
fi
{ command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1; } || need+=(libopenmpi-dev openmpi-bin)
# clang with libFuzzer's runtime (the fuzz preset): probed by linking an empty fuzz target.
fuzzer_links() {
  local exe
  exe=$(mktemp)
  printf 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }\n' |
    clang++ -fsanitize=fuzzer -x c++ - -o "$exe" >/dev/null 2>&1
  local ok=$?
  rm -f "$exe"
  return $ok
}
command -v clang++ >/dev/null 2>&1 || need+=(clang)

if ((${#need[@]})); then
  echo "setup: installing ${need[*]}"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if ! fuzzer_links; then # Debian ships libFuzzer's runtime in libclang-rt-<major>-dev
  major=$(clang++ -dumpversion | cut -d. -f1)
  echo "setup: installing libclang-rt-${major}-dev (libFuzzer)"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "libclang-rt-${major}-dev" >/dev/null
fi

if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
    if [ -x "$d/nvcc" ]; then export PATH="$d:$PATH"; break; fi
  done
fi
command -v nvcc >/dev/null 2>&1 || { echo "setup: the CUDA toolkit (nvcc) is required" >&2; exit 1; }
