#pragma once
//! \file
//! One collective call of a ring (`forward_host`, `backward_host`, `forward`, `backward`) from the
//! communicator's side: one call at a time per object, the call's identity agreed by every rank
//! before its first block is used, and what a failure leaves behind.
//!
//! Over a communicator with cheap host collectives (in-process, MPI) every call opens with one
//! small all-gather of a `call_header`: which ring (the plan's fingerprint), which call of it,
//! which entry point, which dtype, whether it asks for the max logit (a collective of its own),
//! and whether the rank's own arguments hold (with its reason).
//! So a rank that rejects its arguments, or ranks that disagree on the dtype or the direction,
//! make every rank throw `invalid_argument` before anything is sent, and the communicator stays
//! usable for the next call. A failure after that (a timeout, a peer's abort, an exception in a
//! step) aborts the communicator: it is broken for good, and every later call fails at once
//! asking for a new one. Over NCCL (device collectives only) a rank that rejects its arguments
//! aborts the communicator instead, so that no peer waits on the GPU for it.

#include <ringattn/core/element.cuh>
#include <ringattn/error.cuh>
#include <ringattn/ring/agreement.cuh>
#include <ringattn/ring/workspace.cuh>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace ringattn::detail {

//! The public entry points, as a call header names them.
enum class call_kind : std::uint8_t { forward_host, backward_host, forward, backward };

constexpr const char* to_string(call_kind k) noexcept {
  switch (k) {
  case call_kind::forward_host: return "forward_host";
  case call_kind::backward_host: return "backward_host";
  case call_kind::forward: return "forward";
  case call_kind::backward: return "backward";
  }
  return "?";
}

//! What a rank says of a call before its first block. Trivially copyable: it travels as bytes.
struct call_header {
  std::uint64_t plan = 0; //!< the ring's plan fingerprint (the same on every rank of one ring)
  std::uint64_t call = 0; //!< calls of this object so far, this one included
  call_kind kind = call_kind::forward_host;
  dtype type = dtype::bf16;
  std::uint8_t max_logit = 0; //!< 1: the call asks for the max logit
  std::uint8_t ok = 1;        //!< 0: this rank rejected its arguments
  char reason[160] = {};      //!< its reason, cut to fit
};

//! Communicators whose collectives run on the host and cost microseconds: every call is agreed.
template <class C>
concept agrees_every_call = requires {
  requires C::host_collectives;
};

//! Requires that a call whose largest message is `bytes` fits the communicator's messages (MPI:
//! an int count of bytes). The same verdict on every rank: blocks are sized by the plan.
template <class C>
void require_message_size(validation& v, const C& comm, std::size_t bytes, const char* call) {
  if constexpr (requires { comm.max_message_bytes(); })
    v.require(bytes <= comm.max_message_bytes(), call, " would send blocks of up to ", bytes,
              " bytes; this communicator's messages hold at most ", comm.max_message_bytes(),
              " (use more ranks, or fewer kv heads per ring)");
}

//! `what` without the location a communicator put first ("ringattn: rank R: ", "ringattn: rank
//! R, all-gather: "), for a message that names the call instead.
inline std::string without_location(const std::string& what, int rank) {
  const std::string head = "ringattn: rank " + std::to_string(rank);
  if (!what.starts_with(head) || what.size() == head.size()) return what;
  if (what[head.size()] != ':' && what[head.size()] != ',') return what;
  const std::size_t colon = what.find(": ", head.size());
  return colon == std::string::npos ? what : what.substr(colon + 2);
}

//! The call guard of one `ring_attention` object.
template <class Communicator>
class call_gate {
public:
  //! At plan time: `forward_message` (the forward's largest message at 2 bytes an element) must
  //! fit the communicator's messages, on every rank alike.
  call_gate(Communicator& comm, std::uint64_t plan, std::size_t forward_message)
      : comm_(comm), plan_(plan), all_(static_cast<std::size_t>(comm.size())) {
    validation fits = validation::ok();
    require_message_size(fits, comm, forward_message, "the forward");
    fits.throw_if_invalid();
  }

