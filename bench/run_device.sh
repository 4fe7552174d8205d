#!/usr/bin/env bash
# One lease of the H200 machine: probe, build (preset gpu), run every test, compute-sanitizer on
# the GPU suite, and the benchmarks. Writes logs and JSON to $OUT (the device tool brings it back).
# Tools missing there (doctest, Google Benchmark's library) come from a carried .device/ folder.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/build/device-out}"
mkdir -p "$OUT"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  cmake --version | head -1; g++ --version | head -1; nvcc --version | tail -1
  ls -d /usr/include/doctest /usr/local/include/doctest /usr/include/benchmark 2>&1
  ldconfig -p | grep -E "libbenchmark|libnccl|libmpi\.so" ; which mpirun compute-sanitizer
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

extra=(-DRINGATTN_WERROR=OFF)
if [ ! -f /usr/include/doctest/doctest.h ] && [ ! -f /usr/local/include/doctest/doctest.h ]; then
  extra+=(-DRINGATTN_DOCTEST_INCLUDE_DIR="$PWD/.device/include")
fi
if ! ldconfig -p | grep -q "libbenchmark.so"; then
  extra+=(-DRINGATTN_BENCHMARK_INCLUDE_DIR="$PWD/.device/include"
          -DRINGATTN_BENCHMARK_LIBRARY="$PWD/.device/lib/libbenchmark.so")
  export LD_LIBRARY_PATH="$PWD/.device/lib:${LD_LIBRARY_PATH:-}"
fi
cmake --preset gpu "${extra[@]}" > "$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
cmake --build --preset gpu -j 16 > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
grep -c "warning" "$OUT/build.log" | sed 's/^/build warnings: /'

ctest --test-dir build/gpu -j 8 --output-on-failure > "$OUT/ctest.log" 2>&1
echo "ctest exit $?"; tail -25 "$OUT/ctest.log"

gpu_exe=build/gpu/test/ringattn_test_gpu
for tool in memcheck racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool" >> "$OUT/sanitizer.log"
  RINGATTN_TEST_SMALL=1 timeout 400 compute-sanitizer --tool $tool --error-exitcode 99 $gpu_exe --no-intro=true \
    >> "$OUT/sanitizer.log" 2>&1
  echo "compute-sanitizer $tool exit $?"
done
grep -E "^== compute|ERROR SUMMARY|test cases" "$OUT/sanitizer.log"

# Benchmarks: ours first, then PyTorch SDPA at the same shapes, in this one lease.
if [ -x build/gpu/bench/bench_scatter_gather ] && [ "${RINGATTN_BENCH_SCATTER:-1}" = 1 ]; then
  build/gpu/bench/bench_scatter_gather --benchmark_out="$OUT/scatter_gather.json" \
    --benchmark_out_format=json 2>&1 | tail -3
fi
if [ -x build/gpu/bench/bench_block_forward ]; then
  build/gpu/bench/bench_block_forward --benchmark_out="$OUT/block_forward.json" \
    --benchmark_out_format=json --benchmark_counters_tabular=true 2>&1 | grep -v "^\*\*\*" | tee "$OUT/bench.txt" | cut -c1-150
fi
if [ -x build/gpu/bench/bench_forward_tuning ]; then
  echo "== bench_forward_tuning" >> "$OUT/bench.txt"
  build/gpu/bench/bench_forward_tuning 2>&1 | grep -E "^d[0-9]" | tee -a "$OUT/bench.txt" | cut -c1-40,100-150
fi
python3 bench/sdpa_baseline.py "$OUT/sdpa.json" 2>&1 | tail -50
