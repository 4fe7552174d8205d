#!/usr/bin/env bash
# The README's test command. Installs what is missing (scripts/setup.sh), then runs the tests in
# two tiers, each phase announced with the time it takes on a 2-core machine without a GPU:
#   fast  the host, MPI and PyTorch-host tests, with the GPU tests and examples compiled for sm_90a
#         (GPU tests report "Skipped" where no GPU exists);
#   full  what fast leaves out (tests labelled stress or full): the benchmarks, the multi-GPU and
#         MPI-GPU tests and every header compiled by nvcc (sm_90a), the
#         single-GPU suite's device code for sm_80, the host suites under AddressSanitizer +
#         UndefinedBehaviorSanitizer (asan) and ThreadSanitizer (tsan, with the stress repeats:
#         races show there, with the sanitizer watching), the libFuzzer targets for
#         a bounded time (fuzz), and the PyTorch extension with its native kernels' device path
#         (the host tests 5 times in a row against it).
# Usage: scripts/test.sh          both tiers (what CI runs)
#        scripts/test.sh fast     the fast tier alone
#        scripts/test.sh full     the full tier alone (it builds what it needs)
#        scripts/test.sh PRESET   one CMake workflow preset (for instance gpu on a GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
source scripts/setup.sh

# phase NAME EXPECTED COMMAND...: announces a phase, runs it, says how long it took.
phase() {
  local name=$1 expected=$2 t0
  shift 2
  t0=$(date +%s)
  echo "== $name (about $expected on 2 cores)"
  "$@"
  echo "== $name: done in $(($(date +%s) - t0)) s"
}
build_fast() { cmake --preset ci && cmake --build --preset fast; }

tier_fast() {
  local t0
  t0=$(date +%s)
  phase "fast 1/3: configure, build the tests and examples (device code for sm_90a)" "10 min" \
    build_fast
  phase "fast 2/3: the cpu, mpi, packaging, compile and docs tests (gpu: skipped without a GPU)" \
    "1.5 min" ctest --preset fast
  phase "fast 3/3: the PyTorch extension's host path and its tests (a machine's first run also downloads PyTorch, about 5 GB)" \
    "3 min" bash scripts/test_torch.sh host
  echo "== fast tier passed in $(($(date +%s) - t0)) s"
}

tier_full() {
  local t0
  t0=$(date +%s)
  phase "full 1/6: the rest of the sm_90a build (benchmarks, multi-GPU and MPI-GPU tests), every header through nvcc" \
    "8.5 min" cmake --workflow --preset full
  phase "full 2/6: the single-GPU suite's device code for sm_80 (nvcc -cubin)" "2 min" \
    cmake --workflow --preset sm80
  phase "full 3/6: asan (AddressSanitizer + UndefinedBehaviorSanitizer: cpu and mpi suites)" \
    "7 min" cmake --workflow --preset asan
  phase "full 4/6: tsan (ThreadSanitizer: cpu suite, the stress repeats included)" "7 min" \
    cmake --workflow --preset tsan
  phase "full 5/6: fuzz (the planner and validation, bounded time)" "1 min" \
    cmake --workflow --preset fuzz
  phase "full 6/6: the PyTorch extension with its device path; its host tests 5 times in a row" \
    "6.5 min" bash scripts/test_torch.sh repeat
  echo "== full tier passed in $(($(date +%s) - t0)) s"
}

case "${1:-all}" in
all)
  tier_fast
  tier_full
  ;;
fast) tier_fast ;;
full) tier_full ;;
*) cmake --workflow --preset "$1" ;;
esac
echo "== all passed in $(($(date +%s) - started)) s (set-up included)"
