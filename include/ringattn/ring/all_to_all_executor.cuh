#pragma once
//! \file
//! The all-to-all schedule's executors, written once over an *engine* that moves bytes and runs
//! the block kernel: the host engine (blocking exchanges, the BlockKernel's host block) and the
//! device engine (everything enqueued on the caller's stream: 2D copies, the communicator's
//! device exchanges, the BlockKernel's device block; no host wait).
//!
//! Forward, on rank r of P (n its tokens, N all, `hq`/`hk` the heads a rank computes/holds):
//! 1. the q, k, v heads of every rank are packed from this rank's shard (own heads straight into
//!    the gathered buffers) and P - 1 pairwise exchanges (in exchange k: to r + k, from r - k)
//!    bring every shard of this rank's heads, in rank order;
//! 2. the attention runs over the gathered shards (all_to_all_plan::local: P steps of one
//!    block-kernel call each, the state merged in fp32 as on the ring);
//! 3. each shard's output rows and lse go home the same way, where they land in their heads.
//! Backward: q, k, v, out, dout and the lse travel as in step 1; D, then the block backward's
//! fp32 dq, dk, dv over the gathered shards; dq (and dk, dv) go home. A kv head replicated over
//! several ranks returns fp32 shares that its owner adds in rank order, so every call gives the
//! same bits.
//!
//! Bytes a rank sends: forward `(N - n)`-free: its n tokens of every other rank's heads of q, k,
//! v, then every other shard's rows of its own heads' output and lse; see
//! `all_to_all_heads::forward_bytes` for the formula the tests check.

#include <ringattn/arguments.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/detail/nvtx.cuh>
#include <ringattn/kernel/backward_args.cuh>
#include <ringattn/kernel/forward_args.cuh>
#include <ringattn/kernel/host_backward.cuh>
#include <ringattn/kernel/host_forward.cuh>
#include <ringattn/ring/all_to_all.cuh>
#include <ringattn/ring/device_executor.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/tensor.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ringattn::detail {

