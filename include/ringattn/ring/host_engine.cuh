#pragma once
//! \file
//! The ring's steps on host memory: the BlockKernel's host block forward or backward, each
//! exchange blocking (in-process threads, MPI processes). Runs everywhere, CI included. The
//! caller validated the arguments; the schedule's groups were validated at plan time.

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/host_backward.cuh>
#include <ringattn/block/device/host_forward.cuh>
#include <ringattn/detail/nvtx.cuh>
#include <ringattn/ring/program.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>

namespace ringattn::detail {

//! Copies the travelling rows of a shard's k and v into a dense block (the layout that travels).
template <class T, class Block>
void copy_own_block_host(thd_view<const T> k, thd_view<const T> v, const kv_travel& travel,
                         const Block& own) {
  travel.for_each_run(k.tokens, [&](std::int64_t local, std::int64_t count, std::int64_t at) {
    for (std::int64_t t = 0; t < count; ++t)
      for (int h = 0; h < k.heads; ++h) {
        std::memcpy(own.k.row(at + t, h), k.row(local + t, h), sizeof(T) * k.head_dim);
        std::memcpy(own.v.row(at + t, h), v.row(local + t, h), sizeof(T) * v.head_dim);
      }
  });
}

//! A rank's fp32 gradient sums (dense `[tokens, heads, width]`) into its dq, dk and dv.
template <element T>
void write_host_gradients(const float* dq_acc, const float* dk_acc, const float* dv_acc,
                          thd_view<T> dq, thd_view<T> dk, thd_view<T> dv) {
  const int qh = dq.heads, kvh = dk.heads, d = dq.head_dim, dvw = dv.head_dim;
  for (std::int64_t t = 0; t < dq.tokens; ++t) {
    for (int h = 0; h < qh; ++h)
      for (int e = 0; e < d; ++e)
        dq(t, h, e) = from_float<T>(dq_acc[(t * qh + h) * d + e]);
    for (int h = 0; h < kvh; ++h) {
      for (int e = 0; e < d; ++e)
        dk(t, h, e) = from_float<T>(dk_acc[(t * kvh + h) * d + e]);
      for (int e = 0; e < dvw; ++e)
        dv(t, h, e) = from_float<T>(dv_acc[(t * kvh + h) * dvw + e]);
    }
  }
}

//! The host engine of the ring's programs (ring/program.cuh), forward: host memory, blocking
//! exchanges, the BlockKernel's host block merged into the fp32 state.
template <class BlockKernel, class Communicator, element T>
class host_forward_engine {
public:
  host_forward_engine(Communicator& comm, const ring_schedule& s, const ring_workspace& ws,
                      std::byte* base, const attention_arguments& args, thd_view<const T> q,
                      thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
                      float* max_logit)
      : comm_(comm), s_(s), ws_(ws), base_(base), args_(args), q_(q), k_(k), v_(v), out_(out),
        state_(ws.state(base, lse, max_logit)) {}

