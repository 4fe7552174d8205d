#pragma once
//! \file
//! Creating an NCCL communicator over the ranks of an MPI communicator: rank 0 makes the NCCL
//! unique id and MPI broadcasts it. Needs <mpi.h> and <nccl.h>; link `ringattn::nccl` and
//! `ringattn::mpi`.
//!
//! \code
//! MPI_Init(&argc, &argv);
//! cudaSetDevice(local_rank);              // one GPU per rank, before the communicator
//! auto comm = ringattn::make_nccl_communicator(MPI_COMM_WORLD);
//! \endcode

#include <ringattn/comm/mpi_error.cuh>
#include <ringattn/comm/nccl.cuh>

#include <mpi.h>
#include <nccl.h>

#include <chrono>

namespace ringattn {

//! An `nccl_communicator` with the ranks and order of `comm`, on each rank's current CUDA device.
//! Collective over `comm`. The broadcast of the unique id is MPI's (blocking); the NCCL creation
//! that follows is bounded by `timeout`.
inline nccl_communicator
make_nccl_communicator(MPI_Comm comm,
                       std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  int rank = 0, size = 0;
  RINGATTN_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  RINGATTN_MPI_CHECK(MPI_Comm_size(comm, &size));
  ncclUniqueId id{};
  if (rank == 0) RINGATTN_NCCL_CHECK(ncclGetUniqueId(&id));
  RINGATTN_MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm));
  return nccl_communicator(id, size, rank, timeout);
}

} // namespace ringattn