//! Heads [first, first + count) of a view.
template <class T>
thd_view<T> heads_of(thd_view<T> x, int first, int count) {
  return {x.data + static_cast<std::int64_t>(first) * x.head_stride,
          x.tokens,
          count,
          x.head_dim,
          x.token_stride,
          x.head_stride};
}
//! Rows [first, first + count) of a view.
template <class T>
thd_view<T> rows_of(thd_view<T> x, std::int64_t first, std::int64_t count) {
  x.data += first * x.token_stride;
  x.tokens = count;
  return x;
}
//! A dense `[tokens, heads, width]` view at `offset` bytes into the workspace.
template <class T>
thd_view<T> dense_at(std::byte* base, std::size_t offset, std::int64_t tokens, int heads,
                     int width) {
  return {reinterpret_cast<T*>(base + offset), tokens, heads, width};
}
template <class T = float>
T* at(std::byte* base, std::size_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

//! Copies view `src` into `dst` (the same shape) with the engine's 2D copies: one when both keep
//! their heads side by side, else one per head.
template <class Engine, class T>
void copy_view(Engine& e, thd_view<T> dst, thd_view<const T> src) {
  const std::size_t es = sizeof(T);
  if (src.tokens == 0) return;
  if (dst.head_stride == dst.head_dim && src.head_stride == src.head_dim) {
    e.copy(dst.data, dst.token_stride * es, src.data, src.token_stride * es,
           static_cast<std::size_t>(src.heads) * src.head_dim * es,
           static_cast<std::size_t>(src.tokens));
    return;
  }
  for (int h = 0; h < src.heads; ++h)
    e.copy(dst.row(0, h), dst.token_stride * es, src.row(0, h), src.token_stride * es,
           static_cast<std::size_t>(src.head_dim) * es, static_cast<std::size_t>(src.tokens));
}

//! The P - 1 pairwise exchanges of one tensor: in exchange k rank r sends `send(to)` (a pointer
//! and a byte count) to r + k and receives `recv(from)` from r - k. `tag` tells the tensors of one
//! call apart.
template <class Engine, class Send, class Recv>
void exchange_all(Engine& e, const all_to_all_plan& p, int tag, Send send, Recv recv) {
  const int ranks = p.ranks(), r = p.rank();
  for (int k = 1; k < ranks; ++k) {
    const int to = (r + k) % ranks, from = (r - k + ranks) % ranks;
    const auto [s, sn] = send(to);
    const auto [d, dn] = recv(from);
    e.exchange(s, sn, to, d, dn, from, static_cast<std::int64_t>(tag) * ranks + k);
  }
}

//! What one exchange sends (`bytes_at`) and where it receives (`landing`).
struct bytes_at {
  const void* data;
  std::size_t bytes;
};
struct landing {
  void* data;
  std::size_t bytes;
};

template <class T, class Engine>
void all_to_all_forward(Engine& e, const all_to_all_plan& p, thd_view<const T> q,
                        thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
                        std::byte* base) {
  const all_to_all_workspace ws(p, sizeof(T));
  const auto& f = ws.forward();
  const head_split& h = p.heads();
  const attention_arguments& la = p.local_arguments();
  const int r = p.rank(), hq = h.q_per_rank, hk = h.kv_per_rank, d = la.qk_dim(), dv = la.v_dim();
  const std::int64_t n = p.q_tokens(), all = p.tokens();
  const auto qa = dense_at<T>(base, f.q, all, hq, d);
  const auto ka = dense_at<T>(base, f.k, all, hk, d);
  const auto va = dense_at<T>(base, f.v, all, hk, dv);
  struct pieces {
    thd_view<T> q, k, v;
  };
  auto slot = [&](int to) {
    const std::size_t s = ws.send_slot(to, false);
    const std::size_t sk = s + all_to_all_workspace::align(ws.q_bytes(n));
    return pieces{dense_at<T>(base, s, n, hq, d), dense_at<T>(base, sk, n, hk, d),
                  dense_at<T>(base, sk + all_to_all_workspace::align(ws.k_bytes(n)), n, hk, dv)};
  };
  auto gathered = [&](std::int64_t at, std::int64_t count) {
    return pieces{rows_of(qa, at, count), rows_of(ka, at, count), rows_of(va, at, count)};
  };
  {
    nvtx_range range("all-to-all in", 0, r);
    for (int to = 0; to < p.ranks(); ++to) {
      const pieces dst = to == r ? gathered(p.offset_of(r), n) : slot(to);
      copy_view(e, dst.q, heads_of(q, h.q_begin(to), hq));
      copy_view(e, dst.k, heads_of(k, h.kv_begin(to), hk));
      copy_view(e, dst.v, heads_of(v, h.kv_begin(to), hk));
    }
    exchange_all(
        e, p, 0,
        [&](int to) {
          return bytes_at{slot(to).q.data, ws.q_bytes(n)};
        },
        [&](int from) {
          const auto c = static_cast<std::size_t>(p.tokens_of(from));
          return landing{gathered(p.offset_of(from), 0).q.data, ws.q_bytes(c)};
        });
    exchange_all(
        e, p, 1,
        [&](int to) {
          return bytes_at{slot(to).k.data, ws.k_bytes(n)};
        },
        [&](int from) {
          const auto c = static_cast<std::size_t>(p.tokens_of(from));
          return landing{gathered(p.offset_of(from), 0).k.data, ws.k_bytes(c)};
        });
    exchange_all(
        e, p, 2,
        [&](int to) {
          return bytes_at{slot(to).v.data, ws.v_bytes(n)};
        },
        [&](int from) {
          const auto c = static_cast<std::size_t>(p.tokens_of(from));
          return landing{gathered(p.offset_of(from), 0).v.data, ws.v_bytes(c)};
        });
  }
  const auto oa = dense_at<T>(base, f.out, all, hq, dv);
  float* lse_all = at(base, f.lse);
  e.template forward<T>(p.local(), la, qa, ka, va,
                        attention_state{at(base, f.o), lse_all, at(base, f.sum), all, hq, dv}, oa);
  nvtx_range range("all-to-all out", 0, r);
  // Rows of the gathered lse ([hq, N]) of each shard, side by side: what goes home.
  float* lse_out = at(base, f.lse_out);
  const std::size_t row = static_cast<std::size_t>(all) * sizeof(float);
  for (int to = 0; to < p.ranks(); ++to) {
    const std::int64_t c = p.tokens_of(to), o = p.offset_of(to);
    float* dst = to == r ? lse + static_cast<std::int64_t>(r) * hq * n : lse_out + hq * o;
    e.copy(dst, c * sizeof(float), lse_all + o, row, c * sizeof(float), hq);
  }
  copy_view(e, heads_of(out, h.q_begin(r), hq), thd_view<const T>(rows_of(oa, p.offset_of(r), n)));
  auto back = [&](int from) { return dense_at<T>(base, ws.return_slot(from, false), n, hq, dv); };
  exchange_all(
      e, p, 3,
      [&](int to) {
        const auto c = static_cast<std::size_t>(p.tokens_of(to));
        return bytes_at{rows_of(oa, p.offset_of(to), 0).data, ws.o_bytes(c)};
      },
      [&](int from) {
        return landing{back(from).data, ws.o_bytes(n)};
      });
  exchange_all(
      e, p, 4,
      [&](int to) {
        const auto c = static_cast<std::size_t>(p.tokens_of(to));
        return bytes_at{lse_out + hq * p.offset_of(to), ws.lse_bytes(c)};
      },
      [&](int from) {
        return landing{lse + static_cast<std::int64_t>(from) * hq * n, ws.lse_bytes(n)};
      });
  for (int from = 0; from < p.ranks(); ++from)
    if (from != r) copy_view(e, heads_of(out, h.q_begin(from), hq), thd_view<const T>(back(from)));
}

template <class T, class Engine>
void all_to_all_backward(Engine& e, const all_to_all_plan& p, thd_view<const T> q,
                         thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                         const float* lse, thd_view<const T> dout, thd_view<T> dq, thd_view<T> dk,
                         thd_view<T> dv, std::byte* base) {
  const all_to_all_workspace ws(p, sizeof(T));
  const auto& b = ws.backward();
  const head_split& h = p.heads();
  const attention_arguments& la = p.local_arguments();
  const int r = p.rank(), hq = h.q_per_rank, hk = h.kv_per_rank, d = la.qk_dim(), w = la.v_dim();
  const std::int64_t n = p.q_tokens(), all = p.tokens();
  using A = all_to_all_workspace;
  struct pieces {
    thd_view<T> q, k, v, out, dout;
  };
  const pieces ga{dense_at<T>(base, b.q, all, hq, d), dense_at<T>(base, b.k, all, hk, d),
                  dense_at<T>(base, b.v, all, hk, w), dense_at<T>(base, b.out, all, hq, w),
                  dense_at<T>(base, b.dout, all, hq, w)};
  auto slot = [&](int to) {
    std::size_t s = ws.send_slot(to, true);
    pieces x;
    x.q = dense_at<T>(base, s, n, hq, d), s += A::align(ws.q_bytes(n));
    x.k = dense_at<T>(base, s, n, hk, d), s += A::align(ws.k_bytes(n));
    x.v = dense_at<T>(base, s, n, hk, w), s += A::align(ws.v_bytes(n));
    x.out = dense_at<T>(base, s, n, hq, w), s += A::align(ws.o_bytes(n));
    x.dout = dense_at<T>(base, s, n, hq, w);
    return x;
  };
  auto gathered = [&](std::int64_t at, std::int64_t count) {
    return pieces{rows_of(ga.q, at, count), rows_of(ga.k, at, count), rows_of(ga.v, at, count),
                  rows_of(ga.out, at, count), rows_of(ga.dout, at, count)};
  };
  float* lse_all = at(base, b.lse);
  float* lse_in = at(base, b.lse_in);
  const std::size_t row = static_cast<std::size_t>(all) * sizeof(float);
  {
    nvtx_range range("all-to-all in", 1, r);
    for (int to = 0; to < p.ranks(); ++to) {
      const pieces dst = to == r ? gathered(p.offset_of(r), n) : slot(to);
      copy_view(e, dst.q, heads_of(q, h.q_begin(to), hq));
      copy_view(e, dst.k, heads_of(k, h.kv_begin(to), hk));
      copy_view(e, dst.v, heads_of(v, h.kv_begin(to), hk));
      copy_view(e, dst.out, heads_of(out, h.q_begin(to), hq));
      copy_view(e, dst.dout, heads_of(dout, h.q_begin(to), hq));
    }
    e.copy(lse_all + p.offset_of(r), row, lse + static_cast<std::int64_t>(r) * hq * n,
           n * sizeof(float), n * sizeof(float), hq);
    // One tensor at a time: each exchange sends this rank's rows and receives a shard's.
    auto tensor = [&](int tag, auto member, auto bytes) {
      exchange_all(
          e, p, tag,
          [&](int to) {
            return bytes_at{(slot(to).*member).data, bytes(n)};
          },
          [&](int from) {
            return landing{(gathered(p.offset_of(from), 0).*member).data, bytes(p.tokens_of(from))};
          });
    };
    auto qb = [&](std::int64_t c) { return ws.q_bytes(static_cast<std::size_t>(c)); };
    auto kb = [&](std::int64_t c) { return ws.k_bytes(static_cast<std::size_t>(c)); };
    auto vb = [&](std::int64_t c) { return ws.v_bytes(static_cast<std::size_t>(c)); };
    auto ob = [&](std::int64_t c) { return ws.o_bytes(static_cast<std::size_t>(c)); };
    tensor(10, &pieces::q, qb);
    tensor(11, &pieces::k, kb);
    tensor(12, &pieces::v, vb);
    tensor(13, &pieces::out, ob);
    tensor(14, &pieces::dout, ob);
    exchange_all(
        e, p, 15,
        [&](int to) {
          return bytes_at{lse + static_cast<std::int64_t>(to) * hq * n, ws.lse_bytes(n)};
        },
        [&](int from) {
          const auto c = static_cast<std::size_t>(p.tokens_of(from));
          return landing{lse_in + hq * p.offset_of(from), ws.lse_bytes(c)};
        });
    for (int from = 0; from < p.ranks(); ++from)
      if (from != r) {
        const std::int64_t c = p.tokens_of(from), o = p.offset_of(from);
        e.copy(lse_all + o, row, lse_in + hq * o, c * sizeof(float), c * sizeof(float), hq);
      }
  }
  float* dq_acc = at(base, b.dq);
  float* dk_acc = at(base, b.dk);
  float* dv_acc = at(base, b.dv);
  e.template backward<T>(p.local(), la, ga.q, ga.k, ga.v, ga.out, ga.dout, lse_all,
                         at(base, b.delta), gradient_state{dq_acc, dk_acc, dv_acc});
  nvtx_range range("all-to-all out", 1, r);
  const auto dq_t = dense_at<T>(base, b.dq_t, all, hq, d);
  const auto dk_t = dense_at<T>(base, b.dkv_t, all, hk, d);
  const auto dv_t =
      dense_at<T>(base, b.dkv_t + ws.k_bytes(static_cast<std::size_t>(all)), all, hk, w);
  e.write(dq_acc, dq_t);
  const bool replicated = ws.replicated();
  if (!replicated) {
    e.write(dk_acc, dk_t);
    e.write(dv_acc, dv_t);
  }
  struct grads {
    std::byte *dq, *dk, *dv;
  };
  auto back = [&](int from) {
    std::byte* s = base + ws.return_slot(from, true);
    return grads{s, s + A::align(ws.q_bytes(n)),
                 s + A::align(ws.q_bytes(n)) + A::align(ws.grad_k_bytes(n))};
  };
  // The rows of shard `to` of this rank's dk or dv as they go home (T, or the fp32 shares).
  auto dk_rows = [&](int to) -> const void* {
    return replicated ? static_cast<const void*>(dk_acc + p.offset_of(to) * hk * d)
                      : rows_of(dk_t, p.offset_of(to), 0).data;
  };
  auto dv_rows = [&](int to) -> const void* {
    return replicated ? static_cast<const void*>(dv_acc + p.offset_of(to) * hk * w)
                      : rows_of(dv_t, p.offset_of(to), 0).data;
  };
  copy_view(e, heads_of(dq, h.q_begin(r), hq), thd_view<const T>(rows_of(dq_t, p.offset_of(r), n)));
  if (replicated) {
    e.copy(back(r).dk, ws.grad_k_bytes(n), dk_rows(r), ws.grad_k_bytes(n), ws.grad_k_bytes(n), 1);
    e.copy(back(r).dv, ws.grad_v_bytes(n), dv_rows(r), ws.grad_v_bytes(n), ws.grad_v_bytes(n), 1);
  } else {
    copy_view(e, heads_of(dk, h.kv_begin(r), hk),
              thd_view<const T>(rows_of(dk_t, p.offset_of(r), n)));
    copy_view(e, heads_of(dv, h.kv_begin(r), hk),
              thd_view<const T>(rows_of(dv_t, p.offset_of(r), n)));
  }
  auto sized = [&](int to, auto bytes) { return bytes(static_cast<std::size_t>(p.tokens_of(to))); };
  exchange_all(
      e, p, 16,
      [&](int to) {
        return bytes_at{rows_of(dq_t, p.offset_of(to), 0).data,
                        sized(to, [&](std::size_t c) { return ws.q_bytes(c); })};
      },
      [&](int from) {
        return landing{back(from).dq, ws.q_bytes(n)};
      });
  exchange_all(
      e, p, 17,
      [&](int to) {
        return bytes_at{dk_rows(to), sized(to, [&](std::size_t c) { return ws.grad_k_bytes(c); })};
      },
      [&](int from) {
        return landing{back(from).dk, ws.grad_k_bytes(n)};
      });
  exchange_all(
      e, p, 18,
      [&](int to) {
        return bytes_at{dv_rows(to), sized(to, [&](std::size_t c) { return ws.grad_v_bytes(c); })};
      },
      [&](int from) {
        return landing{back(from).dv, ws.grad_v_bytes(n)};
      });
  for (int from = 0; from < p.ranks(); ++from)
    if (from != r)
      copy_view(e, heads_of(dq, h.q_begin(from), hq),
                thd_view<const T>(dense_at<T>(back(from).dq, 0, n, hq, d)));
  if (!replicated) {
    for (int from = 0; from < p.ranks(); ++from)
      if (from != r) {
        copy_view(e, heads_of(dk, h.kv_begin(from), hk),
                  thd_view<const T>(dense_at<T>(back(from).dk, 0, n, hk, d)));
        copy_view(e, heads_of(dv, h.kv_begin(from), hk),
                  thd_view<const T>(dense_at<T>(back(from).dv, 0, n, hk, w)));
      }
    return;
  }
  // Every kv head's replicas (ranks kh * m ... kh * m + m - 1) added in rank order, then written.
  const int m = h.replicas;
  for (int kh = 0; kh * m < p.ranks(); ++kh) {
    const grads first = back(kh * m);
    for (int j = 1; j < m; ++j) {
      e.add(at(first.dk, 0), at(back(kh * m + j).dk, 0), n * d);
      e.add(at(first.dv, 0), at(back(kh * m + j).dv, 0), n * w);
    }
    e.write(at(first.dk, 0), heads_of(dk, kh, 1));
    e.write(at(first.dv, 0), heads_of(dv, kh, 1));
  }
}

//! The host engine: blocking exchanges, host copies, the BlockKernel's host block.
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

template <class BlockKernel, class Communicator, element T>
void host_all_to_all_forward(Communicator& comm, const all_to_all_plan& p, thd_view<const T> q,
                             thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
                             std::span<std::byte> workspace) {
  host_all_to_all_engine<BlockKernel, Communicator> e{comm};
  all_to_all_forward<T>(e, p, q, k, v, out, lse, workspace.data());
}

template <class BlockKernel, class Communicator, element T>
void host_all_to_all_backward(Communicator& comm, const all_to_all_plan& p, thd_view<const T> q,
                              thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                              const float* lse, thd_view<const T> dout, thd_view<T> dq,
                              thd_view<T> dk, thd_view<T> dv, std::span<std::byte> workspace) {
  host_all_to_all_engine<BlockKernel, Communicator> e{comm};
  all_to_all_backward<T>(e, p, q, k, v, out, lse, dout, dq, dk, dv, workspace.data());
}

#if defined(__CUDACC__)
//! The device engine: every copy, exchange and kernel enqueued on the caller's stream in order
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
    if (s.needs_reset(true)) reset(state, stream);
    for (const ring_step& step : s.steps()) {
      nvtx_range range("step", step.index, s.rank());
      const step_epilogue e = s.forward_epilogue(step.index, true);
      if (e != step_epilogue::none)
        BlockKernel::device_forward(
            e,
            {thd_view<const T>(q), thd_view<const T>(k), thd_view<const T>(v), a, state, scratch},
            d.forward[static_cast<std::size_t>(step.index)], out, nullptr, stream);
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

// One rank: nothing to exchange, the ring's path (its schedule is the gathered one).
template <class BlockKernel, class Communicator, class T>
void device_all_to_all_forward(Communicator& comm, const all_to_all_plan& p,
                               ring_device_resources<BlockKernel>& d,
                               const attention_arguments& args, thd_view<const T> q,
                               thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                               float* lse, std::byte* workspace, cudaStream_t stream) {
  if (p.ranks() == 1) {
    device_ring_forward<BlockKernel, Communicator, T>(comm, p.local(), d, args, q, k, v, out, lse,
                                                      workspace, stream);
    return;
  }
  const all_to_all_workspace ws(p, sizeof(T));
  device_all_to_all_engine<BlockKernel, Communicator> e{
      comm, d, workspace + all_to_all_workspace::align(ws.forward_bytes()), stream};
  all_to_all_forward<T>(e, p, q, k, v, out, lse, workspace);
}

template <class BlockKernel, class Communicator, class T>
void device_all_to_all_backward(Communicator& comm, const all_to_all_plan& p,
                                ring_device_resources<BlockKernel>& d,
                                const attention_arguments& args, thd_view<const T> q,
                                thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                                const float* lse, thd_view<const T> dout, thd_view<T> dq,
                                thd_view<T> dk, thd_view<T> dv, std::byte* workspace,
                                cudaStream_t stream) {
  if (p.ranks() == 1) {
    device_ring_backward<BlockKernel, Communicator, T>(comm, p.local(), d, args, q, k, v, out, lse,
                                                       dout, dq, dk, dv, workspace, stream);
    return;
  }
  const all_to_all_workspace ws(p, sizeof(T));
  device_all_to_all_engine<BlockKernel, Communicator> e{
      comm, d, workspace + all_to_all_workspace::align(ws.backward_bytes()), stream};
  all_to_all_backward<T>(e, p, q, k, v, out, lse, dout, dq, dk, dv, workspace);
}
#endif // __CUDACC__

} // namespace ringattn::detail
