#pragma once
//! \file
//! `cudnn_kernel<Mask, T>`: a BlockKernel whose device path computes every ring step's block with
//! cuDNN's fused attention (SDPA), the host path being the host twin.
//!
//! Plan time (`prepare_device`): each step's groups become pieces (block/device/pieces.cuh), one
//! cuDNN call per mask that occurs (a window's band pieces: one per band, cuDNN's top-left diagonal
//! band), each with its graph built and planned once (cudnn/graphs.cuh, a
//! cache shared by every functor of the same call shape) and its index tables in device memory.
//! The backward's graphs are built there too, so no call builds anything.
//!
//! Forward step: cuDNN writes each piece's O (T), and each row's largest logit and sum of
//! exponentials (fp32), packed in the scratch; a small kernel turns the two into the row's LSE
//! (natural log), raising the max logit's heads on the way where the call asks for it, and a merge
//! kernel adds O and LSE into the ring's fp32 state. A ring of one rank whose block is one piece
//! covering every row lets cuDNN write `out` (and the maxima into `lse`) directly. One graph for
//! both kinds of call: a forward with the max logit returns the same bits as one without.
//!
//! Backward step: cuDNN's SDPA backward from the final O, dO and LSE writes each piece's dQ, dK,
//! dV (T) packed in the scratch; an add kernel sums them into the fp32 accumulators (dQ over the
//! steps, dK/dV into the travelling block's). Rounding this adds beyond the native kernels: each
//! block's O and each block's gradients pass through T once before they join the fp32 sums. A
//! ring of one rank whose block is one piece covering every query and key lets cuDNN write dq, dk
//! and dv directly (`device_backward_whole`).
//!
//! The backward's algorithm is the third parameter: `cudnn_deterministic` (the default; both
//! directions repeat bit for bit; on sm_90 cuDNN keeps dP in the workspace, query rows x key rows
//! x query heads x 2 bytes per call) or `cudnn_atomic` (cuDNN's atomic dQ accumulation, as
//! PyTorch's default: workspace linear in the rows, faster, dQ not bitwise repeatable).
//!
//! Requirements: q, k, v (forward) and q, out, dout (backward) dense `[tokens, heads, width]`
//! (v, out and dout `head_dim_v` wide; cuDNN takes 192/128); the element type of every call is
//! `T`. Needs `ringattn::cudnn` (cudnn-frontend and cuDNN 9; windows: cuDNN 9.7 or later, whose
//! SDPA takes a left diagonal bound).
//!
//! \code
//! using kernel = ringattn::cudnn_kernel<ringattn::causal_mask, __nv_bfloat16>; // deterministic
//! ringattn::ring_attention<ringattn::zigzag, ringattn::nccl_communicator, kernel> attn(...);
//! attn.prepare_device();                                   // plans every cuDNN graph
//! std::size_t ws = attn.device_workspace_bytes<__nv_bfloat16>(); // includes cuDNN's workspace
//! \endcode

#include <ringattn/block/device/backward_args.cuh>
#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/block/device/pieces.cuh>
#include <ringattn/block/device/row_reduce.cuh>
#include <ringattn/block/device/state_ops.cuh>
#include <ringattn/block/host_reference.cuh>
#include <ringattn/block/masks.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/cudnn/graphs.cuh>
#include <ringattn/detail/device_tables.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <sstream>
#include <type_traits>
#include <vector>

