#pragma once
//! \file
//! The all-to-all's programs (`all_to_all_program`, forward and backward), written once over an
//! engine that moves bytes and runs the block kernel: `host_all_to_all_engine`
//! (ring/host_engine.cuh: blocking exchanges, the BlockKernel's host block) and
//! `device_all_to_all_engine` (ring/device_engine.cuh: everything enqueued on the caller's
//! stream: 2D copies, the communicator's device exchanges, the BlockKernel's device block; no
//! host wait). The vocabulary: `copy` (2D), `exchange` (bytes to and from a peer), `add` and
//! `write` (fp32 sums), `forward` and `backward` (the block calls of a whole schedule over the
//! gathered shards).
//!
//! Every exchange carries one message per peer (pairwise, P - 1 of them: in exchange k to the
//! peer k places on, from the one k places back), its pieces back to back (the layout in
//! all_to_all_workspace), so a forward makes two rounds of exchanges and a backward two,
//! whatever the number of tensors. Forward, on rank r (n its tokens; a group of A consecutive
//! ranks, A = P for the plain all-to-all; `hq`/`hk` the heads a rank computes/holds):
//! 1. k, v and q of every head class are packed from this rank's shard into that class's
//!    message; every rank of the class gets its k and v, the group's rank also its q; each
//!    arrived message (and this rank's own) is copied into the gathered buffers, in rank order;
//! 2. the attention runs over the gathered shards (all_to_all_plan::local: one block-kernel call
//!    per ring step, the state merged in fp32 as on the ring);
//! 3. each group member's output rows and lse go home in one message, into their heads.
//! Backward: k, v (and, inside the group, q, out, dout and the lse) travel as in step 1; D, then
//! the block backward's fp32 dq, dk, dv over the gathered shards; each rank's dk, dv rows (and a
//! group member's dq) go home in one message. Where several ranks hold the same kv heads
//! (replicas, or the groups of the hybrid) the owner adds their fp32 shares in rank order, so
//! every call gives the same bits.
//!
//! The bytes a rank sends are written out in test/support/all_to_all_bytes.hpp and docs/ring.md;
//! the tests hold every call to them.

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/backward_args.cuh>
#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/block/device/host_backward.cuh>
#include <ringattn/block/device/host_forward.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/detail/nvtx.cuh>
#include <ringattn/ring/all_to_all.cuh>
#include <ringattn/ring/device_engine.cuh>
#include <ringattn/ring/host_engine.cuh>
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

//! One round: the `size - 1` pairwise exchanges among `peers`; in exchange k this rank sends
//! `send(to)` (a pointer and a byte count) to the peer k places on and receives `recv(from)` from
//! the one k places back. `tag` tells the rounds of one call apart.
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

//! The pieces of one message, back to back from `at`: `next(bytes)` is where the next starts.
struct pieces_at {
  std::byte* at;
  std::byte* next(std::size_t bytes) {
    std::byte* p = at;
    at += bytes;
    return p;
  }
};
//! `bytes` contiguous bytes from `src` to `dst` (one engine copy).
template <class Engine>
void copy_bytes(Engine& e, void* dst, const void* src, std::size_t bytes) {
  e.copy(dst, bytes, src, bytes, bytes, 1);
}

//! Where rank `s`'s message of the in-exchange lies: this rank's own stays in its send slot.
inline std::byte* in_message(const all_to_all_plan& p, const all_to_all_workspace& ws,
                             bool backward, std::byte* base, int s) {
  return base +
         (s == p.rank() ? ws.send_slot(p.head_class(), backward) : ws.land_slot(s, backward));
}

//! The in-exchange: to every peer the message of its head class (the part past k and v only
//! inside the group), from every peer its message into its landing slot.
template <class Engine>
void exchange_in(Engine& e, const all_to_all_plan& p, const all_to_all_workspace& ws, bool backward,
                 std::byte* base) {
  const auto bytes = [&](int rank, bool group) {
    const auto t = static_cast<std::size_t>(p.tokens_of(rank));
    return backward ? ws.grad_in_bytes(t, group) : ws.in_bytes(t, group);
  };
  exchange_all(
      e, all_peers(p), backward ? 10 : 0,
      [&](int to) {
        return bytes_at{base + ws.send_slot(p.class_of(to), backward),
                        bytes(p.rank(), p.in_group(to))};
      },
      [&](int from) {
        return landing{in_message(p, ws, backward, base, from), bytes(from, p.in_group(from))};
      });
}

