#pragma once
//! \file
//! The ring's steps on device memory: the BlockKernel's device forward or backward on the
//! caller's stream, every exchange on a communication stream of the device's highest priority,
//! ordered by events, so that the exchange of step t + 1 overlaps the compute of step t and the
//! host never waits. `ring_device_resources` owns the streams, events and per-step kernel
//! schedules, made at plan time: the forward's by `prepare_device()`, the backward's at the first
//! backward (so a forward-only user never builds them).

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/backward_args.cuh>
#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/block/device/state_ops.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/nvtx.cuh>
#include <ringattn/detail/streams.cuh>
#include <ringattn/error.cuh>
#include <ringattn/ring/program.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace ringattn::detail {

//! What a ring whose BlockKernel has no device path holds instead.
struct no_device_resources {};

template <class BlockKernel>
class ring_device_resources {
public:
  //! On the current device: the communication stream, the events and the forward's schedules.
  ring_device_resources(const ring_schedule& s, const attention_arguments& args)
      : arrived(static_cast<std::size_t>(s.ranks())), computed(static_cast<std::size_t>(s.ranks())),
        args_(args) {
    for (const ring_step& step : s.steps())
      forward.push_back(
          BlockKernel::make_forward_schedule(step.groups, s.q_tokens(), step.kv_tokens, args));
    if constexpr (requires { BlockKernel::plans_backward_at_prepare; })
      if (BlockKernel::plans_backward_at_prepare) prepare_backward(s);
  }
  //! The backward's schedules, once (on the device the resources live on).
  void prepare_backward(const ring_schedule& s) {
    if (!backward.empty() || s.steps().empty()) return;
    std::vector<typename BlockKernel::backward_schedule> made;
    for (const ring_step& step : s.steps())
      made.push_back(
          BlockKernel::make_backward_schedule(step.groups, s.q_tokens(), step.kv_tokens, args_));
    backward = std::move(made);
  }
  //! Device scratch the BlockKernel's schedules ask for, one step at a time (0 for a model that
  //! asks for none); the backward's once its schedules exist.
  std::size_t scratch_bytes(bool backward_direction) const {
    std::size_t most = 0;
    if constexpr (requires(const typename BlockKernel::forward_schedule& f) {
                    { f.scratch_bytes() } -> std::convertible_to<std::size_t>;
                  }) {
      for (const auto& f : backward_direction ? backward : forward)
        most = std::max<std::size_t>(most, f.scratch_bytes());
    }
    return most;
  }

  comm_stream comm; // comm.device(): the device the resources live on
  ordering_event own_ready, comm_end;
  ordering_event grads_recv[2], grads_ready[2]; // the ring backward: sums arrived, complete
  // Per slot (the ring's two, the all-gather's one per block): its K/V arrived, and the last
  // compute that read it (in the all-gather's backward: its share) done.
  std::vector<ordering_event> arrived, computed;
  std::vector<typename BlockKernel::forward_schedule> forward;
  std::vector<typename BlockKernel::backward_schedule> backward;

private:
  attention_arguments args_;
};

//! `ring_bytes` and, after them (256-byte aligned), the scratch of the BlockKernel's device
//! schedules. A model that plans its scratch at `prepare_device` needs the resources first.
template <class BlockKernel, class Resources>
std::size_t with_scratch(const Resources* d, std::size_t ring_bytes, bool backward) {
  if constexpr (requires { BlockKernel::plans_backward_at_prepare; }) {
    if (d == nullptr)
      throw invalid_argument("ringattn: " + std::string(BlockKernel::name) +
                             ": call prepare_device() before asking for the device workspace "
                             "(it includes what the block kernel plans there)");
  }
  std::size_t scratch = 0;
  if constexpr (requires { d->scratch_bytes(backward); })
    scratch = d ? d->scratch_bytes(backward) : 0;
  return scratch ? ring_workspace::align(ring_bytes) + scratch : ring_bytes;
}