namespace ringattn {

namespace detail {

inline std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }

//! One step's cuDNN calls in one direction, planned on the current device.
class cudnn_step {
public:
  cudnn_step(bool backward, bool deterministic, dtype type, std::span<const block_group> groups,
             std::int64_t q_tokens, std::int64_t kv_tokens, const attention_arguments& args)
      : backward_(backward), q_tokens_(q_tokens), args_(args) {
    const std::vector<piece_call> calls = calls_of(pieces_of(groups));
    if (calls.empty()) return;
    int device = 0;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
    const std::int64_t qh = args.q_heads, kvh = args.kv_heads, d = args.qk_dim(), dv = args.v_dim();
    std::vector<std::int64_t> i64;
    std::vector<std::int32_t> i32;
    auto put64 = [&](const std::vector<std::int64_t>& x) {
      const std::size_t at = i64.size();
      i64.insert(i64.end(), x.begin(), x.end());
      i64.resize((i64.size() + 1) / 2 * 2); // 16-byte aligned starts
      return at;
    };
    auto put32 = [&](const std::vector<std::int32_t>& x) {
      const std::size_t at = i32.size();
      i32.insert(i32.end(), x.begin(), x.end());
      i32.resize((i32.size() + 3) / 4 * 4);
      return at;
    };
    for (const piece_call& c : calls) {
      call k;
      k.q_rows = c.q_rows, k.kv_rows = c.kv_rows;
      k.batch = static_cast<std::int64_t>(c.pieces.size());
      // One piece of at least a tile each way runs dense (PyTorch's layout); anything else
      // packed, under the padding mask (cuDNN refuses some tiny dense shapes, 1 x 1 among them).
      // A band always runs packed: cuDNN takes a left bound with more queries than keys only
      // under the padding mask.
      k.packed = k.batch > 1 || c.max_q < 64 || c.max_kv < 64 || c.mask == piece_mask::band;
      const attention_piece& p0 = c.pieces.front();
      k.q_begin = p0.q_begin, k.kv_begin = p0.kv_begin;
      k.whole = !k.packed && p0.q_begin == 0 && p0.q_count == q_tokens;
      k.whole_kv = k.whole && p0.kv_begin == 0 && p0.kv_count == kv_tokens;
      sdpa_shape s;
      s.backward = backward, s.type = type, s.packed = k.packed, s.mask = c.mask;
      if (c.mask == piece_mask::band) s.band_lo = c.lo, s.band_hi = c.hi;
      s.batch = k.batch, s.q_heads = args.q_heads, s.kv_heads = args.kv_heads;
      s.head_dim = args.qk_dim(), s.head_dim_v = args.v_dim();
      s.scale = static_cast<float>(args.scale());
      s.deterministic = backward && deterministic, s.device = device;
      if (k.packed) {
        // Padded maxima and packed totals rounded up so that ranks and steps of nearly equal
        // shapes share one graph.
        auto up = [](std::int64_t n, std::int64_t to) { return (n + to - 1) / to * to; };
        s.s_q = up(c.max_q, 64), s.s_kv = up(c.max_kv, 64);
        // The backward's query side (Q, O, dO, dQ, Stats) lies at the Q shard's own rows: cuDNN's
        // atomic dQ accumulation is right only where dQ's rows are Q's.
        s.total_q = up(backward ? q_tokens : c.q_rows, 256), s.total_kv = up(c.kv_rows, 256);
        std::vector<std::int32_t> seq_q, seq_kv;
        // Element offsets of each piece's rows: Q (and the backward's dQ) at the shard's rows, K
        // and V at the block's, O (the forward's packed output) and stats packed, the
        // backward's O and dO at the shard's rows, dK and dV packed. V, O, dO and dV are dv wide.
        std::vector<std::int64_t> q_off, kv_off, v_off, o_off, o_in_off, stats_off, dkv_off, dv_off;
        std::int64_t pq = 0, pk = 0;
        for (const attention_piece& p : c.pieces) {
          seq_q.push_back(static_cast<std::int32_t>(p.q_count));
          seq_kv.push_back(static_cast<std::int32_t>(p.kv_count));
          q_off.push_back(p.q_begin * qh * d), kv_off.push_back(p.kv_begin * kvh * d);
          v_off.push_back(p.kv_begin * kvh * dv), o_in_off.push_back(p.q_begin * qh * dv);
          const std::int64_t at = backward ? p.q_begin : pq;
          // The backward's "O" offsets are dQ's (`dq_offset`): q's width.
          o_off.push_back(at * qh * (backward ? d : dv)), stats_off.push_back(at * qh),
              dkv_off.push_back(pk * kvh * d), dv_off.push_back(pk * kvh * dv);
          pq += p.q_count, pk += p.kv_count;
        }
        q_off.push_back(q_tokens * qh * d), kv_off.push_back(kv_off.back());
        v_off.push_back(v_off.back()), o_in_off.push_back(q_tokens * qh * dv);
        const std::int64_t end = backward ? q_tokens : pq;
        o_off.push_back(end * qh * (backward ? d : dv)), stats_off.push_back(end * qh),
            dkv_off.push_back(pk * kvh * d), dv_off.push_back(pk * kvh * dv);
        k.seq_q = put32(seq_q), k.seq_kv = put32(seq_kv);
        k.q_off = put64(q_off), k.kv_off = put64(kv_off), k.o_off = put64(o_off);
        k.stats_off = put64(stats_off), k.dkv_off = put64(dkv_off);
        k.v_off = put64(v_off), k.o_in_off = put64(o_in_off), k.dv_off = put64(dv_off);
      } else {
        s.s_q = p0.q_count, s.s_kv = p0.kv_count;
      }
      k.graph = sdpa_graph_for(s);
      if (backward) refuse_oversized(*k.graph);
      const row_reduction rq = backward ? in_place_reduction_of(c) : reduction_of(c, false);
      k.q_reduce = {put32(rq.dest),
                    put32(rq.first),
                    put32(rq.source),
                    static_cast<std::int64_t>(rq.dest.size()),
                    {}};
      if (backward) {
        const row_reduction rk = reduction_of(c, true);
        k.kv_reduce = {put32(rk.dest),
                       put32(rk.first),
                       put32(rk.source),
                       static_cast<std::int64_t>(rk.dest.size()),
                       {}};
        // Stats rows: the packed call's at the shard's rows (every row gathered), the dense
        // call's its piece's rows.
        std::vector<std::int32_t> rows = packed_query_rows(c);
        if (k.packed) {
          rows.resize(static_cast<std::size_t>(q_tokens));
          for (std::size_t r = 0; r < rows.size(); ++r)
            rows[r] = static_cast<std::int32_t>(r);
        }
        k.stats_rows = static_cast<std::int64_t>(rows.size());
        k.rows = put32(rows);
      }
      calls_.push_back(k);
    }
    tables_ = device_tables(std::span<const std::int64_t>(i64), std::span<const std::int32_t>(i32));
    for (call& k : calls_)
      k.bind(tables_);
  }

