// doctest main for tests launched by mpirun (label mpi). Every rank runs every test; rank 0
// reports; the exit code is the maximum over ranks, so a failure on any rank fails the test.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("out", "/dev/null"); // one report, from rank 0
  int failed = context.run();
  // A rank that failed says so on stderr, which rank 0's report cannot show.
  if (failed != 0 && rank != 0) std::fprintf(stderr, "rank %d of %d: tests failed\n", rank, size);
  int worst = 0;
  MPI_Allreduce(&failed, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
