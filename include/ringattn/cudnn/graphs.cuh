#pragma once
//! \file
//! cuDNN's fused attention (SDPA) as the cuDNN block kernel uses it: a handle, the forward and
//! backward graphs of one call shape, built and planned once and kept in a process-wide cache
//! shared by every functor of that shape on a device.
//!
//! The forward gives O and, per row, the largest logit and the sum of exponentials (from which the
//! caller makes the LSE and the max logit); the backward reads the LSE as cuDNN's stats.
//!
//! Two layouts. *Dense*: one piece, `[1, heads, rows, width]` at a pointer offset, no mask
//! beyond the piece's own (per-row values `[heads, rows]`, the library's lse layout). *Packed*: B
//! pieces under a padding mask with per-piece lengths and ragged offsets (element offsets, int64):
//! inputs at their rows in the shard and the block, outputs packed one piece after another, per-row
//! values token-major `[rows, heads]`. Needs the cudnn-frontend headers and cuDNN 9
//! (`ringattn::cudnn`).

#include <ringattn/block/device/pieces.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/error.cuh>

#include <cstring> // before cudnn-frontend, whose shim uses std::strlen without including it
#include <cuda_runtime_api.h>
#include <cudnn.h>
#include <cudnn_frontend.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>

namespace ringattn::detail {

namespace fe = cudnn_frontend;

//! A cuDNN status as an exception naming the call.
inline void check_cudnn(cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS)
    throw error(std::string("ringattn: ") + what + " failed: " + cudnnGetErrorString(s));
}

//! A cuDNN handle on the device current at construction.
class cudnn_handle {
public:
  cudnn_handle() { check_cudnn(cudnnCreate(&h_), "cudnnCreate"); }
  ~cudnn_handle() {
    if (h_) cudnnDestroy(h_);
  }
  cudnn_handle(const cudnn_handle&) = delete;
  cudnn_handle& operator=(const cudnn_handle&) = delete;
  cudnnHandle_t get() const noexcept { return h_; }

private:
  cudnnHandle_t h_ = nullptr;
};

//! What fixes one graph: direction, element type, layout, mask, dimensions, heads and scale.
struct sdpa_shape {
  bool backward = false;
  dtype type = dtype::bf16;
  bool packed = false; //!< ragged pieces under a padding mask
  piece_mask mask = piece_mask::full;
  //! A `band` mask's bounds (attention_piece::lo, hi; 0 for the other masks).
  std::int64_t band_lo = 0, band_hi = 0;
  std::int64_t batch = 1, s_q = 0, s_kv = 0; //!< packed: padded maxima
  std::int64_t total_q = 0, total_kv = 0;    //!< packed: the packed rows (workspace bounds)
  int q_heads = 0, kv_heads = 0, head_dim = 0;
  int head_dim_v = 0; //!< v, O, dO, dV (head_dim_v != head_dim: more ragged offsets)
  float scale = 0.0f;
  bool deterministic = false;
  int device = 0;

  auto tie() const {
    std::uint32_t scale_bits = 0;
    std::memcpy(&scale_bits, &scale, sizeof scale_bits);
    return std::tuple(backward, static_cast<int>(type), packed, static_cast<int>(mask), band_lo,
                      band_hi, batch, s_q, s_kv, total_q, total_kv, q_heads, kv_heads, head_dim,
                      head_dim_v, scale_bits, deterministic, device);
  }
  friend bool operator<(const sdpa_shape& a, const sdpa_shape& b) { return a.tie() < b.tie(); }

  std::string describe() const {
    std::ostringstream s;
    s << (backward ? "backward" : "forward") << ' ' << to_string(type) << ", "
      << (packed ? "packed, " : "") << batch << " x [" << s_q << " queries, " << s_kv << " keys], "
      << q_heads << '/' << kv_heads << " heads, head_dim " << head_dim;
    if (head_dim_v != head_dim) s << " (v " << head_dim_v << ")";
    s << ", " << to_string(mask) << " mask";
    if (mask == piece_mask::band) {
      s << " [";
      if (band_lo > -unbounded) s << band_lo;
      s << ", ";
      if (band_hi < unbounded) s << band_hi;
      s << ']';
    }
    return s.str();
  }
};

//! Tensor uids; a call passes its pointers in this order (the graph's user tensors, sorted).
namespace sdpa_uid {
enum : std::int64_t {
  q = 1,
  k,
  v,
  o,
  stats,
  seq_q,
  seq_kv,
  q_offset,
  kv_offset,
  o_packed_offset,
  stats_offset,
  dout,
  dq,
  dk,
  dv,
  dq_offset,
  dkv_offset,
  // Separate widths only: V's, the backward's O and dO's, and dV's ragged offsets.
  v_offset,
  o_in_offset,
  dv_offset,
  // The forward's per-row outputs: each row's largest logit and its sum of exponentials.
  row_max,
  sum_exp
};
}