  //! Scratch of one call at a time: cuDNN's workspace, then the packed outputs.
  std::size_t scratch_bytes() const {
    std::size_t most = 0;
    for (const call& k : calls_)
      most = std::max(most, layout(k).total);
    return most;
  }

#if defined(__CUDACC__)
  template <class T>
  void forward(step_epilogue e, const block_forward_args<T>& a, thd_view<T> out, float* lse,
               cudaStream_t stream) const {
    if (e == step_epilogue::none) return;
    const attention_state& st = a.state;
    const std::int64_t qh = args_.q_heads;
    if (e == step_epilogue::plain && calls_.size() == 1 && calls_[0].whole && out.dense()) {
      const call& k = calls_[0];
      float* sum_exp = reinterpret_cast<float*>(a.scratch + layout(k).sum_exp);
      run_forward(k, a, out.data, lse, sum_exp, a.scratch, stream);
      lse_of_row_maxima(lse, sum_exp, k.q_rows, static_cast<int>(qh), false, st.max_logit, stream);
      return;
    }
    if (e == step_epilogue::plain || e == step_epilogue::fresh) reset(st, stream);
    for (const call& k : calls_) {
      const scratch_layout l = layout(k);
      T* o = reinterpret_cast<T*>(a.scratch + l.first);
      float* stats = reinterpret_cast<float*>(a.scratch + l.stats);
      float* sum_exp = reinterpret_cast<float*>(a.scratch + l.sum_exp);
      run_forward(k, a, o, stats, sum_exp, a.scratch, stream);
      lse_of_row_maxima(stats, sum_exp, k.q_rows, static_cast<int>(qh), k.packed, st.max_logit,
                        stream);
      merge_rows<T>(o, stats, k.packed ? qh : 1, k.packed ? 1 : k.q_rows, k.q_reduce.bound, st,
                    stream);
    }
    if (e == step_epilogue::plain || e == step_epilogue::merge_out) finalize(st, out, stream);
  }