  bool forward_direct() const noexcept { return false; }
  void start_forward() {
    reset(state_);
    const kv_travel& own = s_.own_travel();
    copy_own_block_host(k_, v_, own, ws_.kv_slot_views<T>(base_, 0, own.tokens));
  }
  void forward(const ring_step& step, int slot) {
    nvtx_range range("step", step.index, s_.rank());
    const auto b = ws_.kv_slot_views<T>(base_, slot, s_.held_tokens(step));
    // Step 0 of a shard that does not travel whole reads the caller's k and v.
    const bool caller = step.index == 0 && !s_.own_travel().whole;
    if (!step.groups.empty())
      BlockKernel::host_forward(block_forward_args<T>{q_, caller ? k_ : thd_view<const T>(b.k),
                                                      caller ? v_ : thd_view<const T>(b.v), args_,
                                                      state_, nullptr, b.scales},
                                step.groups);
  }
  void exchange(const message& m) {
    comm_.exchange(ws_.kv_slot_views<T>(base_, m.send_slot, m.send_tokens).k.data, m.send_bytes,
                   m.to, ws_.kv_slot_views<T>(base_, m.recv_slot, m.recv_tokens).k.data,
                   m.recv_bytes, m.from, m.tag);
  }
  void finish_forward() { finalize(state_, out_); }

private:
  Communicator& comm_;
  const ring_schedule& s_;
  const ring_workspace& ws_;
  std::byte* base_;
  const attention_arguments& args_;
  thd_view<const T> q_, k_, v_;
  thd_view<T> out_;
  attention_state state_;
};

//! The host engine of the ring's programs, backward: a step's dK/dV share computed apart (step
//! 0: straight into the own block's sums) and added to the block's sum, as on the device.
template <class BlockKernel, class Communicator, element T>
class host_backward_engine {
public:
  host_backward_engine(Communicator& comm, const ring_schedule& s, const ring_workspace& ws,
                       std::byte* base, const attention_arguments& args, thd_view<const T> q,
                       thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                       const float* lse, thd_view<const T> dout, thd_view<T> dq, thd_view<T> dk,
                       thd_view<T> dv)
      : comm_(comm), s_(s), ws_(ws), base_(base), rank_(s.rank()), args_(args), q_(q), k_(k), v_(v),
        out_(out), dout_(dout), lse_(lse), dq_(dq), dk_(dk), dv_(dv), dq_acc_(ws.dq(base)),
        delta_(ws.delta(base)), local_(ws.share(base)), own_sums_(ws.own_sums(base)) {}

