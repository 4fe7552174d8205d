# Helpers sourced by scripts/setup.sh and scripts/quickstart.sh.

# apt_install WHO PACKAGE...: installs the packages through apt (with sudo when not root).
apt_install() {
  local who=$1
  shift
  echo "$who: installing $*"
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo=sudo; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# version_ge A B: whether version A >= B.
version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# cmake_too_old: whether CMake is missing or older than 3.25.
cmake_too_old() {
  local v
  v=$(cmake --version 2>/dev/null | head -n1 | awk '{print $3}')
  [ -z "$v" ] || ! version_ge "$v" 3.25
}

# require_nvcc WHO: puts the CUDA toolkit's nvcc on PATH, or stops naming what is missing.
require_nvcc() {
  if ! command -v nvcc >/dev/null 2>&1; then
    for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
      if [ -x "$d/nvcc" ]; then export PATH="$d:$PATH"; break; fi
    done
  fi
  command -v nvcc >/dev/null 2>&1 || { echo "$1: the CUDA toolkit (nvcc) is required" >&2; exit 1; }
}
