// doctest main for GPU tests launched by mpirun (labels mpi and gpu). Without a usable CUDA device
// every rank returns 77 (CTest: Skipped); so does a build with RINGATTN_TEST_GPU_PER_RANK=1 (NCCL,
// which refuses two ranks on one GPU) with fewer GPUs than ranks. Otherwise rank r uses GPU r %
// (visible GPUs); every rank runs every test, rank 0 reports, and the exit code is the maximum over
// ranks.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0, devices = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    if (rank == 0) std::printf("SKIPPED: no usable CUDA device\n");
    MPI_Finalize();
    return 77;
  }
#if RINGATTN_TEST_GPU_PER_RANK
  if (devices < size) {
    if (rank == 0) std::printf("SKIPPED: %d ranks need %d GPUs, %d visible\n", size, size, devices);
    MPI_Finalize();
    return 77;
  }
#endif
  cudaSetDevice(rank % devices);
  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("out", "/dev/null");
  int failed = context.run();
  if (failed != 0 && rank != 0) std::fprintf(stderr, "rank %d of %d: tests failed\n", rank, size);
  int worst = 0;
  MPI_Allreduce(&failed, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