//! One built graph, the workspace its plan needs, and the handle it was planned with: every
//! execution goes through that handle (cuDNN may enqueue its own work, such as zeroing an
//! accumulator, on the stream of the handle a plan belongs to), one caller at a time.
struct sdpa_graph {
  std::shared_ptr<fe::graph::Graph> graph;
  std::int64_t workspace = 0;
  sdpa_shape shape;
  std::unique_ptr<cudnn_handle> handle;
  mutable std::mutex run; //!< held from cudnnSetStream to the end of the enqueue
};

inline std::shared_ptr<fe::graph::Graph> make_sdpa_graph(const sdpa_shape& s) {
  using fe::graph::Tensor_attributes;
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(s.type == dtype::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const std::int64_t b = s.batch, qh = s.q_heads, kvh = s.kv_heads, d = s.head_dim,
                     dw = s.head_dim_v != 0 ? s.head_dim_v : s.head_dim; // v's width
  const bool widths = dw != d; // V, O, dO, dV with ragged offsets of their own
  // Token-major rows: [b, h, s, w] with strides (s * h * w, w, h * w, 1).
  auto rows = [&](const char* name, std::int64_t uid, std::int64_t heads, std::int64_t len,
                  std::int64_t w) {
    return g->tensor(Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({b, heads, len, w})
                         .set_stride({len * heads * w, w, heads * w, 1}));
  };
  auto index = [&](const char* name, std::int64_t uid, std::int64_t n, fe::DataType_t t) {
    return g->tensor(Tensor_attributes()
                         .set_name(name)
                         .set_uid(uid)
                         .set_dim({n, 1, 1, 1})
                         .set_stride({1, 1, 1, 1})
                         .set_data_type(t));
  };
  auto q = rows("Q", sdpa_uid::q, qh, s.s_q, d);
  auto k = rows("K", sdpa_uid::k, kvh, s.s_kv, d);
  auto v = rows("V", sdpa_uid::v, kvh, s.s_kv, dw);
  std::shared_ptr<Tensor_attributes> seq_q, seq_kv, q_off, kv_off;
  if (s.packed) {
    seq_q = index("seq_q", sdpa_uid::seq_q, b, fe::DataType_t::INT32);
    seq_kv = index("seq_kv", sdpa_uid::seq_kv, b, fe::DataType_t::INT32);
    q_off = index("q_offset", sdpa_uid::q_offset, b + 1, fe::DataType_t::INT64);
    kv_off = index("kv_offset", sdpa_uid::kv_offset, b + 1, fe::DataType_t::INT64);
    q->set_ragged_offset(q_off);
    k->set_ragged_offset(kv_off);
    v->set_ragged_offset(
        widths ? index("v_offset", sdpa_uid::v_offset, b + 1, fe::DataType_t::INT64) : kv_off);
  }
  const std::vector<std::int64_t> stats_dim{b, qh, s.s_q, 1};
  const std::vector<std::int64_t> stats_stride =
      s.packed ? std::vector<std::int64_t>{s.s_q * qh, 1, qh, 1}
               : std::vector<std::int64_t>{qh * s.s_q, s.s_q, 1, 1};
  const bool top_left = !s.packed && s.s_q == s.s_kv; // the plain causal case, as in PyTorch
  auto mask = [&](auto& a) {
    if (s.mask == piece_mask::causal_bottom_right) {
      if (top_left)
        a.set_causal_mask(true);
      else
        a.set_causal_mask_bottom_right(true);
    }
    if (s.mask == piece_mask::band) {
      // Top-left diagonal band: row i sees keys j with 1 - left <= j - i <= right. A band
      // piece's lo <= 0 <= hi, so left >= 1 and right >= 0; an unbounded right side is the
      // widest band the keys allow.
      a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT);
      if (s.band_lo > -unbounded) a.set_diagonal_band_left_bound(static_cast<int>(1 - s.band_lo));
      a.set_diagonal_band_right_bound(static_cast<int>(s.band_hi < unbounded ? s.band_hi : s.s_kv));
    }
    if (s.packed) a.set_padding_mask(true).set_seq_len_q(seq_q).set_seq_len_kv(seq_kv);
  };
  if (!s.backward) {
    // Each row's largest logit and its sum of exponentials against it, fp32 in the stats layout,
    // in place of the stats (the LSE is max + log(sum); the largest logit is what the max logit
    // asks for). cuDNN below 9.21 gives the maximum only with the sum, and then no stats.
    auto per_row = [&](const char* name, std::int64_t uid) {
      return g->tensor(Tensor_attributes()
                           .set_name(name)
                           .set_uid(uid)
                           .set_dim(stats_dim)
                           .set_stride(stats_stride)
                           .set_data_type(fe::DataType_t::FLOAT));
    };
    auto row_max = per_row("row_max", sdpa_uid::row_max);
    auto sum_exp = per_row("sum_exp", sdpa_uid::sum_exp);
    auto a = fe::graph::SDPA_attributes()
                 .set_name("sdpa")
                 .set_generate_stats(false)
                 .set_attn_scale(s.scale)
                 .set_logit_max(row_max)
                 .set_score_sum_exp(sum_exp);
    mask(a);
    auto o = g->sdpa(q, k, v, a)[0];
    o->set_output(true)
        .set_uid(sdpa_uid::o)
        .set_dim({b, qh, s.s_q, dw})
        .set_stride({s.s_q * qh * dw, dw, qh * dw, 1});
    row_max->set_output(true);
    sum_exp->set_output(true);
    if (s.packed) {
      o->set_ragged_offset(
          index("o_offset", sdpa_uid::o_packed_offset, b + 1, fe::DataType_t::INT64));
      auto offset = index("stats_offset", sdpa_uid::stats_offset, b + 1, fe::DataType_t::INT64);
      row_max->set_ragged_offset(offset);
      sum_exp->set_ragged_offset(offset);
    }
    return g;
  }
  auto o = rows("O", sdpa_uid::o, qh, s.s_q, dw);
  auto stats = g->tensor(Tensor_attributes()
                             .set_name("stats")
                             .set_uid(sdpa_uid::stats)
                             .set_dim(stats_dim)
                             .set_stride(stats_stride)
                             .set_data_type(fe::DataType_t::FLOAT));
  auto dout = rows("dO", sdpa_uid::dout, qh, s.s_q, dw);
  auto a = fe::graph::SDPA_backward_attributes().set_name("sdpa_backward").set_attn_scale(s.scale);
  mask(a);
  if (s.deterministic) a.set_deterministic_algorithm(true);
  std::shared_ptr<Tensor_attributes> dq_off, dkv_off;
  if (s.packed) {
    const auto o_in =
        widths ? index("o_in_offset", sdpa_uid::o_in_offset, b + 1, fe::DataType_t::INT64) : q_off;
    o->set_ragged_offset(o_in);
    dout->set_ragged_offset(o_in);
    stats->set_ragged_offset(
        index("stats_offset", sdpa_uid::stats_offset, b + 1, fe::DataType_t::INT64));
    dq_off = index("dq_offset", sdpa_uid::dq_offset, b + 1, fe::DataType_t::INT64);
    dkv_off = index("dkv_offset", sdpa_uid::dkv_offset, b + 1, fe::DataType_t::INT64);
    a.set_max_total_seq_len_q(s.total_q).set_max_total_seq_len_kv(s.total_kv);
  }
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, a);
  dq->set_output(true)
      .set_uid(sdpa_uid::dq)
      .set_dim({b, qh, s.s_q, d})
      .set_stride({s.s_q * qh * d, d, qh * d, 1});
  dk->set_output(true)
      .set_uid(sdpa_uid::dk)
      .set_dim({b, kvh, s.s_kv, d})
      .set_stride({s.s_kv * kvh * d, d, kvh * d, 1});
  dv->set_output(true)
      .set_uid(sdpa_uid::dv)
      .set_dim({b, kvh, s.s_kv, dw})
      .set_stride({s.s_kv * kvh * dw, dw, kvh * dw, 1});
  if (s.packed) {
    dq->set_ragged_offset(dq_off);
    dk->set_ragged_offset(dkv_off);
    dv->set_ragged_offset(
        widths ? index("dv_offset", sdpa_uid::dv_offset, b + 1, fe::DataType_t::INT64) : dkv_off);
  }
  return g;
}

