#pragma once
//! \file
//! A schedule's work as one program per direction, run by an engine. The program decides every
//! message (what travels, how many bytes, to and from whom, with which tag) and the order of the
//! computes and the messages; an engine carries them out on its memory:
//!
//! - the host engines (`host_forward_engine`, `host_backward_engine`; ring/host_engine.cuh):
//!   host memory, each message a blocking exchange, the BlockKernel's host block (in-process
//!   threads, MPI processes; CI);
//! - the device engines (`device_forward_engine`, `device_backward_engine`;
//!   ring/device_engine.cuh): device memory, the computes on the call's stream and the messages
//!   on the communication stream, ordered by events, so that the exchange of step t + 1 runs
//!   beside the compute of step t;
//! - `trace_engine` (here): records the messages and does nothing else (the tests compare it with
//!   what a communicator saw).
//!
//! Both engines run the same program, so the host path sends what the device path sends, in the
//! same order: CI checks the GPU's protocol.
//!
//! A program is a type (`ring_program`, `all_gather_program`) with
//! `workspace(schedule, args, format)` (the slots it needs, for blocks of that `element_format`),
//! `forward(engine, schedule, workspace)` and `backward(engine, schedule, workspace)`; a Schedule
//! model names it. The all-to-all's program
//! is in ring/all_to_all_program.cuh; the sharded decode's step is `decode_program` (below).
//!
//! The vocabulary an engine provides (a `step` is a `ring_step` of the schedule, a `slot` a block
//! buffer of the workspace):
//! - forward: `start_forward()`, `forward(step, slot)`, `finish_forward()`, and `forward_direct()`
//!   (true where the engine computed the call in one block call, with nothing to exchange);
//! - backward: `start_backward()`, `backward_direct()`, and per schedule: the ring's
//!   `backward(step, slot)` (the step's share added to the block's travelling sum) and
//!   `finish_backward(home)` (`home`: the slot this rank's own dK/dV came back into, or -1: they
//!   stayed in slot 0); the all-gather's `backward_share(step, slot)` (the block's share into its
//!   slot's sums) and `finish_shares()` (the shares received added to the own block's);
//! - both: `exchange(message)`.

#include <ringattn/arguments.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace ringattn::detail {

//! What a message carries: a block's K/V, a block's fp32 dK/dV sum on its way round (the ring),
//! a complete block's dK/dV going home to its owner (the ring's last message), a block's fp32
//! dK/dV share going back to its owner (the all-gather; received into share buffer `recv_slot`),
//! or a rank's finished partial of the new rows (the sharded decode; slot: the sender's rank).
enum class payload { kv, grad, home, share, partial };

inline const char* to_string(payload p) {
  return p == payload::kv      ? "kv"
         : p == payload::grad  ? "grad"
         : p == payload::home  ? "home"
         : p == payload::share ? "share"
                               : "partial";
}

//! One exchange: `send_bytes` of slot `send_slot` to rank `to`, and `recv_bytes` into slot
//! `recv_slot` from rank `from`, numbered `tag`. A side of zero bytes sends or receives nothing.
struct message {
  payload what = payload::kv;
  int send_slot = 0, recv_slot = 0;
  std::int64_t send_tokens = 0, recv_tokens = 0; //!< rows of the blocks in those slots
  std::size_t send_bytes = 0, recv_bytes = 0;
  int to = 0, from = 0;
  std::int64_t tag = 0;
  friend bool operator==(const message&, const message&) = default;
};

//! The element ranges that add a block's travelled fp32 dK/dV (dk then dv of its `t.tokens`
//! rows) into the whole shard's (dk then dv of `n` rows): `f(shard_offset, travelled_offset,
//! count)`, a run's dk, then its dv.
template <class F>
void for_each_travelled_range(const kv_travel& t, const ring_workspace& ws, std::int64_t n, F&& f) {
  if (t.whole) { // the same layout: one range
    if (n > 0) f(std::size_t{0}, std::size_t{0}, ws.kv_elements(n));
    return;
  }
  const std::size_t kr = ws.k_elements(1), vr = ws.v_elements(1);
  const std::size_t kn = ws.k_elements(n), km = ws.k_elements(t.tokens);
  t.for_each_run(n, [&](std::int64_t local, std::int64_t count, std::int64_t at) {
    const auto l = static_cast<std::size_t>(local), c = static_cast<std::size_t>(count),
               a = static_cast<std::size_t>(at);
    f(l * kr, a * kr, c * kr);
    f(kn + l * vr, km + a * vr, c * vr);
  });
}