#if defined(__CUDACC__)
//! The travelling rows of a shard's k and v into a dense block (the layout that travels): per
//! stretch one copy each when the input is dense too, else one 2D copy per head.
template <class T, class Block>
void copy_own_block_device(thd_view<const T> k, thd_view<const T> v, const kv_travel& travel,
                           const Block& own, cudaStream_t stream) {
  travel.for_each_run(k.tokens, [&](std::int64_t local, std::int64_t n, std::int64_t at) {
    for (int which = 0; which < 2; ++which) {
      const thd_view<const T>& x = which == 0 ? k : v;
      const thd_view<T>& to = which == 0 ? own.k : own.v;
      T* dst = to.row(at, 0);
      if (x.dense())
        RINGATTN_CUDA_CHECK(cudaMemcpyAsync(dst, x.row(local, 0),
                                            sizeof(T) * n * x.heads * x.head_dim,
                                            cudaMemcpyDeviceToDevice, stream));
      else
        for (int h = 0; h < x.heads; ++h)
          RINGATTN_CUDA_CHECK(
              cudaMemcpy2DAsync(dst + h * x.head_dim, sizeof(T) * x.heads * x.head_dim,
                                x.row(local, h), sizeof(T) * x.token_stride, sizeof(T) * x.head_dim,
                                static_cast<std::size_t>(n), cudaMemcpyDeviceToDevice, stream));
    }
  });
}

//! The device engine of the ring's programs (ring/program.cuh), forward: the computes on
//! `stream`, the messages on the communication stream, ordered by events per slot:
//!   the compute of a step waits `arrived[slot]`   (its block has arrived);
//!   a message into a slot waits `computed[slot]`  (the step that read it last has run: the
//!   ring's step before last; the all-gather's slots are read once, by a previous call).
//! Each step's epilogue was decided with the schedule (`ring_schedule::forward_epilogue`).
template <class BlockKernel, class Communicator, class T>
class device_forward_engine {
public:
  device_forward_engine(Communicator& comm, const ring_schedule& s,
                        ring_device_resources<BlockKernel>& d, const ring_workspace& ws,
                        std::byte* workspace, const attention_arguments& args, thd_view<const T> q,
                        thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
                        float* max_logit, cudaStream_t stream)
      : comm_(comm), s_(s), d_(d), ws_(ws), base_(workspace), args_(args), q_(q), k_(k), v_(v),
        out_(out), lse_(lse), state_(ws.state(workspace, lse, max_logit)),
        scratch_(workspace + ring_workspace::align(ws.forward_bytes())), dense_(out.dense()),
        stream_(stream) {}

  //! One step, the own block, covering every row: the kernel writes `out` and `lse` directly (no
  //! state, no copy of K/V).
  bool forward_direct() {
    if (s_.forward_epilogue(0, dense_) != step_epilogue::plain) return false;
    BlockKernel::device_forward(step_epilogue::plain, {q_, k_, v_, args_, state_, scratch_},
                                d_.forward[0], out_, lse_, stream_);
    return true;
  }
  void start_forward() {
    if (s_.needs_reset()) reset(state_, stream_);
    const kv_travel& own = s_.own_travel();
    copy_own_block_device(k_, v_, own, ws_.kv_slot_views<T>(base_, 0, own.tokens), stream_);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.own_ready, stream_));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d_.comm, d_.own_ready, 0));
  }
  void forward(const ring_step& step, int slot) {
    const int t = step.index;
    nvtx_range range("step", t, s_.rank());
    const auto b = ws_.kv_slot_views<T>(base_, slot, s_.held_tokens(step));
    // Step 0 of a shard that does not travel whole reads the caller's k and v.
    const bool caller = t == 0 && !s_.own_travel().whole;
    if (t > 0) RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, d_.arrived[slot], 0));
    const step_epilogue e = s_.forward_epilogue(t, dense_);
    if (e != step_epilogue::none)
      BlockKernel::device_forward(e,
                                  {q_, caller ? k_ : thd_view<const T>(b.k),
                                   caller ? v_ : thd_view<const T>(b.v), args_, state_, scratch_,
                                   b.scales},
                                  d_.forward[static_cast<std::size_t>(t)], out_, lse_, stream_);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.computed[slot], stream_));
  }
  void exchange(const message& m) {
    // Never recorded before the first message of the first call: waiting on it is then a no-op.
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d_.comm, d_.computed[m.recv_slot], 0));
    comm_.exchange_async(ws_.kv_slot_views<T>(base_, m.send_slot, m.send_tokens).k.data,
                         m.send_bytes, m.to,
                         ws_.kv_slot_views<T>(base_, m.recv_slot, m.recv_tokens).k.data,
                         m.recv_bytes, m.from, m.tag, d_.comm);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.arrived[m.recv_slot], d_.comm));
  }
  void finish_forward() {
    if (s_.needs_finalize(dense_)) finalize(state_, out_, stream_);
    // Everything on the communication stream is done before later work on `stream` (a next call
    // reuses the slots).
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.comm_end, d_.comm));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, d_.comm_end, 0));
  }