//! Copies rank `s`'s k and v (and, from a group member, q) out of its in-message into the
//! gathered buffers; returns the cursor past them.
template <class Engine, class T>
pieces_at unpack_kvq(Engine& e, const all_to_all_plan& p, const all_to_all_workspace& ws,
                     std::byte* message, int s, thd_view<T> ka, thd_view<T> va, thd_view<T> qa) {
  pieces_at m{message};
  const auto t = static_cast<std::size_t>(p.tokens_of(s));
  copy_bytes(e, rows_of(ka, p.offset_of(s), 0).data, m.next(ws.k_bytes(t)), ws.k_bytes(t));
  copy_bytes(e, rows_of(va, p.offset_of(s), 0).data, m.next(ws.v_bytes(t)), ws.v_bytes(t));
  if (p.in_group(s))
    copy_bytes(e, rows_of(qa, p.group_offset_of(s), 0).data, m.next(ws.q_bytes(t)), ws.q_bytes(t));
  return m;
}

//! The all-to-all's programs (the plain all-to-all and the hybrid).
struct all_to_all_program {
  template <class T, class Engine>
  static void forward(Engine& e, const all_to_all_plan& p, thd_view<const T> q, thd_view<const T> k,
                      thd_view<const T> v, thd_view<T> out, float* lse, float* max_logit,
                      std::byte* base) {
    const all_to_all_workspace ws(p, element_format::of<T>());
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
    {
      nvtx_range range("all-to-all in", 0, r);
      for (int c = 0; c < classes; ++c) {
        pieces_at m{base + ws.send_slot(c, false)};
        copy_view(e, dense_at<T>(m.next(ws.k_bytes(size(r))), 0, n, hk, d),
                  heads_of(k, h.kv_begin(c), hk));
        copy_view(e, dense_at<T>(m.next(ws.v_bytes(size(r))), 0, n, hk, dv),
                  heads_of(v, h.kv_begin(c), hk));
        copy_view(e, dense_at<T>(m.next(ws.q_bytes(size(r))), 0, n, hq, d),
                  heads_of(q, h.q_begin(c), hq));
      }
      exchange_in(e, p, ws, false, base);
      for (int s = 0; s < p.ranks(); ++s)
        unpack_kvq(e, p, ws, in_message(p, ws, false, base, s), s, ka, va, qa);
    }
    const auto oa = dense_at<T>(base, f.out, group, hq, dv);
    float* lse_all = at(base, f.lse);
    e.template forward<T>(p.local(), la, qa, ka, va,
                          attention_state{at(base, f.o), lse_all, at(base, f.sum), group, hq, dv,
                                          max_logit ? max_logit + h.q_begin(mine) : nullptr},
                          oa);
    nvtx_range range("all-to-all out", 0, r);
    // Each group member's output rows and its columns of the gathered lse ([hq, G]): this rank's
    // straight into its heads, the others' into their messages.
    const std::size_t row = static_cast<std::size_t>(group) * sizeof(float);
    copy_view(e, heads_of(out, h.q_begin(mine), hq),
              thd_view<const T>(rows_of(oa, p.group_offset_of(r), n)));
    e.copy(lse + static_cast<std::int64_t>(mine) * hq * n, size(r) * sizeof(float),
           lse_all + p.group_offset_of(r), row, size(r) * sizeof(float),
           static_cast<std::size_t>(hq));
    for (int c = 0; c < classes; ++c) {
      const int to = p.group_first() + c;
      if (to == r) continue;
      pieces_at m{base + ws.back_send_slot(c, false)};
      const std::size_t t = size(to);
      copy_bytes(e, m.next(ws.o_bytes(t)), rows_of(oa, p.group_offset_of(to), 0).data,
                 ws.o_bytes(t));
      e.copy(m.next(ws.lse_bytes(t)), t * sizeof(float), lse_all + p.group_offset_of(to), row,
             t * sizeof(float), static_cast<std::size_t>(hq));
    }
    exchange_all(
        e, group_peers(p), 1,
        [&](int to) {
          return bytes_at{base + ws.back_send_slot(p.class_of(to), false), ws.out_bytes(size(to))};
        },
        [&](int from) {
          return landing{base + ws.back_land_slot(p.class_of(from), false), ws.out_bytes(size(r))};
        });
    for (int c = 0; c < classes; ++c) {
      if (c == mine) continue;
      pieces_at m{base + ws.back_land_slot(c, false)};
      copy_view(e, heads_of(out, h.q_begin(c), hq),
                thd_view<const T>(dense_at<T>(m.next(ws.o_bytes(size(r))), 0, n, hq, dv)));
      copy_bytes(e, lse + static_cast<std::int64_t>(c) * hq * n, m.next(ws.lse_bytes(size(r))),
                 ws.lse_bytes(size(r)));
    }
  }

