#pragma once
//! \file
//! The all-to-all schedule's executors, written once over an *engine* that moves bytes and runs
//! the block kernel: the host engine (blocking exchanges, the BlockKernel's host block) and the
//! device engine (everything enqueued on the caller's stream: 2D copies, the communicator's
//! device exchanges, the BlockKernel's device block; no host wait).
//!
//! Forward, on rank r (n its tokens; a group of A consecutive ranks, A = P for the plain
//! all-to-all; `hq`/`hk` the heads a rank computes/holds):
//! 1. the q, k, v heads of every head class are packed from this rank's shard (its own class
//!    straight into the gathered buffers); pairwise exchanges (in exchange k: to the peer k
//!    places on, from the one k places back) bring q from every group member and K/V from every
//!    rank of this rank's class, in rank order;
//! 2. the attention runs over the gathered shards (all_to_all_plan::local: one block-kernel call
//!    per ring step, the state merged in fp32 as on the ring);
//! 3. each group member's output rows and lse go home the same way, into their heads.
//! Backward: q, k, v, out, dout and the lse travel as in step 1; D, then the block backward's
//! fp32 dq, dk, dv over the gathered shards; dq goes home inside the group, dk and dv to every
//! rank. Where several ranks hold the same kv heads (replicas, or the groups of the hybrid) the
//! owner adds their fp32 shares in rank order, so every call gives the same bits.
//!
//! The bytes a rank sends are written out in test/all_to_all_bytes.hpp and docs/ring.md; the
//! tests hold every call to them.

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

//! The ranks one tensor travels between: `size` ranks from `first` on (a group, or all of them),
//! this one at `me` among them; `ranks` in all.
struct peer_ring {
  int first, size, me, ranks;
};
inline peer_ring group_peers(const all_to_all_plan& p) {
  return {p.group_first(), p.group_size(), p.head_class(), p.ranks()};
}
inline peer_ring all_peers(const all_to_all_plan& p) { return {0, p.ranks(), p.rank(), p.ranks()}; }