private:
  Communicator& comm_;
  const ring_schedule& s_;
  ring_device_resources<BlockKernel>& d_;
  const ring_workspace& ws_;
  std::byte* base_;
  const attention_arguments& args_;
  thd_view<const T> q_, k_, v_;
  thd_view<T> out_;
  float* lse_;
  attention_state state_;
  std::byte* scratch_;
  bool dense_;
  cudaStream_t stream_;
};

//! The device engine of the ring's programs, backward. Per slot, besides the forward's events:
//!   a step's sum waits `grads_recv[slot]` (the block's sum has arrived) before its share is
//!   added, then records `grads_ready[slot]`;
//!   a sum or a home message waits `grads_ready` of the slot it sends.
template <class BlockKernel, class Communicator, class T>
class device_backward_engine {
public:
  device_backward_engine(Communicator& comm, const ring_schedule& s,
                         ring_device_resources<BlockKernel>& d, const ring_workspace& ws,
                         std::byte* workspace, const attention_arguments& args, thd_view<const T> q,
                         thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                         const float* lse, thd_view<const T> dout, thd_view<T> dq, thd_view<T> dk,
                         thd_view<T> dv, cudaStream_t stream)
      : comm_(comm), s_(s), d_(d), ws_(ws), base_(workspace), args_(args), q_(q), k_(k), v_(v),
        out_(out), dout_(dout), lse_(lse), dq_(dq), dk_(dk), dv_(dv),
        scratch_(workspace + ring_workspace::align(ws.device_backward_bytes())),
        dq_acc_(ws.dq(workspace)), delta_(ws.delta(workspace)), local_(ws.share(workspace)),
        own_sums_(ws.own_sums(workspace)), stream_(stream) {}

