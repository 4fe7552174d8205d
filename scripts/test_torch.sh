#!/usr/bin/env bash
# The PyTorch extension's tests: builds python/ with CMake against the Torch package of a PyTorch,
# installs it there with pip, and runs pytest python/tests (GPU tests report "skipped" without a
# GPU). The PyTorch is $RINGATTN_TORCH_PYTHON's, else python3's where it imports torch, else
# PyPI's torch 2.11 in a virtual environment made once per machine and reused by every checkout:
# under $RINGATTN_CACHE (default ${XDG_CACHE_HOME:-~/.cache}/ringattn), named by the PyTorch and
# Python versions; build/torch-venv where that folder cannot be written. PyTorch's CPU-only wheels
# are not on PyPI, so that one is the standard wheel (about 5 GB with its CUDA libraries): its
# CUDA build runs CPU tensors on a machine without a GPU, which is what the host-path tests need.
# Modes: host builds the host path alone (RINGATTN_TORCH_DEVICE=OFF: no nvcc compile) and runs the
# tests and the training example on the CPU; full (the default) builds the device path too, and
# with no pytest arguments runs the training example on the CPU and the host tests
# $RINGATTN_TORCH_REPEATS (default 5) times more; repeat builds the device path (the native
# kernels'; the cuDNN kernel's only where RINGATTN_TORCH_CUDNN says so) and runs the host tests
# that many times in a row, nothing else (the full test tier, after the fast one ran the rest).
# Usage: scripts/test_torch.sh [host|full|repeat] [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/common.sh
mode=full
case "${1:-}" in
host | full | repeat)
  mode=$1
  shift
  ;;
esac
if [ "$mode" = host ]; then export RINGATTN_TORCH_DEVICE=${RINGATTN_TORCH_DEVICE:-OFF}; fi
# The cuDNN plans take as long to compile as the native ones, and the C++ suites compile the cuDNN
# kernel already; the GPU machine's runs (full mode) build them where cuDNN is found.
if [ "$mode" = repeat ]; then export RINGATTN_TORCH_CUDNN=${RINGATTN_TORCH_CUDNN:-OFF}; fi
[ "${RINGATTN_TORCH_DEVICE:-ON}" = OFF ] || require_nvcc torch

py=${RINGATTN_TORCH_PYTHON:-}
if [ -z "$py" ] && python3 -c "import torch" >/dev/null 2>&1; then py=python3; fi
if [ -z "$py" ]; then
  torch_version=2.11.0
  cache=${RINGATTN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ringattn}
  venv="$cache/torch-$torch_version-py$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ] || venv=build/torch-venv
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" 2>/dev/null || { apt_install torch python3-venv && python3 -m venv "$venv"; }
  fi
  py=$venv/bin/python
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "torch: installing PyTorch $torch_version into $venv (once per machine; about 5 GB)"
    "$py" -m pip install --quiet "torch==$torch_version" numpy
  fi
fi
# What the build and the tests need beside PyTorch: pytest, and a setuptools that builds wheels.
"$py" -c "import pytest" >/dev/null 2>&1 || "$py" -m pip install --quiet pytest
"$py" - <<'PY' || "$py" -m pip install --quiet "setuptools>=77,<82"
import sys, setuptools
sys.exit(tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0))
PY
echo "torch: $("$py" -c 'import torch; print(torch.__version__, torch.__file__)')"
# The extension shares PyTorch's C++ runtime: a CXX or CUDAHOSTCXX without the shared libstdc++ (a
# GCC installed with the static runtime alone) is refused by its configure, so the system's g++
# builds it instead where there is one.
for var in CXX CUDAHOSTCXX; do
  compiler=${!var:-}
  if [ -n "$compiler" ] && [ ! -e "$("$compiler" -print-file-name=libstdc++.so 2>/dev/null)" ] &&
    [ -x /usr/bin/g++ ]; then
    echo "torch: $var=$compiler has no shared libstdc++; building with /usr/bin/g++"
    export "$var=/usr/bin/g++"
  fi
done
# The host compiler CMake finds by default; GPU architectures from the environment (default
# 80;90a; the tests build sm_90a alone, which is what runs them on a Hopper GPU).
export RINGATTN_TORCH_CUDA_ARCHITECTURES=${RINGATTN_TORCH_CUDA_ARCHITECTURES:-90a}
"$py" -m pip install --quiet --no-build-isolation --no-deps ./python
[ "$mode" = repeat ] || "$py" -m pytest -q -rs python/tests "$@"
# With no pytest arguments: the training example on CPU threads (2 gloo processes, checked against
# SDPA); in the full and repeat modes the host tests (test_host.py, test_group.py, test_decode.py:
# virtual ranks on threads, 2-4 gloo processes, every refusal) $RINGATTN_TORCH_REPEATS times more
# in a row, so that a race between ranks that shows only now and then fails the run (a machine
# with more cores shows more of them: ask it for more runs there).
if [ $# -eq 0 ] && [ "$mode" != repeat ]; then
  "$py" -m torch.distributed.run --standalone --nproc-per-node 2 \
    examples/06_torch_training/train.py --device cpu --steps 10 --check
fi
if [ $# -eq 0 ] && [ "$mode" != host ]; then
  log="${TMPDIR:-/tmp}/ringattn-host-tests.log"
  repeats=${RINGATTN_TORCH_REPEATS:-5}
  for run in $(seq "$repeats"); do
    "$py" -m pytest -q -p no:cacheprovider -m "not gpu" python/tests/test_host.py \
      python/tests/test_group.py python/tests/test_decode.py \
      >"$log" 2>&1 || { cat "$log"; echo "host tests: run $run of $repeats failed"; exit 1; }
  done
  echo "host tests: $repeats runs in a row passed ($(tail -n 1 "$log"))"
fi