//! The ring's programs (`ring_pass`): two block slots per rank, whatever P.
struct ring_program {
  static ring_workspace workspace(const ring_schedule& s, const attention_arguments& args,
                                  element_format format) {
    return {s.q_tokens(), s.max_kv_tokens(), args, format, 2, 1, !s.own_travel().whole};
  }

  //! The ring forward: step t computes the block in slot t % 2, then passes it on to rank + 1 while
  //! the next one arrives from rank - 1 into the other slot. A block no later rank sees goes no
  //! further, and its receiver expects nothing (`ring_step::forwarded`, `ring_step::arrives`).
  //! Slot 0 holds the own block's travelling rows.
  template <class Engine>
  static void forward(Engine& e, const ring_schedule& s, const ring_workspace& ws) {
    if (e.forward_direct()) return;
    e.start_forward();
    for (const ring_step& step : s.steps()) {
      const int t = step.index;
      e.forward(step, t % 2);
      if (const ring_step* next = s.next(t)) {
        const std::int64_t held = s.held_tokens(step), coming = next->kv_tokens;
        e.exchange(message{payload::kv, t % 2, (t + 1) % 2, held, coming,
                           step.forwarded ? ws.block_bytes(held) : 0,
                           next->arrives ? ws.block_bytes(coming) : 0, s.send_to(),
                           s.receive_from(), t});
      }
    }
    e.finish_forward();
  }

  //! The ring backward: step t's K/V go on before its compute (they arrive for step t + 1 while
  //! step t computes); its share of dK/dV is added to the block's sum, which came from rank - 1
  //! in step t - 1's second message, and the sum goes on to rank + 1. After the last step the
  //! complete dK/dV of the block held (rank + 1's after P steps) go home while this rank's own come
  //! back ("step P"). Every block travels the whole ring, its travelling rows only (a block of
  //! none sends nothing).
  template <class Engine>
  static void backward(Engine& e, const ring_schedule& s, const ring_workspace& ws) {
    if (e.backward_direct()) return;
    e.start_backward();
    for (const ring_step& step : s.steps()) {
      const int t = step.index;
      const ring_step* next = s.next(t);
      const std::int64_t held = s.held_tokens(step);
      if (next)
        e.exchange(message{payload::kv, t % 2, (t + 1) % 2, held, next->kv_tokens,
                           ws.block_bytes(held), ws.block_bytes(next->kv_tokens), s.send_to(),
                           s.receive_from(), t});
      e.backward(step, t % 2);
      if (next)
        e.exchange(message{payload::grad, t % 2, (t + 1) % 2, held, next->kv_tokens,
                           ws.grad_bytes(held), ws.grad_bytes(next->kv_tokens), s.send_to(),
                           s.receive_from(), t});
    }
    int home = -1;
    if (const int last = s.step_count() - 1; last > 0) {
      const ring_step& held = s.step(last);
      const std::int64_t own = s.own_travel().tokens;
      home = (last + 1) % 2;
      e.exchange(message{payload::home, last % 2, home, held.kv_tokens, own,
                         ws.grad_bytes(held.kv_tokens), ws.grad_bytes(own), held.source,
                         s.holder_of_own(), last + 1});
    }
    e.finish_backward(home);
  }
};

//! The all-gather's programs (`all_gather_kv`): every rank's K/V block is gathered once, then
//! this rank's queries attend to each block in place, with the ring's groups (the block of rank
//! (rank - t) mod P in slot t, the groups of step t). No block travels twice and none is merged
//! on arrival: the fp32 state is merged block after block as on the ring, so the two forwards
//! agree bit for bit.
//!
//! The gather is P - 1 pairwise exchanges: in exchange k rank r sends its own block to r + k and
//! receives the block of r - k, so a rank sends (P - 1) x its own K/V; a block no query of the
//! receiver sees is neither sent nor received (`ring_step::own_wanted`, the step's groups). The
//! backward gathers K/V again, computes every block's fp32 dK/dV share and returns each share to
//! its owner in the same pairwise pattern (a reduce-scatter; no share where nothing was
//! computed): the owner adds what it receives in the order k = 1 .. P - 1, so the result is the
//! same bit for bit from call to call.
struct all_gather_program {
  //! A slot for the block of every step (every rank's, or those a window needs); in the backward
  //! a share buffer for every block whose dK/dV come back (at least one).
  static ring_workspace workspace(const ring_schedule& s, const attention_arguments& args,
                                  element_format format) {
    return {s.q_tokens(),
            s.max_kv_tokens(),
            args,
            format,
            std::max(2, s.step_count()),
            std::max(1, s.step_count() - 1),
            !s.own_travel().whole};
  }

  //! Exchange k of the all-gather: this rank's block goes to rank + k (whose step k it is), while
  //! the block of rank - k (this rank's step k) arrives.
  static int gather_to(const ring_schedule& s, int k) { return (s.rank() + k) % s.ranks(); }

