#pragma once
// A seed drawn on rank 0 and broadcast, so that every MPI rank builds the same test case.
#include "../support/common.hpp"

#include <mpi.h>

#include <cstdint>

namespace ringattn::test {
inline std::uint64_t shared_seed() {
  std::uint64_t seed = fresh_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}
} // namespace ringattn::test
