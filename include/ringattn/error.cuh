#pragma once
//! \file
//! Errors and argument validation.
//!
//! Two kinds of failure, kept apart on purpose:
//! - *Invalid arguments* are found before any work starts. `validate()`-style functions return a
//!   `validation` that says in words what is wrong; `validation::throw_if_invalid()` turns it into
//!   an `invalid_argument`. Nothing has been launched or written when that happens.
//! - *Run-time failures* of CUDA, NCCL or MPI calls throw a `ringattn::error` (or a subclass) whose
//!   message carries the failing call, the library's error text, the rank that saw it and the
//!   source location. A header never calls `exit()` or `abort()`.
//!
//! \code
//! auto v = ringattn::validation::ok();
//! v.require(q_heads % kv_heads == 0, "q_heads (", q_heads, ") is not a multiple of kv_heads (",
//!           kv_heads, ")");
//! v.throw_if_invalid();           // throws ringattn::invalid_argument with that sentence
//! \endcode

#include <ringattn/config.cuh>

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace ringattn {

//! Base of every exception the library throws.
class error : public std::runtime_error {
public:
  explicit error(const std::string& what) : std::runtime_error(what) {}
};

//! Arguments rejected by validation; thrown before any kernel runs or any output is touched.
class invalid_argument : public error {
public:
  explicit invalid_argument(const std::string& what) : error(what) {}
};

//! A CUDA runtime call failed.
class cuda_error : public error {
public:
  cuda_error(const std::string& what, int code) : error(what), code_(code) {}
  //! The `cudaError_t` value.
  [[nodiscard]] int code() const noexcept { return code_; }

private:
  int code_;
};

//! A communication library (NCCL or MPI) call failed, or a bounded wait expired.
class communication_error : public error {
public:
  explicit communication_error(const std::string& what) : error(what) {}
};

//! The rank that errors raised on this thread are attributed to (-1: none). Communicators set it
//! for the threads that act as ranks, so an error names the rank that saw it.
inline int& current_error_rank() noexcept {
  thread_local int rank = -1;
  return rank;
}

//! Sets `current_error_rank()` for a scope and restores the previous value afterwards.
class error_rank_scope {
public:
  explicit error_rank_scope(int rank) noexcept : previous_(current_error_rank()) {
    current_error_rank() = rank;
  }
  ~error_rank_scope() { current_error_rank() = previous_; }
  error_rank_scope(const error_rank_scope&) = delete;
  error_rank_scope& operator=(const error_rank_scope&) = delete;

private:
  int previous_;
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

//! "ringattn: <call> failed: <text> [rank r] (file:line)".
inline std::string call_failure(const char* call, const std::string& text, const char* file,
                                int line) {
  std::ostringstream s;
  s << "ringattn: " << call << " failed: " << text;
  if (current_error_rank() >= 0) s << " [rank " << current_error_rank() << "]";
  s << " (" << file << ":" << line << ")";
  return s.str();
}
} // namespace detail

//! The outcome of validating arguments: ok, or the first reason they were rejected.
class validation {
public:
  //! A passing validation, to which `require` adds conditions.
  [[nodiscard]] static validation ok() { return validation{}; }
  //! A failed validation with the given reason.
  [[nodiscard]] static validation fail(std::string reason) {
    validation v;
    v.reason_ = std::move(reason);
    v.ok_ = false;
    return v;
  }

  //! Records the failure `parts...` (streamed into one sentence) unless `condition` holds. Only
  //! the first failure is kept: it is the one that explains the rest.
  template <class... Parts>
  validation& require(bool condition, const Parts&... parts) {
    if (!condition && ok_) {
      ok_ = false;
      reason_ = detail::concat(parts...);
    }
    return *this;
  }
  //! Merges another validation in (its reason wins only if this one still passes).
  validation& require(const validation& other) {
    if (!other.ok_ && ok_) *this = other;
    return *this;
  }

  [[nodiscard]] bool is_ok() const noexcept { return ok_; }
  explicit operator bool() const noexcept { return ok_; }
  //! Why the arguments were rejected; empty when they were not.
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

  //! Throws `invalid_argument("ringattn: " + reason())` if validation failed.
  void throw_if_invalid() const {
    if (!ok_) throw invalid_argument("ringattn: " + reason_);
  }

private:
  bool ok_ = true;
  std::string reason_;
};

} // namespace ringattn