  //! One block: a model that can write dq, dk and dv directly does (no D, no fp32 sums).
  bool backward_direct() {
    if constexpr (whole_block_backward_for<BlockKernel, cudaStream_t>) {
      return s_.ranks() == 1 && !d_.backward.empty() &&
             BlockKernel::device_backward_whole(
                 block_backward_args<T>{
                     q_, k_, v_, dout_, lse_, nullptr, args_, {}, out_, scratch_},
                 d_.backward[0], dq_, dk_, dv_, stream_);
    } else {
      return false;
    }
  }
  void start_backward() {
    const std::int64_t n = s_.q_tokens();
    const kv_travel& travel = s_.own_travel();
    compute_delta<T>(out_, dout_, delta_, stream_);
    if (n > 0) {
      RINGATTN_CUDA_CHECK(cudaMemsetAsync(
          dq_acc_, 0, sizeof(float) * static_cast<std::size_t>(n) * args_.q_heads * args_.qk_dim(),
          stream_));
      const auto own = ws_.grad_slot_views<T>(base_, 0, travel.tokens);
      copy_own_block_device(k_, v_, travel, own, stream_);
      if (travel.tokens > 0)
        RINGATTN_CUDA_CHECK(cudaMemsetAsync(own.dk, 0, ws_.grad_bytes(travel.tokens), stream_));
      if (!travel.whole)
        RINGATTN_CUDA_CHECK(cudaMemsetAsync(own_sums_, 0, ws_.grad_bytes(n), stream_));
    }
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.own_ready, stream_));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d_.comm, d_.own_ready, 0));
  }
  void backward(const ring_step& step, int slot) {
    const int t = step.index;
    nvtx_range range("backward step", t, s_.rank());
    const std::int64_t nk = step.kv_tokens;
    if (t == 0 && !s_.own_travel().whole) {
      // The travelling rows' sums start at zero and may leave at once; the whole shard's share
      // is kept apart.
      RINGATTN_CUDA_CHECK(cudaEventRecord(d_.grads_ready[slot], stream_));
      own_share(step);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d_.computed[slot], stream_));
      return;
    }
    const auto b = ws_.grad_slot_views<T>(base_, slot, nk);
    if (t > 0) RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, d_.arrived[slot], 0));
    float* share = t == 0 ? b.dk : local_;
    if (t > 0 && nk > 0)
      RINGATTN_CUDA_CHECK(cudaMemsetAsync(local_, 0, ws_.grad_bytes(nk), stream_));
    if (!step.groups.empty())
      BlockKernel::device_backward(block_args(b, share, share + ws_.k_elements(nk)),
                                   d_.backward[static_cast<std::size_t>(t)], stream_);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.computed[slot], stream_));
    if (t > 0) {
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, d_.grads_recv[slot], 0));
      accumulate(b.dk, local_, static_cast<std::int64_t>(ws_.kv_elements(nk)), stream_);
    }
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.grads_ready[slot], stream_));
  }
  //! The all-gather's: the block's share of dK/dV into its slot's sums.
  void backward_share(const ring_step& step, int slot) {
    const int t = step.index;
    nvtx_range range("backward block", t, s_.rank());
    const std::int64_t nk = step.kv_tokens;
    if (t == 0 && !s_.own_travel().whole) {
      own_share(step);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d_.computed[slot], stream_));
      return;
    }
    const auto b = ws_.grad_slot_views<T>(base_, slot, nk);
    if (t > 0) RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, d_.arrived[slot], 0));
    if (nk > 0) RINGATTN_CUDA_CHECK(cudaMemsetAsync(b.dk, 0, ws_.grad_bytes(nk), stream_));
    if (!step.groups.empty())
      BlockKernel::device_backward(block_args(b, b.dk, b.dv),
                                   d_.backward[static_cast<std::size_t>(t)], stream_);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.computed[slot], stream_));
  }
  void exchange(const message& m) {
    const auto from = ws_.grad_slot_views<T>(base_, m.send_slot, m.send_tokens);
    if (m.what == payload::share) { // once the block's share is computed
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d_.comm, d_.computed[m.send_slot], 0));
      comm_.exchange_async(from.dk, m.send_bytes, m.to, ws_.share(base_, m.recv_slot), m.recv_bytes,
                           m.from, m.tag, d_.comm);
      return;
    }
    if (m.what == payload::kv) {
      // The receiving slot's K/V were last read by the compute of the step before last.
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d_.comm, d_.computed[m.recv_slot], 0));
      comm_.exchange_async(from.k.data, m.send_bytes, m.to,
                           ws_.grad_slot_views<T>(base_, m.recv_slot, m.recv_tokens).k.data,
                           m.recv_bytes, m.from, m.tag, d_.comm);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d_.arrived[m.recv_slot], d_.comm));
      return;
    }
    float* into = m.what == payload::home
                      ? home_sums(m.recv_slot)
                      : ws_.grad_slot_views<T>(base_, m.recv_slot, m.recv_tokens).dk;
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d_.comm, d_.grads_ready[m.send_slot], 0));
    comm_.exchange_async(from.dk, m.send_bytes, m.to, into, m.recv_bytes, m.from, m.tag, d_.comm);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.grads_recv[m.recv_slot], d_.comm));
    if (m.what == payload::home)
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, d_.grads_recv[m.recv_slot], 0));
  }
  //! The all-gather's: once every message is done, the shares received added to the own
  //! block's, in step order.
  void finish_shares() {
    const std::int64_t n = s_.q_tokens();
    const bool whole = s_.own_travel().whole;
    float* own = whole ? ws_.grad_slot_views<T>(base_, 0, n).dk : own_sums_;
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.comm_end, d_.comm));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, d_.comm_end, 0));
    for (int t = 1; t < s_.step_count(); ++t)
      if (s_.step(t).own_wanted) add_travelled(own, ws_.share(base_, t - 1));
    write_gradient<T>(dq_acc_, dq_, stream_);
    write_gradient<T>(own, dk_, stream_);
    write_gradient<T>(own + ws_.k_elements(n), dv_, stream_);
  }
  void finish_backward(int home) {
    const std::int64_t n = s_.q_tokens();
    const kv_travel& travel = s_.own_travel();
    float* own = home < 0 ? ws_.grad_slot_views<T>(base_, 0, travel.tokens).dk : home_sums(home);
    if (!travel.whole) {
      if (home >= 0) add_travelled(own_sums_, own);
      own = own_sums_;
    }
    write_gradient<T>(dq_acc_, dq_, stream_);
    write_gradient<T>(own, dk_, stream_);
    write_gradient<T>(own + ws_.k_elements(n), dv_, stream_);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d_.comm_end, d_.comm));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream_, d_.comm_end, 0));
  }