  template <class T, class Engine>
  static void backward(Engine& e, const all_to_all_plan& p, thd_view<const T> q,
                       thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                       const float* lse, thd_view<const T> dout, thd_view<T> dq, thd_view<T> dk,
                       thd_view<T> dv, std::byte* base) {
    const all_to_all_workspace ws(p, element_format::of<T>());
    const auto& b = ws.backward();
    const head_split& h = p.heads();
    const attention_arguments& la = p.local_arguments();
    const int r = p.rank(), mine = p.head_class(), classes = p.group_size();
    const int hq = h.q_per_rank, hk = h.kv_per_rank, d = la.qk_dim(), w = la.v_dim();
    const std::int64_t n = p.q_tokens(), group = p.group_tokens(), all = p.tokens();
    const auto size = [&](int rank) { return static_cast<std::size_t>(p.tokens_of(rank)); };
    const auto qa = dense_at<T>(base, b.q, group, hq, d);
    const auto ka = dense_at<T>(base, b.k, all, hk, d);
    const auto va = dense_at<T>(base, b.v, all, hk, w);
    const auto oa = dense_at<T>(base, b.out, group, hq, w);
    const auto da = dense_at<T>(base, b.dout, group, hq, w);
    float* lse_all = at(base, b.lse);
    const std::size_t row = static_cast<std::size_t>(group) * sizeof(float);
    {
      nvtx_range range("all-to-all in", 1, r);
      for (int c = 0; c < classes; ++c) {
        pieces_at m{base + ws.send_slot(c, true)};
        const std::size_t t = size(r);
        copy_view(e, dense_at<T>(m.next(ws.k_bytes(t)), 0, n, hk, d),
                  heads_of(k, h.kv_begin(c), hk));
        copy_view(e, dense_at<T>(m.next(ws.v_bytes(t)), 0, n, hk, w),
                  heads_of(v, h.kv_begin(c), hk));
        copy_view(e, dense_at<T>(m.next(ws.q_bytes(t)), 0, n, hq, d),
                  heads_of(q, h.q_begin(c), hq));
        copy_view(e, dense_at<T>(m.next(ws.o_bytes(t)), 0, n, hq, w),
                  heads_of(out, h.q_begin(c), hq));
        copy_view(e, dense_at<T>(m.next(ws.o_bytes(t)), 0, n, hq, w),
                  heads_of(dout, h.q_begin(c), hq));
        copy_bytes(e, m.next(ws.lse_bytes(t)), lse + static_cast<std::int64_t>(c) * hq * n,
                   ws.lse_bytes(t));
      }
      exchange_in(e, p, ws, true, base);
      for (int s = 0; s < p.ranks(); ++s) {
        pieces_at m = unpack_kvq(e, p, ws, in_message(p, ws, true, base, s), s, ka, va, qa);
        const std::size_t t = size(s);
        if (!p.in_group(s)) continue;
        const std::int64_t g = p.group_offset_of(s);
        copy_bytes(e, rows_of(oa, g, 0).data, m.next(ws.o_bytes(t)), ws.o_bytes(t));
        copy_bytes(e, rows_of(da, g, 0).data, m.next(ws.o_bytes(t)), ws.o_bytes(t));
        e.copy(lse_all + g, row, m.next(ws.lse_bytes(t)), t * sizeof(float), t * sizeof(float),
               static_cast<std::size_t>(hq));
      }
    }
    float* dq_acc = at(base, b.dq);
    float* dk_acc = at(base, b.dk);
    float* dv_acc = at(base, b.dv);
    e.template backward<T>(p.local(), la, qa, ka, va, oa, da, lse_all, at(base, b.delta),
                           gradient_state{dq_acc, dk_acc, dv_acc});
    nvtx_range range("all-to-all out", 1, r);
    const bool shared = ws.shared();
    // Rank `to`'s rows of the fp32 sums: dk, dv of its shard, dq of a group member's.
    auto dk_rows = [&](int to) { return dk_acc + p.offset_of(to) * hk * d; };
    auto dv_rows = [&](int to) { return dv_acc + p.offset_of(to) * hk * w; };
    auto dq_rows = [&](int to) { return dq_acc + p.group_offset_of(to) * hq * d; };
    // This rank's own dq straight into its heads (and dk, dv where nothing is shared); every other
    // rank's rows into its message: dk, dv (T, or the fp32 shares), then dq inside the group.
    e.write(dq_rows(r), heads_of(dq, h.q_begin(mine), hq));
    if (!shared) {
      e.write(dk_rows(r), heads_of(dk, h.kv_begin(mine), hk));
      e.write(dv_rows(r), heads_of(dv, h.kv_begin(mine), hk));
    }
    for (int to = 0; to < p.ranks(); ++to) {
      if (to == r) continue;
      pieces_at m{base + ws.back_send_slot(to, true)};
      const std::size_t t = size(to);
      const auto nt = static_cast<std::int64_t>(t);
      if (shared) {
        copy_bytes(e, m.next(ws.grad_k_bytes(t)), dk_rows(to), ws.grad_k_bytes(t));
        copy_bytes(e, m.next(ws.grad_v_bytes(t)), dv_rows(to), ws.grad_v_bytes(t));
      } else {
        e.write(dk_rows(to), dense_at<T>(m.next(ws.k_bytes(t)), 0, nt, hk, d));
        e.write(dv_rows(to), dense_at<T>(m.next(ws.v_bytes(t)), 0, nt, hk, w));
      }
      if (p.in_group(to)) e.write(dq_rows(to), dense_at<T>(m.next(ws.q_bytes(t)), 0, nt, hq, d));
    }
    exchange_all(
        e, all_peers(p), 11,
        [&](int to) {
          return bytes_at{base + ws.back_send_slot(to, true),
                          ws.grad_out_bytes(size(to), p.in_group(to))};
        },
        [&](int from) {
          return landing{base + ws.back_land_slot(from, true),
                         ws.grad_out_bytes(size(r), p.in_group(from))};
        });
    // What came back from rank `s`: its dk, dv shares of this rank's rows, then its dq.
    auto back = [&](int s) { return base + ws.back_land_slot(s, true); };
    for (int c = 0; c < classes; ++c) {
      const int from = p.group_first() + c;
      if (from == r) continue;
      pieces_at m{back(from)};
      m.next(ws.grad_k_bytes(size(r)) + ws.grad_v_bytes(size(r)));
      copy_view(e, heads_of(dq, h.q_begin(c), hq),
                thd_view<const T>(dense_at<T>(m.next(ws.q_bytes(size(r))), 0, n, hq, d)));
    }
    if (!shared) { // one group, nothing replicated: each class's heads from its one rank
      for (int c = 0; c < classes; ++c) {
        if (c == mine) continue;
        pieces_at m{back(p.group_first() + c)};
        copy_view(e, heads_of(dk, h.kv_begin(c), hk),
                  thd_view<const T>(dense_at<T>(m.next(ws.k_bytes(size(r))), 0, n, hk, d)));
        copy_view(e, heads_of(dv, h.kv_begin(c), hk),
                  thd_view<const T>(dense_at<T>(m.next(ws.v_bytes(size(r))), 0, n, hk, w)));
      }
      return;
    }
    // Each kv head block's shares (every rank, in rank order, whose class holds it) added into the
    // first one's, then written. This rank's own share is its rows of the fp32 sums.
    auto share_k = [&](int s) { return s == r ? dk_rows(r) : at(back(s), 0); };
    auto share_v = [&](int s) {
      return s == r ? dv_rows(r) : at(back(s), ws.grad_k_bytes(size(r)));
    };
    for (int c = 0; c < classes; ++c) {
      if (c > 0 && h.kv_begin(c) == h.kv_begin(c - 1)) continue; // a replica of the class before
      int first = -1;
      for (int s = 0; s < p.ranks(); ++s) {
        if (h.kv_begin(p.class_of(s)) != h.kv_begin(c)) continue;
        if (first < 0) {
          first = s;
          continue;
        }
        e.add(share_k(first), share_k(s), n * hk * d);
        e.add(share_v(first), share_v(s), n * hk * w);
      }
      e.write(share_k(first), heads_of(dk, h.kv_begin(c), hk));
      e.write(share_v(first), heads_of(dv, h.kv_begin(c), hk));
    }
  }
};

