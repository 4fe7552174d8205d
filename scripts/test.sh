#!/usr/bin/env bash
# The README's test command: installs what is missing, then configures, builds and runs every
# test (labels cpu, mpi, gpu, packaging, compile). GPU tests report "Skipped" where no GPU exists.
# Usage: scripts/test.sh [workflow preset, default ci]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
preset="${1:-ci}"
cmake --workflow --preset "$preset"