  template <class T>
  void backward(const block_backward_args<T>& a, cudaStream_t stream) const {
    const std::int64_t qh = args_.q_heads, kvh = args_.kv_heads, d = args_.qk_dim(),
                       dvw = args_.v_dim();
    const bool widths = dvw != d;
    for (const call& k : calls_) {
      const scratch_layout l = layout(k);
      std::byte* s = a.scratch;
      // dQ at the shard's rows (what the reduction's rows count from); a dense call's cuDNN
      // output starts at its piece's first row.
      T* dq_rows = reinterpret_cast<T*>(s + l.first);
      T* dq = dq_rows + (k.packed ? 0 : k.q_begin * qh * d);
      T* dk = reinterpret_cast<T*>(s + l.second);
      T* dv = reinterpret_cast<T*>(s + l.third);
      float* stats = reinterpret_cast<float*>(s + l.stats);
      gather_lse(a.lse, q_tokens_, args_.q_heads, k.rows_ptr, k.stats_rows, stats,
                 k.packed ? qh : 1, k.packed ? 1 : k.q_rows, stream);
      const std::int64_t qo = k.packed ? 0 : k.q_begin * qh * d;
      const std::int64_t ko = k.packed ? 0 : k.kv_begin * kvh * d;
      const std::int64_t oo = k.packed ? 0 : k.q_begin * qh * dvw;
      const std::int64_t vo = k.packed ? 0 : k.kv_begin * kvh * dvw;
      void* q = const_cast<T*>(a.q.data + qo);
      void* kk = const_cast<T*>(a.k.data + ko);
      void* v = const_cast<T*>(a.v.data + vo);
      void* o = const_cast<T*>(a.out.data + oo);
      void* dout = const_cast<T*>(a.dout.data + oo);
      if (k.packed) {
        // In uid order (graphs.cuh); separate widths add V's, O/dO's and dV's offsets.
        void* ptrs[] = {q,          kk,
                        v,          o,
                        stats,      k.p_seq_q,
                        k.p_seq_kv, k.p_q_off,
                        k.p_kv_off, k.p_stats_off,
                        dout,       dq,
                        dk,         dv,
                        k.p_o_off,  k.p_dkv_off,
                        k.p_v_off,  k.p_o_in_off,
                        k.p_dv_off};
        run_sdpa(*k.graph, stream, ptrs, widths ? 19 : 16, s);
      } else {
        void* ptrs[] = {q, kk, v, o, stats, dout, dq, dk, dv};
        run_sdpa(*k.graph, stream, ptrs, 9, s);
      }
      add_rows<T>(a.grad.dq, dq_rows, qh * d, k.q_reduce.bound, stream);
      add_rows<T>(a.grad.dk, dk, kvh * d, k.kv_reduce.bound, stream);
      add_rows<T>(a.grad.dv, dv, kvh * dvw, k.kv_reduce.bound, stream);
    }
  }