  bool backward_direct() const noexcept { return false; }
  void start_backward() {
    const std::int64_t n = q_.tokens;
    const kv_travel& travel = s_.own_travel();
    compute_delta(out_, dout_, delta_);
    std::fill(dq_acc_, dq_acc_ + n * args_.q_heads * args_.qk_dim(), 0.0f);
    const auto own = ws_.grad_slot_views<T>(base_, 0, travel.tokens);
    copy_own_block_host(k_, v_, travel, own);
    std::fill(own.dk, own.dk + ws_.kv_elements(travel.tokens), 0.0f); // dk, then dv
    if (!travel.whole) std::fill(own_sums_, own_sums_ + ws_.kv_elements(n), 0.0f);
  }
  void backward(const ring_step& step, int slot) {
    const int t = step.index;
    nvtx_range range("backward step", t, rank_);
    const std::int64_t nk = step.kv_tokens;
    if (t == 0 && !s_.own_travel().whole) { // the whole shard's share, apart
      own_share(step);
      return;
    }
    const auto b = ws_.grad_slot_views<T>(base_, slot, nk);
    float* share = t == 0 ? b.dk : local_;
    const std::size_t elements = ws_.kv_elements(nk);
    if (t > 0) std::fill(local_, local_ + elements, 0.0f);
    if (!step.groups.empty())
      BlockKernel::host_backward(block_args(b, share, share + ws_.k_elements(nk)), step.groups);
    if (t > 0)
      for (std::size_t i = 0; i < elements; ++i)
        b.dk[i] += local_[i];
  }
  //! The all-gather's: the block's share of dK/dV into its slot's sums.
  void backward_share(const ring_step& step, int slot) {
    nvtx_range range("backward block", step.index, rank_);
    if (step.index == 0 && !s_.own_travel().whole) {
      own_share(step);
      return;
    }
    const auto b = ws_.grad_slot_views<T>(base_, slot, step.kv_tokens);
    std::fill(b.dk, b.dk + ws_.kv_elements(step.kv_tokens), 0.0f); // dk, then dv
    if (!step.groups.empty()) BlockKernel::host_backward(block_args(b, b.dk, b.dv), step.groups);
  }
  void exchange(const message& m) {
    comm_.exchange(source(m), m.send_bytes, m.to, target(m), m.recv_bytes, m.from, m.tag);
  }
  //! The all-gather's: the shares received added to the own block's, in step order.
  void finish_shares() {
    const std::int64_t n = q_.tokens;
    const kv_travel& travel = s_.own_travel();
    float* own = travel.whole ? ws_.grad_slot_views<T>(base_, 0, n).dk : own_sums_;
    for (int t = 1; t < s_.step_count(); ++t)
      if (s_.step(t).own_wanted) add_travelled(own, ws_.share(base_, t - 1));
    write_host_gradients(dq_acc_, own, own + ws_.k_elements(n), dq_, dk_, dv_);
  }
  void finish_backward(int home) {
    const std::int64_t n = q_.tokens;
    const kv_travel& travel = s_.own_travel();
    float* travelled =
        home < 0 ? ws_.grad_slot_views<T>(base_, 0, travel.tokens).dk : home_sums(home);
    float* own = travelled;
    if (!travel.whole) {
      own = own_sums_;
      if (home >= 0) add_travelled(own, travelled);
    }
    write_host_gradients(dq_acc_, own, own + ws_.k_elements(n), dq_, dk_, dv_);
  }

private:
  //! The block call over a slot's K/V (and their scales), its dK/dV share into `dk` and `dv`.
  block_backward_args<T> block_args(const grad_block_views<T>& b, float* dk, float* dv) const {
    return over_slot<T>({q_, {}, {}, dout_, lse_, delta_, args_, {dq_acc_}}, b, dk, dv);
  }
  //! Step 0 where the shard does not travel whole: the share over the caller's k and v into the
  //! whole shard's sums.
  void own_share(const ring_step& step) {
    if (step.groups.empty()) return;
    block_backward_args<T> call = block_args(ws_.grad_slot_views<T>(base_, 0, 0), own_sums_,
                                             own_sums_ + ws_.k_elements(q_.tokens));
    call.k = k_;
    call.v = v_;
    BlockKernel::host_backward(call, step.groups);
  }
  //! The travelled rows' sums (`from`, the own block's layout as it travels) added to the whole
  //! shard's.
  void add_travelled(float* own, const float* from) const {
    for_each_travelled_range(s_.own_travel(), ws_, q_.tokens,
                             [&](std::size_t at, std::size_t src, std::size_t count) {
                               for (std::size_t i = 0; i < count; ++i)
                                 own[at + i] += from[src + i];
                             });
  }
  // A message's buffers: a slot's K/V, or its fp32 dK/dV; this rank's own sums come home into
  // the K/V area of the other slot.
  const void* source(const message& m) const {
    const auto b = ws_.grad_slot_views<T>(base_, m.send_slot, m.send_tokens);
    return m.what == payload::kv ? static_cast<const void*>(b.k.data) : b.dk;
  }
  void* target(const message& m) const {
    if (m.what == payload::home) return home_sums(m.recv_slot);
    if (m.what == payload::share) return ws_.share(base_, m.recv_slot);
    const auto b = ws_.grad_slot_views<T>(base_, m.recv_slot, m.recv_tokens);
    return m.what == payload::kv ? static_cast<void*>(b.k.data) : b.dk;
  }
  float* home_sums(int slot) const {
    return reinterpret_cast<float*>(ws_.grad_slot_views<T>(base_, slot, 0).k.data);
  }

  Communicator& comm_;
  const ring_schedule& s_;
  const ring_workspace& ws_;
  std::byte* base_;
  int rank_;
  const attention_arguments& args_;
  thd_view<const T> q_, k_, v_, out_, dout_;
  const float* lse_;
  thd_view<T> dq_, dk_, dv_;
  float *dq_acc_, *delta_, *local_, *own_sums_;
};

//! The host engine of the all-to-all's programs (ring/all_to_all_program.cuh): blocking
//! exchanges, host copies, the BlockKernel's host block over the gathered shards.
template <class BlockKernel, class Communicator>
struct host_all_to_all_engine {
  Communicator& comm;

