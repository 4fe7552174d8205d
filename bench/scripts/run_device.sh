#!/usr/bin/env bash
# On a machine with one Hopper GPU: probe, build (preset gpu), run every test, compute-sanitizer
# on the GPU suite, and the benchmarks. Writes logs and JSON to $OUT (default build/device-out).
# Tools missing there (doctest, Google Benchmark's library) may be put in .deps/include and
# .deps/lib.
#
# RINGATTN_PREBUILT=build/h200: use a tree configured and built elsewhere for sm_90a (same source
# path) instead of building here, and run only its gpu-labelled tests (the cpu and mpi suites run
# in CI). RINGATTN_BENCH_SCATTER=0 skips the scatter/gather benchmark;
# RINGATTN_BENCH_TUNING=1 adds the mma.sync tile-shape experiments (a build with
# -DRINGATTN_BUILD_EXPERIMENTS=ON). RINGATTN_SKIP_TESTS=1 and
# RINGATTN_SKIP_BENCH=1 split the work into two runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/build/device-out}"
BUILD="${RINGATTN_PREBUILT:-build/gpu}"
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
  extra+=(-DRINGATTN_DOCTEST_INCLUDE_DIR="$PWD/.deps/include")
fi
if ! ldconfig -p | grep -q "libbenchmark.so"; then
  extra+=(-DRINGATTN_BENCHMARK_INCLUDE_DIR="$PWD/.deps/include"
          -DRINGATTN_BENCHMARK_LIBRARY="$PWD/.deps/lib/libbenchmark.so")
  export LD_LIBRARY_PATH="$PWD/.deps/lib:${LD_LIBRARY_PATH:-}"
fi
if [ -n "${RINGATTN_PREBUILT:-}" ]; then
  # Binaries built elsewhere link the libraries carried in .deps/lib (Google Benchmark, cudart).
  export LD_LIBRARY_PATH="$PWD/.deps/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
fi
if [ "${RINGATTN_SKIP_TESTS:-0}" = 1 ]; then
  :
elif [ -z "${RINGATTN_PREBUILT:-}" ]; then
  cmake --preset gpu "${extra[@]}" > "$OUT/configure.log" 2>&1 || { tail -40 "$OUT/configure.log"; exit 1; }
  cmake --build --preset gpu -j 16 > "$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }
  grep -c "warning" "$OUT/build.log" | sed 's/^/build warnings: /'
  ctest --test-dir "$BUILD" -j 8 --output-on-failure > "$OUT/ctest.log" 2>&1
  echo "ctest exit $?"; tail -25 "$OUT/ctest.log"
else
  ctest --test-dir "$BUILD" -L gpu --output-on-failure > "$OUT/ctest.log" 2>&1
  echo "ctest exit $?"; tail -25 "$OUT/ctest.log"
fi

# The PyTorch extension: built against python3's PyTorch, its tests (GPU ones included), and the
# training example against single-GPU SDPA.
if [ "${RINGATTN_SKIP_TESTS:-0}" != 1 ] && python3 -c "import torch" >/dev/null 2>&1; then
  bash scripts/test_torch.sh > "$OUT/torch_tests.log" 2>&1
  echo "torch extension tests exit $?"; tail -3 "$OUT/torch_tests.log"
  torchrun --nproc-per-node 1 examples/06_torch_training/train.py --steps 30 --check 2>&1 | tail -1
fi

gpu_exe=$BUILD/test/ringattn_test_gpu
[ "${RINGATTN_SKIP_TESTS:-0}" = 1 ] || for tool in memcheck racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool" >> "$OUT/sanitizer.log"
  # --report-api-errors no: NCCL probes its kernels with cudaFuncGetAttributes and gets error 209
  # (no image) by design; the library's own CUDA calls are checked by RINGATTN_CUDA_CHECK.
  RINGATTN_TEST_SMALL=1 timeout 400 compute-sanitizer --tool $tool --report-api-errors no \
    --error-exitcode 99 $gpu_exe --no-intro=true \
    >> "$OUT/sanitizer.log" 2>&1
  echo "compute-sanitizer $tool exit $?"
done
[ -f "$OUT/sanitizer.log" ] && grep -E "^== compute|ERROR SUMMARY|test cases" "$OUT/sanitizer.log"
[ "${RINGATTN_SKIP_BENCH:-0}" = 1 ] && exit 0