//! The graph of `shape`, built and planned on first use (on the current device, which is
//! `shape.device`, with a handle of its own), then shared. Throws `invalid_argument` naming the
//! shape and cuDNN's reason where cuDNN cannot run it.
inline std::shared_ptr<const sdpa_graph> sdpa_graph_for(const sdpa_shape& shape) {
  // Never destroyed: the graphs' handles would otherwise be destroyed during static destruction,
  // after the CUDA runtime may have shut down.
  static std::mutex& mutex = *new std::mutex;
  static auto& cache = *new std::map<sdpa_shape, std::shared_ptr<const sdpa_graph>>;
  std::lock_guard lock(mutex);
  if (auto it = cache.find(shape); it != cache.end()) return it->second;
  auto made = std::make_shared<sdpa_graph>();
  made->shape = shape;
  made->handle = std::make_unique<cudnn_handle>();
  made->graph = make_sdpa_graph(shape);
  fe::error_t built =
      made->graph->build(made->handle->get(), {fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK});
  if (!built.is_good())
    throw invalid_argument("ringattn: cuDNN cannot run the " + shape.describe() + ": " +
                           built.get_message());
  fe::error_t ws = made->graph->get_workspace_size(made->workspace);
  if (!ws.is_good())
    throw error("ringattn: cuDNN's workspace size of the " + shape.describe() + ": " +
                ws.get_message());
  cache.emplace(shape, made);
  return made;
}

//! Enqueues a built graph on `stream` with the user pointers in uid order (through the graph's
//! own handle; callers on other threads wait for the enqueue, not for the device).
inline void run_sdpa(const sdpa_graph& g, cudaStream_t stream, void** ptrs, int n,
                     void* workspace) {
  std::lock_guard lock(g.run);
  check_cudnn(cudnnSetStream(g.handle->get(), stream), "cudnnSetStream");
  fe::error_t e = g.graph->execute(g.handle->get(), ptrs, n, workspace);
  if (!e.is_good())
    throw error("ringattn: cuDNN's " + g.shape.describe() + " failed: " + e.get_message());
}

} // namespace ringattn::detail