  //! One dense piece over every query and key: cuDNN's gradients straight into dense dq, dk, dv
  //! (k and v dense too); false, with nothing enqueued, otherwise.
  template <class T>
  bool backward_whole(const block_backward_args<T>& a, thd_view<T> dq, thd_view<T> dk,
                      thd_view<T> dv, cudaStream_t stream) const {
    if (calls_.size() != 1 || !calls_[0].whole_kv) return false;
    if (!(a.k.dense() && a.v.dense() && dq.dense() && dk.dense() && dv.dense())) return false;
    void* ptrs[] = {const_cast<T*>(a.q.data),
                    const_cast<T*>(a.k.data),
                    const_cast<T*>(a.v.data),
                    const_cast<T*>(a.out.data),
                    const_cast<float*>(a.lse),
                    const_cast<T*>(a.dout.data),
                    dq.data,
                    dk.data,
                    dv.data};
    run_sdpa(*calls_[0].graph, stream, ptrs, 9, a.scratch);
    return true;
  }
#endif

private:
  // cuDNN's deterministic backward keeps dP in its workspace (query rows x key rows x query heads
  // x 2 bytes): a call whose workspace exceeds the device's memory is refused here, at plan time.
  static void refuse_oversized(const sdpa_graph& g) {
    std::size_t free = 0, total = 0;
    RINGATTN_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    if (static_cast<std::size_t>(g.workspace) <= total) return;
    std::ostringstream m;
    m.setf(std::ios::fixed);
    m.precision(1);
    m << "ringattn: cuDNN's " << (g.shape.deterministic ? "deterministic " : "")
      << "backward of the " << g.shape.describe() << " needs "
      << static_cast<double>(g.workspace) / (1 << 30) << " GiB of workspace"
      << (g.shape.deterministic ? " (query rows x key rows x query heads x 2 bytes)" : "")
      << ", more than the device's " << static_cast<double>(total) / (1 << 30)
      << " GiB: use more ranks (smaller blocks)"
      << (g.shape.deterministic ? ", ringattn::cudnn_atomic" : "") << " or the native kernels";
    throw invalid_argument(m.str());
  }
  struct reduce_at {
    std::size_t dest = 0, first = 0, source = 0;
    std::int64_t entries = 0;
    device_row_reduction bound; // the tables' device pointers, set by bind()
  };
  struct call {
    std::shared_ptr<const sdpa_graph> graph;
    bool packed = false, whole = false, whole_kv = false;
    std::int64_t batch = 1, q_rows = 0, kv_rows = 0, q_begin = 0, kv_begin = 0, stats_rows = 0;
    std::size_t seq_q = 0, seq_kv = 0, q_off = 0, kv_off = 0, o_off = 0, stats_off = 0, dkv_off = 0,
                v_off = 0, o_in_off = 0, dv_off = 0, rows = 0;
    reduce_at q_reduce, kv_reduce;
    void *p_seq_q = nullptr, *p_seq_kv = nullptr, *p_q_off = nullptr, *p_kv_off = nullptr,
         *p_o_off = nullptr, *p_stats_off = nullptr, *p_dkv_off = nullptr, *p_v_off = nullptr,
         *p_o_in_off = nullptr, *p_dv_off = nullptr;
    const std::int32_t* rows_ptr = nullptr;
    void bind(const device_tables& t) {
      std::int64_t* w = t.at<std::int64_t>(0);
      std::int32_t* n = t.at<std::int32_t>(1);
      if (packed) {
        p_seq_q = n + seq_q, p_seq_kv = n + seq_kv, p_q_off = w + q_off, p_kv_off = w + kv_off;
        p_o_off = w + o_off, p_stats_off = w + stats_off, p_dkv_off = w + dkv_off;
        p_v_off = w + v_off, p_o_in_off = w + o_in_off, p_dv_off = w + dv_off;
      }
      rows_ptr = n + rows;
      for (reduce_at* r : {&q_reduce, &kv_reduce})
        r->bound = {n + r->dest, n + r->first, n + r->source, r->entries};
    }
  };
  struct scratch_layout {
    std::size_t first = 0, second = 0, third = 0, stats = 0, sum_exp = 0, total = 0;
  };
  scratch_layout layout(const call& k) const {
    const std::size_t qh = static_cast<std::size_t>(args_.q_heads),
                      kvh = static_cast<std::size_t>(args_.kv_heads);
    const std::size_t row = qh * static_cast<std::size_t>(args_.qk_dim()) * elem_;
    const std::size_t o_row = qh * static_cast<std::size_t>(args_.v_dim()) * elem_;
    const std::size_t kv_row = kvh * static_cast<std::size_t>(args_.qk_dim()) * elem_;
    const std::size_t v_row = kvh * static_cast<std::size_t>(args_.v_dim()) * elem_;
    const auto q_rows = static_cast<std::size_t>(k.q_rows);
    const auto kv_rows = static_cast<std::size_t>(k.kv_rows);
    scratch_layout l;
    l.first = align256(static_cast<std::size_t>(k.graph->workspace));
    if (backward_) {
      // dQ at the shard's rows; the stats of every shard row (packed) or of the piece's (dense)
      const auto q_tokens = static_cast<std::size_t>(q_tokens_);
      l.second = l.first + align256(q_tokens * row);
      l.third = l.second + align256(kv_rows * kv_row);
      l.stats = l.third + align256(kv_rows * v_row);
      l.total = l.stats + align256(static_cast<std::size_t>(k.stats_rows) * qh * sizeof(float));
    } else {
      // O, then each row's maximum (turned into its LSE in place) and sum of exponentials
      l.stats = l.first + align256(q_rows * o_row);
      l.sum_exp = l.stats + align256(q_rows * qh * sizeof(float));
      l.total = l.sum_exp + align256(q_rows * qh * sizeof(float));
    }
    return l;
  }
  template <class T>
  void run_forward(const call& k, const block_forward_args<T>& a, T* o, float* row_max,
                   float* sum_exp, std::byte* workspace, cudaStream_t stream) const {
    const std::int64_t qh = args_.q_heads, kvh = args_.kv_heads, d = args_.qk_dim(),
                       dv = args_.v_dim();
    const std::int64_t qo = k.packed ? 0 : k.q_begin * qh * d;
    const std::int64_t ko = k.packed ? 0 : k.kv_begin * kvh * d;
    const std::int64_t vo = k.packed ? 0 : k.kv_begin * kvh * dv;
    void* q = const_cast<T*>(a.q.data + qo);
    void* kk = const_cast<T*>(a.k.data + ko);
    void* v = const_cast<T*>(a.v.data + vo);
    if (k.packed) {
      // In uid order (graphs.cuh); separate widths add V's offsets.
      if (dv != d) {
        void* ptrs[] = {q,          kk,        v,          o,         k.p_seq_q,
                        k.p_seq_kv, k.p_q_off, k.p_kv_off, k.p_o_off, k.p_stats_off,
                        k.p_v_off,  row_max,   sum_exp};
        run_sdpa(*k.graph, stream, ptrs, 13, workspace);
      } else {
        void* ptrs[] = {q,          kk,        v,          o,         k.p_seq_q,
                        k.p_seq_kv, k.p_q_off, k.p_kv_off, k.p_o_off, k.p_stats_off,
                        row_max,    sum_exp};
        run_sdpa(*k.graph, stream, ptrs, 12, workspace);
      }
    } else {
      void* ptrs[] = {q, kk, v, o, row_max, sum_exp};
      run_sdpa(*k.graph, stream, ptrs, 6, workspace);
    }
  }