  //! The all-gather's K/V messages: exchange t sends the own block's travelling rows (slot 0) to
  //! rank + t where that rank sees some of it, and receives the block of step t into slot t where
  //! this rank sees some.
  template <class Engine>
  static void gather_blocks(Engine& e, const ring_schedule& s, const ring_workspace& ws) {
    const std::int64_t n = s.own_travel().tokens;
    for (int t = 1; t < s.step_count(); ++t) {
      const ring_step& step = s.step(t);
      e.exchange(message{payload::kv, 0, t, n, step.kv_tokens,
                         step.own_wanted ? ws.block_bytes(n) : 0,
                         step.groups.empty() ? 0 : ws.block_bytes(step.kv_tokens), gather_to(s, t),
                         step.source, t});
    }
  }

  //! The all-gather forward: the own block's compute first (while the ranks meet for the gather),
  //! then every block gathered, then the blocks in step order, each merged as on the ring.
  template <class Engine>
  static void forward(Engine& e, const ring_schedule& s, const ring_workspace& ws) {
    if (e.forward_direct()) return;
    e.start_forward();
    e.forward(s.step(0), 0);
    gather_blocks(e, s, ws);
    for (int t = 1; t < s.step_count(); ++t)
      e.forward(s.step(t), t);
    e.finish_forward();
  }

  //! The all-gather backward: the gather again, then each block's dK/dV share computed into its
  //! slot's sums and sent back to its owner while this rank's share from rank + t arrives (share
  //! buffer t - 1; tags P + t). The owner adds the shares it received in the order t = 1, 2, ...
  //! Every gather is queued before any share leaves: on the device a share waits for its block's
  //! compute, and a gather queued behind it on the communication stream would wait as well.
  template <class Engine>
  static void backward(Engine& e, const ring_schedule& s, const ring_workspace& ws) {
    if (e.backward_direct()) return;
    e.start_backward();
    e.backward_share(s.step(0), 0);
    gather_blocks(e, s, ws);
    const std::int64_t n = s.own_travel().tokens;
    for (int t = 1; t < s.step_count(); ++t) {
      const ring_step& step = s.step(t);
      e.backward_share(step, t);
      e.exchange(message{payload::share, t, t - 1, step.kv_tokens, n,
                         step.groups.empty() ? 0 : ws.grad_bytes(step.kv_tokens),
                         step.own_wanted ? ws.grad_bytes(n) : 0, step.source, gather_to(s, t),
                         s.ranks() + t});
    }
    e.finish_shares();
  }
};

//! The sharded decode's step (sharded_attention.cuh): this rank's finished partial of the `rows`
//! new rows into its slot (`partial(rank)`: slot r holds rank r's), P - 1 pairwise exchanges of
//! `slot_bytes` (in exchange k to rank + k, from rank - k into that rank's slot; tag k), then the
//! merge of the P partials in rank order (`merge()`), the same on every rank.
struct decode_program {
  template <class Engine>
  static void step(Engine& e, int rank, int ranks, std::int64_t rows, std::size_t slot_bytes) {
    e.partial(rank);
    for (int k = 1; k < ranks; ++k) {
      const int to = (rank + k) % ranks, from = (rank - k + ranks) % ranks;
      e.exchange(
          message{payload::partial, rank, from, rows, rows, slot_bytes, slot_bytes, to, from, k});
    }
    e.merge();
  }
};

//! An engine of three callables, `partial(rank)`, `exchange(message)` and `merge()`: the sharded
//! decode's host and device steps.
template <class Partial, class Exchange, class Merge>
struct decode_engine {
  Partial partial;
  Exchange exchange;
  Merge merge;
};
template <class Partial, class Exchange, class Merge>
decode_engine(Partial, Exchange, Merge) -> decode_engine<Partial, Exchange, Merge>;

//! An engine that only records the messages of a program.
class trace_engine {
public:
  bool forward_direct() const noexcept { return false; }
  bool backward_direct() const noexcept { return false; }
  void start_forward() noexcept {}
  void start_backward() noexcept {}
  void forward(const ring_step&, int) noexcept {}
  void backward(const ring_step&, int) noexcept {}
  void backward_share(const ring_step&, int) noexcept {}
  void finish_forward() noexcept {}
  void finish_backward(int) noexcept {}
  void finish_shares() noexcept {}
  void partial(int) noexcept {}
  void merge() noexcept {}
  void exchange(const message& m) { messages_.push_back(m); }
  const std::vector<message>& messages() const noexcept { return messages_; }

private:
  std::vector<message> messages_;
};

} // namespace ringattn::detail
