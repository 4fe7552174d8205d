#!/usr/bin/env bash
# On a machine with several H200s. Phases (RINGATTN_PHASE, default "all"; each phase fits in ten
# minutes):
#   tests: every gpu-labelled test (the multigpu suite included: in-process groups spread over the
#          GPUs, NCCL with a thread per GPU, other-device bad input, a peer missing mid-ring) and
#          compute-sanitizer memcheck/racecheck over the multigpu suite's small in-process cases;
#   bench: for P in 1 and every power of two up to the GPU count, (1) correctness:
#          examples/02_mpi_nccl under mpirun -np P for every partitioner x {causal, full}, checked
#          against the float64 oracle on a sample, and test/ringattn_test_mpi_nccl (forward and
#          backward, every partitioner x mask, whole shards against the oracle); (2) the ring over NCCL (bench_ring_nccl:
#          forward with and without the exchange, raw ring bandwidth); (3) PyTorch context
#          parallel at the same shapes (bench/baselines/torch_cp_baseline.py under torchrun); plus our block
#          kernel on one GPU at the local sizes, the denominator of parallel efficiency. Then
#            python3 bench/scripts/report_multi_gpu.py $OUT plot.png
#          makes the table and the scaling plot.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and PyTorch's equivalent), as those machines
# require.
#
# RINGATTN_PREBUILT=build/h200: a tree built elsewhere for sm_90a (same source path), else the gpu
# preset is configured and built here. At most 8 files land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/build/multi-gpu-out}"
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PHASE="${RINGATTN_PHASE:-all}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
GPUS="${RINGATTN_GPUS:-$(nvidia-smi -L | wc -l)}"
BUILD="${RINGATTN_PREBUILT:-build/gpu}"
if [ -n "${RINGATTN_PREBUILT:-}" ]; then
  export LD_LIBRARY_PATH="$PWD/.deps/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
else
  cmake --preset gpu -DRINGATTN_WERROR=OFF > "$OUT/log.txt" 2>&1 &&
    cmake --build --preset gpu -j "$(nproc)" --target mpi_nccl ringattn_test_mpi_nccl \
      bench_ring_nccl bench_block_forward bench_block_backward >> "$OUT/log.txt" 2>&1 || { tail -30 "$OUT/log.txt"; exit 1; }
fi
{
  date -u; nvidia-smi --query-gpu=index,name,driver_version --format=csv; nvidia-smi topo -m
  git rev-parse --short HEAD 2>/dev/null; echo "GPUs: $GPUS"
} >> "$OUT/log.txt" 2>&1

if [ "$PHASE" = all ] || [ "$PHASE" = tests ]; then
  echo "== tests (ctest -L gpu)" | tee -a "$OUT/log.txt"
  timeout 360 ctest --test-dir "$BUILD" -L gpu --output-on-failure > "$OUT/ctest.log" 2>&1
  echo "ctest exit $?" | tee -a "$OUT/log.txt"; grep -E "tests passed|Test +#|Skipped|Failed" "$OUT/ctest.log" | tee -a "$OUT/log.txt"
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool (multigpu, in-process and other-device cases)" >> "$OUT/sanitizer.log"
    RINGATTN_TEST_SMALL=1 timeout 110 compute-sanitizer --tool $tool --report-api-errors no \
      --error-exitcode 99 "$BUILD/test/ringattn_test_multigpu" --no-intro=true \
      --test-case='*in-process*,*another device*' >> "$OUT/sanitizer.log" 2>&1
    echo "compute-sanitizer $tool exit $?" | tee -a "$OUT/log.txt"
  done
  grep -E "^== compute|ERROR SUMMARY|test cases" "$OUT/sanitizer.log" | tee -a "$OUT/log.txt"
fi
[ "$PHASE" = all ] || [ "$PHASE" = bench ] || exit 0

counts=(1)
for p in 2 4 8; do [ "$p" -le "$GPUS" ] && counts+=("$p"); done
for p in "${counts[@]}"; do
  echo "== P = $p: correctness" | tee -a "$OUT/log.txt"
  for part in zigzag round_robin contiguous; do
    for mask in causal full; do
      timeout 300 mpirun -np "$p" "$BUILD/examples/mpi_nccl" --tokens $((p * 4096 + 1001)) \
        --partitioner "$part" --mask "$mask" --iterations 2 2>&1 | tail -2 | tee -a "$OUT/log.txt"
    done
  done
  echo "== P = $p: forward and backward against the oracle (ringattn_test_mpi_nccl)" |
    tee -a "$OUT/log.txt"
  timeout 300 mpirun -np "$p" "$BUILD/test/ringattn_test_mpi_nccl" 2>&1 |
    grep -E "gradient|test cases|assertions|SKIPPED|ERROR|rank [0-9]" | tee -a "$OUT/log.txt"
  echo "== P = $p: ring over NCCL" | tee -a "$OUT/log.txt"
  timeout 600 mpirun -np "$p" "$BUILD/bench/bench_ring_nccl" \
    --benchmark_out="$OUT/ring_nccl_$p.json" --benchmark_out_format=json 2>&1 |
    grep -E "^ring_" | cut -c1-160 | tee -a "$OUT/log.txt"
done
echo "== PyTorch context parallel" | tee -a "$OUT/log.txt"
for p in "${counts[@]}"; do
  timeout 900 torchrun --nproc-per-node "$p" bench/baselines/torch_cp_baseline.py "$OUT/torch_cp_$p.json" \
    2>&1 | grep -E "^\{|Error" | tee -a "$OUT/log.txt"
done
python3 - "$OUT" <<'PY' >> "$OUT/log.txt" 2>&1
import json, sys, glob
merged = {"runs": {}}
for f in sorted(glob.glob(sys.argv[1] + "/torch_cp_*.json")):
    merged["runs"][f.rsplit("_", 1)[1].split(".")[0]] = json.load(open(f))
json.dump(merged, open(sys.argv[1] + "/torch_cp.json", "w"), indent=1)
PY
rm -f "$OUT"/torch_cp_[0-9]*.json
echo "== one GPU: our block kernel at the local sizes" | tee -a "$OUT/log.txt"
"$BUILD/bench/bench_block_forward" \
  --benchmark_filter='tokens:(8192|32768)/kv_heads:8/head_dim:128/causal:./merge:1/path:1' \
  --benchmark_out="$OUT/block_local.json" --benchmark_out_format=json 2>&1 | grep -E "^block" |
  cut -c1-150 | tee -a "$OUT/log.txt"
if [ -x "$BUILD/bench/bench_block_backward" ]; then
  "$BUILD/bench/bench_block_backward" \
    --benchmark_filter='tokens:(8192|32768)/kv_heads:8/causal:./path:4/kernels:0' \
    --benchmark_out="$OUT/block_backward_local.json" --benchmark_out_format=json 2>&1 |
    grep -E "^block" | cut -c1-150 | tee -a "$OUT/log.txt"
fi