  bool backward_ = false;
  std::size_t elem_ = 2; // fp16 and bf16
  std::int64_t q_tokens_ = 0;
  attention_arguments args_;
  std::vector<call> calls_;
  device_tables tables_;
};

} // namespace detail

//! The cuDNN backward's algorithm: deterministic (bit for bit repeatable; on sm_90 its workspace
//! holds dP, query rows x key rows x query heads x 2 bytes per call).
struct cudnn_deterministic {
  static constexpr bool deterministic = true;
  static constexpr const char* name = "deterministic";
};
//! The cuDNN backward's algorithm: dQ accumulated with atomics (PyTorch's default; workspace
//! linear in the rows; dQ not bitwise repeatable).
struct cudnn_atomic {
  static constexpr bool deterministic = false;
  static constexpr const char* name = "atomic";
};
//! A cuDNN backward algorithm says whether it is deterministic and names itself.
template <class A>
concept cudnn_backward_algorithm = requires {
  { A::deterministic } -> std::convertible_to<bool>;
  { A::name } -> std::convertible_to<const char*>;
};

//! The cuDNN-backed BlockKernel under `Mask` for element type `T` (`__half` or
//! `__nv_bfloat16`), its backward running `Algorithm`.
template <class Mask, class T, class Algorithm = cudnn_deterministic>
struct cudnn_kernel : host_reference<Mask> {
  static_assert(device_element<T>,
                "ringattn::cudnn_kernel<Mask, T, Algorithm>: T must be __half or __nv_bfloat16");
  static_assert(cudnn_backward_algorithm<Algorithm>,
                "ringattn::cudnn_kernel<Mask, T, Algorithm>: Algorithm must be "
                "ringattn::cudnn_deterministic or ringattn::cudnn_atomic");
  using element_type = T;
  using backward_algorithm = Algorithm;
  //! `prepare_device` plans the backward with the forward: cuDNN builds nothing during a call.
  static constexpr bool plans_backward_at_prepare = true;
  using forward_schedule = detail::cudnn_step;
  using backward_schedule = detail::cudnn_step;
  static forward_schedule make_forward_schedule(std::span<const block_group> groups,
                                                std::int64_t q_tokens, std::int64_t kv_tokens,
                                                const attention_arguments& args) {
    return {false, Algorithm::deterministic, dtype_of_v<T>, groups, q_tokens, kv_tokens, args};
  }
  static backward_schedule make_backward_schedule(std::span<const block_group> groups,
                                                  std::int64_t q_tokens, std::int64_t kv_tokens,
                                                  const attention_arguments& args) {
    return {true, Algorithm::deterministic, dtype_of_v<T>, groups, q_tokens, kv_tokens, args};
  }