private:
  //! The block call over a slot's K/V (and their scales), its dK/dV share into `dk` and `dv`.
  block_backward_args<T> block_args(const grad_block_views<T>& b, float* dk, float* dv) const {
    return over_slot<T>({q_, {}, {}, dout_, lse_, delta_, args_, {dq_acc_}, out_, scratch_}, b, dk,
                        dv);
  }
  //! Step 0 where the shard does not travel whole: the share over the caller's k and v into the
  //! whole shard's sums.
  void own_share(const ring_step& step) {
    if (step.groups.empty()) return;
    block_backward_args<T> call = block_args(ws_.grad_slot_views<T>(base_, 0, 0), own_sums_,
                                             own_sums_ + ws_.k_elements(s_.q_tokens()));
    call.k = k_;
    call.v = v_;
    BlockKernel::device_backward(call, d_.backward[0], stream_);
  }
  //! The travelled rows' sums (`from`, the own block's layout as it travels) added to the whole
  //! shard's: an addition per stretch, dk and dv.
  void add_travelled(float* own, const float* from) const {
    for_each_travelled_range(s_.own_travel(), ws_, s_.q_tokens(),
                             [&](std::size_t at, std::size_t src, std::size_t count) {
                               accumulate(own + at, from + src, static_cast<std::int64_t>(count),
                                          stream_);
                             });
  }
  // This rank's own sums come home into the K/V area of the other slot.
  float* home_sums(int slot) const {
    return reinterpret_cast<float*>(ws_.grad_slot_views<T>(base_, slot, 0).k.data);
  }

  Communicator& comm_;
  const ring_schedule& s_;
  ring_device_resources<BlockKernel>& d_;
  const ring_workspace& ws_;
  std::byte* base_;
  const attention_arguments& args_;
  thd_view<const T> q_, k_, v_, out_, dout_;
  const float* lse_;
  thd_view<T> dq_, dk_, dv_;
  std::byte* scratch_;
  float *dq_acc_, *delta_, *local_, *own_sums_;
  cudaStream_t stream_;
};

//! The device engine of the all-to-all's programs (ring/all_to_all_program.cuh): every copy,
//! exchange and kernel enqueued on the caller's stream in order
//! (the attention needs every shard before it starts, so nothing runs beside it).
template <class BlockKernel, class Communicator>
struct device_all_to_all_engine {
  Communicator& comm;
  ring_device_resources<BlockKernel>& d;
  std::byte* scratch;
  cudaStream_t stream;

