#!/usr/bin/env bash
# The README's test command: installs what is missing, then configures, builds and runs every
# test (labels cpu, mpi, gpu, packaging, compile), then the sanitizer runs and the PyTorch
# extension's tests. GPU tests report "Skipped" where no GPU exists.
# Usage: scripts/test.sh [workflow preset]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
# With no argument: the ci workflow, then the host suites again under AddressSanitizer +
# UndefinedBehaviorSanitizer (asan: cpu and mpi), ThreadSanitizer (tsan: cpu) and the libFuzzer
# targets for a bounded time (fuzz), then the PyTorch extension's tests (scripts/test_torch.sh). A
# preset name runs that workflow alone (for instance gpu on a GPU machine).
if [ $# -gt 0 ]; then
  cmake --workflow --preset "$1"
else
  for preset in ci asan tsan fuzz; do
    echo "== workflow $preset"
    cmake --workflow --preset "$preset"
  done
  echo "== PyTorch extension"
  bash scripts/test_torch.sh
fi