  void copy(void* dst, std::size_t dpitch, const void* src, std::size_t spitch, std::size_t width,
            std::size_t rows) const {
    for (std::size_t i = 0; i < rows && width > 0; ++i)
      std::memcpy(static_cast<std::byte*>(dst) + i * dpitch,
                  static_cast<const std::byte*>(src) + i * spitch, width);
  }
  void exchange(const void* s, std::size_t sn, int to, void* d, std::size_t dn, int from,
                std::int64_t tag) {
    comm.exchange(s, sn, to, d, dn, from, tag);
  }
  void add(float* a, const float* b, std::int64_t count) const {
    for (std::int64_t i = 0; i < count; ++i)
      a[i] += b[i];
  }
  //! A dense fp32 `[tokens, heads, width]` sum into `out`.
  template <class T>
  void write(const float* x, thd_view<T> out) const {
    for (std::int64_t t = 0; t < out.tokens; ++t)
      for (int hh = 0; hh < out.heads; ++hh)
        for (int i = 0; i < out.head_dim; ++i)
          out(t, hh, i) = from_float<T>(x[(t * out.heads + hh) * out.head_dim + i]);
  }
  template <class T>
  void forward(const ring_schedule& s, const attention_arguments& a, thd_view<T> q, thd_view<T> k,
               thd_view<T> v, const attention_state& state, thd_view<T> out) const {
    reset(state);
    for (const ring_step& step : s.steps()) {
      nvtx_range range("step", step.index, s.rank());
      if (!step.groups.empty())
        BlockKernel::host_forward(block_forward_args<T>{q, k, v, a, state}, step.groups);
    }
    finalize(state, out);
  }
  template <class T>
  void backward(const ring_schedule& s, const attention_arguments& a, thd_view<T> q, thd_view<T> k,
                thd_view<T> v, thd_view<T> out, thd_view<T> dout, const float* lse, float* delta,
                const gradient_state& g) const {
    compute_delta(thd_view<const T>(out), thd_view<const T>(dout), delta);
    std::fill(g.dq, g.dq + q.tokens * q.heads * q.head_dim, 0.0f);
    std::fill(g.dk, g.dk + k.tokens * k.heads * k.head_dim, 0.0f);
    std::fill(g.dv, g.dv + v.tokens * v.heads * v.head_dim, 0.0f);
    for (const ring_step& step : s.steps()) {
      nvtx_range range("backward step", step.index, s.rank());
      if (!step.groups.empty())
        BlockKernel::host_backward(block_backward_args<T>{q, k, v, dout, lse, delta, a, g},
                                   step.groups);
    }
  }
};

//! Runs `Program`'s forward (ring/program.cuh) on the host engine.
template <class Program, class BlockKernel, class Communicator, element T>
void host_forward(Communicator& comm, const ring_schedule& s, const attention_arguments& args,
                  thd_view<const T> q, thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                  float* lse, float* max_logit, std::span<std::byte> workspace) {
  const ring_workspace ws = Program::workspace(s, args, element_format::of<T>());
  host_forward_engine<BlockKernel, Communicator, T> e(comm, s, ws, workspace.data(), args, q, k, v,
                                                      out, lse, max_logit);
  Program::forward(e, s, ws);
}

//! Runs `Program`'s backward on the host engine.
template <class Program, class BlockKernel, class Communicator, element T>
void host_backward(Communicator& comm, const ring_schedule& s, const attention_arguments& args,
                   thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                   thd_view<const T> out, const float* lse, thd_view<const T> dout, thd_view<T> dq,
                   thd_view<T> dk, thd_view<T> dv, std::span<std::byte> workspace) {
  const ring_workspace ws = Program::workspace(s, args, element_format::of<T>());
  host_backward_engine<BlockKernel, Communicator, T> e(comm, s, ws, workspace.data(), args, q, k, v,
                                                       out, lse, dout, dq, dk, dv);
  Program::backward(e, s, ws);
}

} // namespace ringattn::detail
