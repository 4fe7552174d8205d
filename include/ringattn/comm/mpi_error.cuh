#pragma once
//! \file
//! Checked MPI calls (needs <mpi.h>; link ringattn::mpi). The communicator that uses them sets the
//! error handler of its communicator to MPI_ERRORS_RETURN so failures come back as codes.
//!
//! \code
//! RINGATTN_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_INT, MPI_MAX, comm));
//! \endcode

#include <ringattn/error.cuh>

#include <mpi.h>

#include <string>

namespace ringattn::detail {
//! Throws `communication_error` naming the call, MPI's error text and the calling rank.
inline void check_mpi(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  const std::string msg = length > 0 ? std::string(text, static_cast<std::size_t>(length))
                                     : "MPI error " + std::to_string(code);
  int rank = current_error_rank();
  if (rank < 0) {
    // Name the world rank when no communicator has said which rank this thread is.
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized || MPI_Comm_rank(MPI_COMM_WORLD, &rank) != MPI_SUCCESS) rank = -1;
  }
  error_rank_scope scope(rank);
  throw communication_error(call_failure(call, msg, file, line));
}
} // namespace ringattn::detail

//! Evaluates an MPI call and throws `ringattn::communication_error` if it fails.
#define RINGATTN_MPI_CHECK(call) ::ringattn::detail::check_mpi((call), #call, __FILE__, __LINE__)