# Benchmarks: ours first, then PyTorch SDPA at the same shapes, in the same run.
if [ -x $BUILD/bench/bench_scatter_gather ] && [ "${RINGATTN_BENCH_SCATTER:-1}" = 1 ]; then
  $BUILD/bench/bench_scatter_gather --benchmark_out="$OUT/scatter_gather.json" \
    --benchmark_out_format=json 2>&1 | tail -3
fi
if [ -x $BUILD/bench/bench_block_forward ]; then
  $BUILD/bench/bench_block_forward --benchmark_out="$OUT/block_forward.json" \
    --benchmark_out_format=json --benchmark_counters_tabular=true 2>&1 | grep -v "^\*\*\*" | tee "$OUT/bench.txt" | cut -c1-150
fi
if [ -x $BUILD/bench/bench_forward_tuning ] && [ "${RINGATTN_BENCH_TUNING:-0}" = 1 ]; then
  echo "== bench_forward_tuning" >> "$OUT/bench.txt"
  $BUILD/bench/bench_forward_tuning 2>&1 | grep -E "^d[0-9]" | tee -a "$OUT/bench.txt" | cut -c1-40,100-150
fi
if [ -x $BUILD/bench/bench_ring_forward ]; then
  $BUILD/bench/bench_ring_forward --benchmark_out="$OUT/ring_forward.json" \
    --benchmark_out_format=json --benchmark_counters_tabular=true 2>&1 | grep -v "^\*\*\*" | tee "$OUT/ring.txt" | cut -c1-150
fi
if [ -x $BUILD/bench/bench_block_backward ]; then
  $BUILD/bench/bench_block_backward --benchmark_out="$OUT/block_backward.json" \
    --benchmark_out_format=json 2>&1 | grep -E "^block" | cut -c1-150
fi
python3 bench/baselines/sdpa_baseline.py "$OUT/sdpa.json" 2>&1 | tail -50
python3 bench/baselines/sdpa_baseline.py "$OUT/sdpa_backward.json" --backward 2>&1 | tail -20
python3 bench/baselines/sdpa_baseline.py "$OUT/sdpa_widths.json" --widths 2>&1 | tail -12
if grep -q '"schedules/' "$OUT/ring_forward.json" 2>/dev/null; then
  # The ring against the all-gather schedule (its rows of the same run).
  python3 bench/scripts/report_schedules.py "$OUT/ring_forward.json"
fi
if [ -x $BUILD/bench/bench_sharded_decode ]; then
  # A decode step over a sharded KV cache, and PyTorch SDPA over the whole cache.
  $BUILD/bench/bench_sharded_decode --benchmark_out="$OUT/decode.json" \
    --benchmark_out_format=json 2>&1 | grep -E "^decode" | cut -c1-150
  python3 bench/baselines/sdpa_baseline.py "$OUT/sdpa_decode.json" --decode 2>&1 | tail -4
  python3 bench/scripts/report_decode.py "$OUT/decode.json" "$OUT/sdpa_decode.json" \
    --bundle "$OUT/sharded_decode.json"
fi
if grep -q '"cudnn_block' "$OUT/ring_forward.json" 2>/dev/null; then
  # The cuDNN block kernel's rows (a build with ringattn::cudnn) against one PyTorch call.
  python3 bench/baselines/sdpa_baseline.py "$OUT/sdpa_ring.json" --ring 2>&1 | tail -4
  python3 bench/scripts/report_cudnn.py "$OUT/ring_forward.json" "$OUT/sdpa.json" \
    "$OUT/sdpa_backward.json" "$OUT/sdpa_ring.json" --bundle "$OUT/cudnn.json"
fi
if python3 -c "import ringattn_torch" >/dev/null 2>&1; then
  # The extension on one rank against SDPA and PyTorch context parallel, same job.
  torchrun --nproc-per-node 1 bench/torch_extension.py "$OUT/torch_extension.json" 2>&1 | tail -2
  python3 bench/scripts/report_torch_extension.py "$OUT/torch_extension.json"
  # The extension's decode step against SDPA over the whole cache, same job.
  torchrun --nproc-per-node 1 bench/torch_decode.py "$OUT/torch_decode.json" 2>&1 | grep " ms "
fi