  //! Runs `body` as call `kind` with element type `type` (its messages laid out by `layout`),
  //! after the checks in the file notes; `own` is this rank's validation of the call's arguments,
  //! `max_logit` whether it asks for the max logit.
  template <class Layout, class Body>
  requires requires(const Layout& l) { l.largest_message(true); }
  void run(const validation& own, call_kind kind, dtype type, const Layout& layout, Body&& body,
           bool max_logit = false) {
    const bool backward = kind == call_kind::backward || kind == call_kind::backward_host;
    run(own, kind, type, layout.largest_message(backward), std::forward<Body>(body), max_logit);
  }
  //! The same for a call whose largest message is `largest_message` bytes.
  template <class Body>
  void run(const validation& own, call_kind kind, dtype type, std::size_t largest_message,
           Body&& body, bool max_logit = false) {
    validation ok = own;
    require_message_size(ok, comm_, largest_message, to_string(kind));
    error_rank_scope scope(comm_.rank());
    if (busy_.exchange(true))
      throw invalid_argument("ringattn: another call on this object is running (one call at a "
                             "time per object; one object per rank's thread)");
    struct release {
      std::atomic<bool>& flag;
      ~release() { flag.store(false); }
    } done{busy_};
    // A communicator that can tell holds this rank for the whole call, so that another object's
    // call on the same rank at the same time is refused instead of trading messages with it.
    [[maybe_unused]] const auto use = [&] {
      if constexpr (requires { comm_.enter_call(); })
        return comm_.enter_call();
      else
        return 0;
    }();
    if constexpr (agrees_every_call<Communicator>) {
      agree(ok, kind, type, max_logit);
    } else {
      if (!ok) comm_.abort(ok.reason());
      ok.throw_if_invalid();
    }
    try {
      body();
    } catch (const std::exception& e) {
      comm_.abort(e.what());
      throw;
    } catch (...) {
      comm_.abort("an exception not derived from std::exception");
      throw;
    }
  }

  //! Names what later calls run (a new plan of the same ranks, agreed by them all).
  void replan(std::uint64_t plan) noexcept { plan_ = plan; }

private:
  // One all-gather of every rank's header (into storage made at plan time: a call allocates
  // nothing), then the same verdict on every rank.
  void agree(const validation& ok, call_kind kind, dtype type, bool max_logit) {
    call_header mine;
    mine.plan = plan_;
    mine.call = ++calls_;
    mine.kind = kind;
    mine.type = type;
    mine.max_logit = max_logit ? 1 : 0;
    mine.ok = ok ? 1 : 0;
    const std::string& why = ok.reason();
    std::memcpy(mine.reason, why.data(), std::min(why.size(), sizeof mine.reason - 1));
    if constexpr (requires { comm_.begin_call(mine.call); }) comm_.begin_call(mine.call);
    try {
      comm_.all_gather(&mine, sizeof mine, all_.data());
    } catch (const communication_error& e) { // a rank missing: the communicator is broken now
      const std::string m =
          concat("ringattn: rank ", comm_.rank(), ", call ", mine.call, " (", to_string(kind),
                 "): ", without_location(e.what(), comm_.rank()));
      comm_.abort(m);
      throw communication_error(m);
    }
    ok.throw_if_invalid();
    validation v = validation::ok();
    for (std::size_t r = 0; r < all_.size() && v; ++r) {
      const char* why = all_[r].reason; // NUL-terminated by its sender, but never trusted
      v.require(all_[r].ok == 1, "rank ", r, " rejected call ", all_[r].call, " (",
                to_string(all_[r].kind),
                "): ", std::string(why, std::find(why, why + sizeof mine.reason, '\0')));
    }
    const call_header& first = all_[0];
    for (std::size_t r = 1; r < all_.size() && v; ++r) {
      const call_header& x = all_[r];
      v.require(x.plan == first.plan, "rank ", r,
                " calls another ring than rank 0 (the plans differ: every rank calls the same "
                "ring_attention objects in the same order)");
      v.require(x.call == first.call, "rank ", r, " is at call ", x.call,
                " of this ring but rank 0 at call ", first.call);
      v.require(x.kind == first.kind, "rank ", r, " calls ", to_string(x.kind),
                " but rank 0 calls ", to_string(first.kind));
      v.require(x.type == first.type, "rank ", r, " calls ", to_string(x.kind), " with ",
                to_string(x.type), " but rank 0 with ", to_string(first.type));
      v.require(x.max_logit == first.max_logit, "rank ", r,
                x.max_logit ? " asks for the max logit but rank 0 does not"
                            : " passes no max_logit but rank 0 does",
                " (every rank passes a buffer, or none does)");
    }
    v.throw_if_invalid();
  }

  Communicator& comm_;
  std::uint64_t plan_;
  std::uint64_t calls_ = 0;
  std::vector<call_header> all_;
  std::atomic<bool> busy_{false};
};

} // namespace ringattn::detail
