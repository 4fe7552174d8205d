#pragma once
//! \file
//! Checked NCCL calls (needs <nccl.h>; link ringattn::nccl).
//!
//! \code
//! RINGATTN_NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank));
//! \endcode

#include <ringattn/error.cuh>

#include <nccl.h>

#include <string>

namespace ringattn::detail {
//! Throws `communication_error` naming the call, NCCL's error text (and its last error message,
//! which often says which peer or transport failed) and the rank.
inline void check_nccl(ncclResult_t code, const char* call, const char* file, int line) {
  if (code == ncclSuccess || code == ncclInProgress) return;
  std::string msg = ncclGetErrorString(code);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') msg += std::string(": ") + last;
  throw communication_error(call_failure(call, msg, file, line));
}
} // namespace ringattn::detail

//! Evaluates an NCCL call and throws `ringattn::communication_error` if it fails. ncclInProgress
//! (non-blocking communicators) is not a failure.
#define RINGATTN_NCCL_CHECK(call) ::ringattn::detail::check_nccl((call), #call, __FILE__, __LINE__)