  void copy(void* dst, std::size_t dpitch, const void* src, std::size_t spitch, std::size_t width,
            std::size_t rows) const {
    if (rows == 0 || width == 0) return;
    RINGATTN_CUDA_CHECK(
        cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, rows, cudaMemcpyDeviceToDevice, stream));
  }
  void exchange(const void* s, std::size_t sn, int to, void* dst, std::size_t dn, int from,
                std::int64_t tag) {
    comm.exchange_async(s, sn, to, dst, dn, from, tag, stream);
  }
  void add(float* a, const float* b, std::int64_t count) const { accumulate(a, b, count, stream); }
  template <class T>
  void write(const float* x, thd_view<T> out) const {
    write_gradient<T>(x, out, stream);
  }
  template <class T>
  void forward(const ring_schedule& s, const attention_arguments& a, thd_view<T> q, thd_view<T> k,
               thd_view<T> v, const attention_state& state, thd_view<T> out) const {
    if (s.needs_reset()) reset(state, stream);
    for (const ring_step& step : s.steps()) {
      nvtx_range range("step", step.index, s.rank());
      const step_epilogue e = s.forward_epilogue(step.index, true);
      if (e != step_epilogue::none)
        BlockKernel::device_forward(
            e,
            {thd_view<const T>(q), thd_view<const T>(k), thd_view<const T>(v), a, state, scratch},
            d.forward[static_cast<std::size_t>(step.index)], out, state.lse, stream);
    }
    if (s.needs_finalize(true)) finalize(state, out, stream);
  }
  template <class T>
  void backward(const ring_schedule& s, const attention_arguments& a, thd_view<T> q, thd_view<T> k,
                thd_view<T> v, thd_view<T> out, thd_view<T> dout, const float* lse, float* delta,
                const gradient_state& g) const {
    compute_delta<T>(out, dout, delta, stream);
    auto zero = [&](float* x, const thd_view<T>& like) {
      const std::size_t count = static_cast<std::size_t>(like.tokens) * like.heads * like.head_dim;
      if (count) RINGATTN_CUDA_CHECK(cudaMemsetAsync(x, 0, count * sizeof(float), stream));
    };
    zero(g.dq, q);
    zero(g.dk, k);
    zero(g.dv, v);
    for (const ring_step& step : s.steps()) {
      nvtx_range range("backward step", step.index, s.rank());
      if (!step.groups.empty())
        BlockKernel::device_backward(
            block_backward_args<T>{q, k, v, dout, lse, delta, a, g, out, scratch},
            d.backward[static_cast<std::size_t>(step.index)], stream);
    }
  }
};

//! Runs `Program`'s forward (ring/program.cuh) on the device engine.
template <class Program, class BlockKernel, class Communicator, class T>
void device_forward(Communicator& comm, const ring_schedule& s,
                    ring_device_resources<BlockKernel>& d, const attention_arguments& args,
                    thd_view<const T> q, thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                    float* lse, float* max_logit, std::byte* workspace, cudaStream_t stream) {
  const ring_workspace ws = Program::workspace(s, args, element_format::of<T>());
  device_forward_engine<BlockKernel, Communicator, T> e(comm, s, d, ws, workspace, args, q, k, v,
                                                        out, lse, max_logit, stream);
  Program::forward(e, s, ws);
}

//! Runs `Program`'s backward on the device engine.
template <class Program, class BlockKernel, class Communicator, class T>
void device_backward(Communicator& comm, const ring_schedule& s,
                     ring_device_resources<BlockKernel>& d, const attention_arguments& args,
                     thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                     thd_view<const T> out, const float* lse, thd_view<const T> dout,
                     thd_view<T> dq, thd_view<T> dk, thd_view<T> dv, std::byte* workspace,
                     cudaStream_t stream) {
  const ring_workspace ws = Program::workspace(s, args, element_format::of<T>());
  device_backward_engine<BlockKernel, Communicator, T> e(comm, s, d, ws, workspace, args, q, k, v,
                                                         out, lse, dout, dq, dk, dv, stream);
  Program::backward(e, s, ws);
}
#endif // __CUDACC__

} // namespace ringattn::detail