//! The `size - 1` pairwise exchanges of one tensor among `peers`: in exchange k this rank sends
//! `send(to)` (a pointer and a byte count) to the peer k places on and receives `recv(from)` from
//! the one k places back. `tag` tells the tensors of one call apart.
template <class Engine, class Send, class Recv>
void exchange_all(Engine& e, const peer_ring& peers, int tag, Send send, Recv recv) {
  for (int k = 1; k < peers.size; ++k) {
    const int to = peers.first + (peers.me + k) % peers.size;
    const int from = peers.first + (peers.me - k + peers.size) % peers.size;
    const auto [s, sn] = send(to);
    const auto [d, dn] = recv(from);
    e.exchange(s, sn, to, d, dn, from, static_cast<std::int64_t>(tag) * peers.ranks + k);
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

//! The exchanges of one tensor among `peers`: out goes `piece(c)`, this rank's piece for the
//! receiver's head class c; in comes the sender's shard at `land(from)`; `bytes(tokens)` sizes
//! either side by its shard.
template <class Engine, class Piece, class Land, class Bytes>
void exchange_tensor(Engine& e, const all_to_all_plan& p, const peer_ring& peers, int tag,
                     Piece piece, Land land, Bytes bytes) {
  const auto size = [&](int rank) { return static_cast<std::size_t>(p.tokens_of(rank)); };
  exchange_all(
      e, peers, tag,
      [&](int to) {
        return bytes_at{piece(p.class_of(to)), bytes(size(p.rank()))};
      },
      [&](int from) {
        return landing{land(from), bytes(size(from))};
      });
}

template <class T, class Engine>
void all_to_all_forward(Engine& e, const all_to_all_plan& p, thd_view<const T> q,
                        thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
                        std::byte* base) {
  using A = all_to_all_workspace;
  const A ws(p, sizeof(T));
  const auto& f = ws.forward();
  const head_split& h = p.heads();
  const attention_arguments& la = p.local_arguments();
  const int r = p.rank(), mine = p.head_class(), classes = p.group_size();
  const int hq = h.q_per_rank, hk = h.kv_per_rank, d = la.qk_dim(), dv = la.v_dim();
  const std::int64_t n = p.q_tokens(), group = p.group_tokens();
  const auto size = [&](int rank) { return static_cast<std::size_t>(p.tokens_of(rank)); };
  const auto qa = dense_at<T>(base, f.q, group, hq, d);
  const auto ka = dense_at<T>(base, f.k, p.tokens(), hk, d);
  const auto va = dense_at<T>(base, f.v, p.tokens(), hk, dv);
  struct pieces {
    thd_view<T> q, k, v;
  };
  // Head class c of this rank's q, k, v: its own class goes straight to the gathered buffers
  // (and is sent from there), the others to their send slots.
  auto piece = [&](int c) {
    if (c == mine)
      return pieces{rows_of(qa, p.group_offset_of(r), n), rows_of(ka, p.offset_of(r), n),
                    rows_of(va, p.offset_of(r), n)};
    std::size_t s = ws.send_slot(c, false);
    pieces x;
    x.q = dense_at<T>(base, s, n, hq, d), s += A::align(ws.q_bytes(n));
    x.k = dense_at<T>(base, s, n, hk, d), s += A::align(ws.k_bytes(n));
    x.v = dense_at<T>(base, s, n, hk, dv);
    return x;
  };
  {
    nvtx_range range("all-to-all in", 0, r);
    for (int c = 0; c < classes; ++c) {
      const pieces dst = piece(c);
      copy_view(e, dst.q, heads_of(q, h.q_begin(c), hq));
      copy_view(e, dst.k, heads_of(k, h.kv_begin(c), hk));
      copy_view(e, dst.v, heads_of(v, h.kv_begin(c), hk));
    }
    // q inside the group; k and v to every rank of each class (all groups).
    exchange_tensor(
        e, p, group_peers(p), 0, [&](int c) { return piece(c).q.data; },
        [&](int from) { return rows_of(qa, p.group_offset_of(from), 0).data; },
        [&](std::size_t c) { return ws.q_bytes(c); });
    exchange_tensor(
        e, p, all_peers(p), 1, [&](int c) { return piece(c).k.data; },
        [&](int from) { return rows_of(ka, p.offset_of(from), 0).data; },
        [&](std::size_t c) { return ws.k_bytes(c); });
    exchange_tensor(
        e, p, all_peers(p), 2, [&](int c) { return piece(c).v.data; },
        [&](int from) { return rows_of(va, p.offset_of(from), 0).data; },
        [&](std::size_t c) { return ws.v_bytes(c); });
  }
  const auto oa = dense_at<T>(base, f.out, group, hq, dv);
  float* lse_all = at(base, f.lse);
  e.template forward<T>(p.local(), la, qa, ka, va,
                        attention_state{at(base, f.o), lse_all, at(base, f.sum), group, hq, dv},
                        oa);
  nvtx_range range("all-to-all out", 0, r);
  // Columns of the gathered lse ([hq, G]) of each group member, side by side: what goes home.
  float* lse_out = at(base, f.lse_out);
  const std::size_t row = static_cast<std::size_t>(group) * sizeof(float);
  for (int c = 0; c < classes; ++c) {
    const int to = p.group_first() + c;
    const std::int64_t o = p.group_offset_of(to);
    float* dst = c == mine ? lse + static_cast<std::int64_t>(mine) * hq * n : lse_out + hq * o;
    e.copy(dst, size(to) * sizeof(float), lse_all + o, row, size(to) * sizeof(float),
           static_cast<std::size_t>(hq));
  }
  copy_view(e, heads_of(out, h.q_begin(mine), hq),
            thd_view<const T>(rows_of(oa, p.group_offset_of(r), n)));
  auto back = [&](int from) { return dense_at<T>(base, ws.out_slot(p.class_of(from)), n, hq, dv); };
  exchange_all(
      e, group_peers(p), 3,
      [&](int to) {
        return bytes_at{rows_of(oa, p.group_offset_of(to), 0).data, ws.o_bytes(size(to))};
      },
      [&](int from) {
        return landing{back(from).data, ws.o_bytes(size(r))};
      });
  exchange_all(
      e, group_peers(p), 4,
      [&](int to) {
        return bytes_at{lse_out + hq * p.group_offset_of(to), ws.lse_bytes(size(to))};
      },
      [&](int from) {
        return landing{lse + static_cast<std::int64_t>(p.class_of(from)) * hq * n,
                       ws.lse_bytes(size(r))};
      });
  for (int c = 0; c < classes; ++c)
    if (c != mine)
      copy_view(e, heads_of(out, h.q_begin(c), hq), thd_view<const T>(back(p.group_first() + c)));
}

template <class T, class Engine>
void all_to_all_backward(Engine& e, const all_to_all_plan& p, thd_view<const T> q,
                         thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                         const float* lse, thd_view<const T> dout, thd_view<T> dq, thd_view<T> dk,
                         thd_view<T> dv, std::byte* base) {
  using A = all_to_all_workspace;
  const A ws(p, sizeof(T));
  const auto& b = ws.backward();
  const head_split& h = p.heads();
  const attention_arguments& la = p.local_arguments();
  const int r = p.rank(), mine = p.head_class(), classes = p.group_size();
  const int hq = h.q_per_rank, hk = h.kv_per_rank, d = la.qk_dim(), w = la.v_dim();
  const std::int64_t n = p.q_tokens(), group = p.group_tokens(), all = p.tokens();
  const auto size = [&](int rank) { return static_cast<std::size_t>(p.tokens_of(rank)); };
  struct pieces {
    thd_view<T> q, k, v, out, dout;
  };
  const pieces ga{dense_at<T>(base, b.q, group, hq, d), dense_at<T>(base, b.k, all, hk, d),
                  dense_at<T>(base, b.v, all, hk, w), dense_at<T>(base, b.out, group, hq, w),
                  dense_at<T>(base, b.dout, group, hq, w)};
  // Where rank `from`'s rows land among the gathered ones (queries: the group's; K/V: all).
  auto gathered = [&](int from) {
    const std::int64_t g = p.in_group(from) ? p.group_offset_of(from) : 0;
    const std::int64_t o = p.offset_of(from);
    return pieces{rows_of(ga.q, g, 0), rows_of(ga.k, o, 0), rows_of(ga.v, o, 0),
                  rows_of(ga.out, g, 0), rows_of(ga.dout, g, 0)};
  };
  auto piece = [&](int c) {
    if (c == mine) {
      const std::int64_t g = p.group_offset_of(r), o = p.offset_of(r);
      return pieces{rows_of(ga.q, g, n), rows_of(ga.k, o, n), rows_of(ga.v, o, n),
                    rows_of(ga.out, g, n), rows_of(ga.dout, g, n)};
    }
    std::size_t s = ws.send_slot(c, true);
    pieces x;
    x.q = dense_at<T>(base, s, n, hq, d), s += A::align(ws.q_bytes(n));
    x.k = dense_at<T>(base, s, n, hk, d), s += A::align(ws.k_bytes(n));
    x.v = dense_at<T>(base, s, n, hk, w), s += A::align(ws.v_bytes(n));
    x.out = dense_at<T>(base, s, n, hq, w), s += A::align(ws.o_bytes(n));
    x.dout = dense_at<T>(base, s, n, hq, w);
    return x;
  };
  float* lse_all = at(base, b.lse);
  float* lse_in = at(base, b.lse_in);
  const std::size_t row = static_cast<std::size_t>(group) * sizeof(float);
  {
    nvtx_range range("all-to-all in", 1, r);
    for (int c = 0; c < classes; ++c) {
      const pieces dst = piece(c);
      copy_view(e, dst.q, heads_of(q, h.q_begin(c), hq));
      copy_view(e, dst.k, heads_of(k, h.kv_begin(c), hk));
      copy_view(e, dst.v, heads_of(v, h.kv_begin(c), hk));
      copy_view(e, dst.out, heads_of(out, h.q_begin(c), hq));
      copy_view(e, dst.dout, heads_of(dout, h.q_begin(c), hq));
    }
    e.copy(lse_all + p.group_offset_of(r), row, lse + static_cast<std::int64_t>(mine) * hq * n,
           size(r) * sizeof(float), size(r) * sizeof(float), static_cast<std::size_t>(hq));
    // One tensor at a time: q, out, dout (and the lse) inside the group, k and v to every rank.
    auto tensor = [&](const peer_ring& peers, int tag, thd_view<T> pieces::*member, auto bytes) {
      exchange_tensor(
          e, p, peers, tag, [&](int c) { return (piece(c).*member).data; },
          [&](int from) { return (gathered(from).*member).data; }, bytes);
    };
    auto qb = [&](std::size_t c) { return ws.q_bytes(c); };
    auto kb = [&](std::size_t c) { return ws.k_bytes(c); };
    auto vb = [&](std::size_t c) { return ws.v_bytes(c); };
    auto ob = [&](std::size_t c) { return ws.o_bytes(c); };
    tensor(group_peers(p), 10, &pieces::q, qb);
    tensor(all_peers(p), 11, &pieces::k, kb);
    tensor(all_peers(p), 12, &pieces::v, vb);
    tensor(group_peers(p), 13, &pieces::out, ob);
    tensor(group_peers(p), 14, &pieces::dout, ob);
    exchange_all(
        e, group_peers(p), 15,
        [&](int to) {
          return bytes_at{lse + static_cast<std::int64_t>(p.class_of(to)) * hq * n,
                          ws.lse_bytes(size(r))};
        },
        [&](int from) {
          return landing{lse_in + hq * p.group_offset_of(from), ws.lse_bytes(size(from))};
        });
    for (int c = 0; c < classes; ++c)
      if (c != mine) {
        const int from = p.group_first() + c;
        const std::int64_t o = p.group_offset_of(from);
        e.copy(lse_all + o, row, lse_in + hq * o, size(from) * sizeof(float),
               size(from) * sizeof(float), static_cast<std::size_t>(hq));
      }
  }
  float* dq_acc = at(base, b.dq);
  float* dk_acc = at(base, b.dk);
  float* dv_acc = at(base, b.dv);
  e.template backward<T>(p.local(), la, ga.q, ga.k, ga.v, ga.out, ga.dout, lse_all,
                         at(base, b.delta), gradient_state{dq_acc, dk_acc, dv_acc});
  nvtx_range range("all-to-all out", 1, r);
  const auto dq_t = dense_at<T>(base, b.dq_t, group, hq, d);
  const auto dk_t = dense_at<T>(base, b.dkv_t, all, hk, d);
  const auto dv_t =
      dense_at<T>(base, b.dkv_t + ws.k_bytes(static_cast<std::size_t>(all)), all, hk, w);
  e.write(dq_acc, dq_t);
  const bool shared = ws.shared();
  if (!shared) {
    e.write(dk_acc, dk_t);
    e.write(dv_acc, dv_t);
  }
  // dq: the group's rows go home to their ranks, where they land in this class's heads.
  auto dq_back = [&](int from) {
    return dense_at<T>(base, ws.dq_slot(p.class_of(from)), n, hq, d);
  };
  copy_view(e, heads_of(dq, h.q_begin(mine), hq),
            thd_view<const T>(rows_of(dq_t, p.group_offset_of(r), n)));
  exchange_all(
      e, group_peers(p), 16,
      [&](int to) {
        return bytes_at{rows_of(dq_t, p.group_offset_of(to), 0).data, ws.q_bytes(size(to))};
      },
      [&](int from) {
        return landing{dq_back(from).data, ws.q_bytes(size(r))};
      });
  for (int c = 0; c < classes; ++c)
    if (c != mine)
      copy_view(e, heads_of(dq, h.q_begin(c), hq), thd_view<const T>(dq_back(p.group_first() + c)));
  // dk, dv: every shard's rows go home from every rank (T, or the fp32 shares).
  auto dk_back = [&](int from) { return base + ws.dkv_slot(from); };
  auto dv_back = [&](int from) { return dk_back(from) + A::align(ws.grad_k_bytes(size(r))); };
  auto dk_rows = [&](int to) -> const void* {
    return shared ? static_cast<const void*>(dk_acc + p.offset_of(to) * hk * d)
                  : rows_of(dk_t, p.offset_of(to), 0).data;
  };
  auto dv_rows = [&](int to) -> const void* {
    return shared ? static_cast<const void*>(dv_acc + p.offset_of(to) * hk * w)
                  : rows_of(dv_t, p.offset_of(to), 0).data;
  };
  if (shared) {
    e.copy(dk_back(r), ws.grad_k_bytes(size(r)), dk_rows(r), ws.grad_k_bytes(size(r)),
           ws.grad_k_bytes(size(r)), 1);
    e.copy(dv_back(r), ws.grad_v_bytes(size(r)), dv_rows(r), ws.grad_v_bytes(size(r)),
           ws.grad_v_bytes(size(r)), 1);
  } else {
    copy_view(e, heads_of(dk, h.kv_begin(mine), hk),
              thd_view<const T>(rows_of(dk_t, p.offset_of(r), n)));
    copy_view(e, heads_of(dv, h.kv_begin(mine), hk),
              thd_view<const T>(rows_of(dv_t, p.offset_of(r), n)));
  }
  exchange_all(
      e, all_peers(p), 17,
      [&](int to) {
        return bytes_at{dk_rows(to), ws.grad_k_bytes(size(to))};
      },
      [&](int from) {
        return landing{dk_back(from), ws.grad_k_bytes(size(r))};
      });
  exchange_all(
      e, all_peers(p), 18,
      [&](int to) {
        return bytes_at{dv_rows(to), ws.grad_v_bytes(size(to))};
      },
      [&](int from) {
        return landing{dv_back(from), ws.grad_v_bytes(size(r))};
      });
  if (!shared) { // one group, nothing replicated: each class's heads from its one rank
    for (int c = 0; c < classes; ++c)
      if (c != mine) {
        const int from = p.group_first() + c;
        copy_view(e, heads_of(dk, h.kv_begin(c), hk),
                  thd_view<const T>(dense_at<T>(dk_back(from), 0, n, hk, d)));
        copy_view(e, heads_of(dv, h.kv_begin(c), hk),
                  thd_view<const T>(dense_at<T>(dv_back(from), 0, n, hk, w)));
      }
    return;
  }
  // Each kv head block's shares (every rank, in rank order, whose class holds it) added into the
  // first one's, then written.
  for (int c = 0; c < classes; ++c) {
    if (c > 0 && h.kv_begin(c) == h.kv_begin(c - 1)) continue; // a replica of the class before
    int first = -1;
    for (int s = 0; s < p.ranks(); ++s) {
      if (h.kv_begin(p.class_of(s)) != h.kv_begin(c)) continue;
      if (first < 0) {
        first = s;
        continue;
      }
      e.add(at(dk_back(first), 0), at(dk_back(s), 0), n * hk * d);
      e.add(at(dv_back(first), 0), at(dv_back(s), 0), n * hk * w);
    }
    e.write(at(dk_back(first), 0), heads_of(dk, h.kv_begin(c), hk));
    e.write(at(dv_back(first), 0), heads_of(dv, h.kv_begin(c), hk));
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
      comm, d, workspace + all_to_all_workspace::align(ws.device_backward_bytes()), stream};
  all_to_all_backward<T>(e, p, q, k, v, out, lse, dout, dq, dk, dv, workspace);
}
#endif // __CUDACC__

} // namespace ringattn::detail