  //! What the device path needs of the views beyond the ring's own checks.
  template <class U>
  static void check_forward_views(validation& ok, const thd_view<const U>& q,
                                  const thd_view<const U>& k, const thd_view<const U>& v) {
    ok.require(std::is_same_v<U, T>, "this cudnn_kernel is planned for ", to_string(dtype_of_v<T>),
               " but the call passes ", to_string(dtype_of_v<U>));
    ok.require(q.dense() && k.dense() && v.dense(),
               "the cuDNN block kernel needs dense q, k and v ([tokens, heads, head_dim], no "
               "gaps)");
  }
  template <class U>
  static void check_backward_views(validation& ok, const thd_view<const U>& q,
                                   const thd_view<const U>& out, const thd_view<const U>& dout) {
    ok.require(std::is_same_v<U, T>, "this cudnn_kernel is planned for ", to_string(dtype_of_v<T>),
               " but the call passes ", to_string(dtype_of_v<U>));
    ok.require(q.dense() && out.dense() && dout.dense(),
               "the cuDNN block kernel needs dense q, out and dout ([tokens, heads, head_dim], no "
               "gaps)");
  }

  template <class U>
  static void device_forward(step_epilogue e, const block_forward_args<U>& a,
                             const forward_schedule& s, thd_view<U> out, float* lse,
                             cudaStream_t stream) {
#if defined(__CUDACC__)
    static_assert(std::is_same_v<U, T>, "ringattn::cudnn_kernel<Mask, T>: called with another "
                                        "element type than the T it was planned for");
    s.forward<U>(e, a, out, lse, stream);
#else
    static_assert(detail::dependent_false<U>,
                  "ringattn: the cuDNN block kernel's device path compiles only as CUDA");
    (void)e, (void)a, (void)s, (void)out, (void)lse, (void)stream;
#endif
  }
  template <class U>
  static void device_backward(const block_backward_args<U>& a, const backward_schedule& s,
                              cudaStream_t stream) {
#if defined(__CUDACC__)
    static_assert(std::is_same_v<U, T>, "ringattn::cudnn_kernel<Mask, T>: called with another "
                                        "element type than the T it was planned for");
    s.backward<U>(a, stream);
#else
    static_assert(detail::dependent_false<U>,
                  "ringattn: the cuDNN block kernel's device path compiles only as CUDA");
    (void)a, (void)s, (void)stream;
#endif
  }
  //! A one-rank ring: cuDNN writes dq, dk and dv directly where the block is one dense piece
  //! over every query and key (see `whole_block_backward_for`).
  template <class U>
  static bool device_backward_whole(const block_backward_args<U>& a, const backward_schedule& s,
                                    thd_view<U> dq, thd_view<U> dk, thd_view<U> dv,
                                    cudaStream_t stream) {
#if defined(__CUDACC__)
    static_assert(std::is_same_v<U, T>, "ringattn::cudnn_kernel<Mask, T>: called with another "
                                        "element type than the T it was planned for");
    return s.backward_whole<U>(a, dq, dk, dv, stream);
#else
    static_assert(detail::dependent_false<U>,
                  "ringattn: the cuDNN block kernel's device path compiles only as CUDA");
    (void)a, (void)s, (void)dq, (void)dk, (void)dv, (void)stream;
    return false;
#endif
  }
};

//! cuDNN under a full mask, bf16.
using cudnn_full = cudnn_kernel<full_mask, __nv_bfloat16>;
//! cuDNN under a causal mask, bf16.
using cudnn_causal = cudnn_kernel<causal_mask, __nv_bfloat16>;

} // namespace ringattn
