#!/usr/bin/env bash
# The README's main command: installs what is missing, builds and runs examples/01_quickstart.
# Extra arguments go to the example (e.g. --ranks 8 --tokens 131072 --mask full).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
cmake --preset ci >/dev/null
cmake --build --preset quickstart
./build/ci/examples/quickstart "$@"