template <class BlockKernel, class Communicator, element T>
void host_all_to_all_forward(Communicator& comm, const all_to_all_plan& p, thd_view<const T> q,
                             thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
                             float* max_logit, std::span<std::byte> workspace) {
  host_all_to_all_engine<BlockKernel, Communicator> e{comm};
  all_to_all_program::forward<T>(e, p, q, k, v, out, lse, max_logit, workspace.data());
}

template <class BlockKernel, class Communicator, element T>
void host_all_to_all_backward(Communicator& comm, const all_to_all_plan& p, thd_view<const T> q,
                              thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                              const float* lse, thd_view<const T> dout, thd_view<T> dq,
                              thd_view<T> dk, thd_view<T> dv, std::span<std::byte> workspace) {
  host_all_to_all_engine<BlockKernel, Communicator> e{comm};
  all_to_all_program::backward<T>(e, p, q, k, v, out, lse, dout, dq, dk, dv, workspace.data());
}

#if defined(__CUDACC__)
// One rank: nothing to exchange, the ring's path (its schedule is the gathered one).
template <class BlockKernel, class Communicator, class T>
void device_all_to_all_forward(Communicator& comm, const all_to_all_plan& p,
                               ring_device_resources<BlockKernel>& d,
                               const attention_arguments& args, thd_view<const T> q,
                               thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                               float* lse, float* max_logit, std::byte* workspace,
                               cudaStream_t stream) {
  if (p.ranks() == 1) {
    device_forward<ring_program, BlockKernel, Communicator, T>(
        comm, p.local(), d, args, q, k, v, out, lse, max_logit, workspace, stream);
    return;
  }
  const all_to_all_workspace ws(p, element_format::of<T>());
  device_all_to_all_engine<BlockKernel, Communicator> e{
      comm, d, workspace + all_to_all_workspace::align(ws.forward_bytes()), stream};
  all_to_all_program::forward<T>(e, p, q, k, v, out, lse, max_logit, workspace);
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
    device_backward<ring_program, BlockKernel, Communicator, T>(
        comm, p.local(), d, args, q, k, v, out, lse, dout, dq, dk, dv, workspace, stream);
    return;
  }
  const all_to_all_workspace ws(p, element_format::of<T>());
  device_all_to_all_engine<BlockKernel, Communicator> e{
      comm, d, workspace + all_to_all_workspace::align(ws.device_backward_bytes()), stream};
  all_to_all_program::backward<T>(e, p, q, k, v, out, lse, dout, dq, dk, dv, workspace);
}
#endif // __CUDACC__

} // namespace ringattn::detail
