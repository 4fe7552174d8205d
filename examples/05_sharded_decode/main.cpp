// 05_sharded_decode: a context-parallel prefill with the all-gather schedule, then decode steps
// over the KV cache the ranks kept.
//
// P simulated ranks (threads of an in-process group) share a packed batch of three sequences.
// Prefill: each rank holds its partitioner's shard of Q, K, V and runs the causal forward with the
// all-gather schedule (ring_attention<..., all_gather_kv>); afterwards it keeps its K/V shard as
// its part of the KV cache: one slab per sequence with room to grow, or (--cache paged) pages of
// 16 tokens drawn from a pool in a shuffled order, a page table per sequence. Decode: every step
// brings one new token per sequence (the same Q, K, V on every rank, as after a model's
// projections); sharded_attention attends them to every rank's cache and gives every rank the same
// output; then each new token's K/V is appended, in place, to the cache of its owner (position mod
// P; into the sequence's last page, or a fresh one from the pool when that is full). With
// --cache fp8 the pages hold FP8 (e4m3) K/V with a scale per page and kv head, set when the page
// is taken; the prefill's rows and every appended one are quantised into them
// (quantize_into_cache). The prefill's sample rows and every step's outputs are checked against
// the float64 oracle over the whole sequences (as the cache holds them: an FP8 cache's
// dequantised values). Where there is a GPU (and nvcc compiled the example) the ranks run the
// device path, all on one GPU or spread over several; --device cpu forces the host path.
//
//   sharded_decode [--ranks P] [--tokens N] [--steps S] [--partitioner zigzag|round_robin|
//                  contiguous|balanced] [--cache slab|paged|fp8] [--device auto|cpu|gpu]
#include <ringattn/block/device/kv_quantize.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/ring_attention.cuh>
#include <ringattn/ringattn.cuh>
#include <ringattn/sharded_attention.cuh>

#include "../common/example.hpp"

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {
using T = __nv_bfloat16;
constexpr ringattn::attention_arguments args{8, 2, 64, 0.0f};
constexpr int qh = args.q_heads, kvh = args.kv_heads, d = args.head_dim;
constexpr std::size_t q_row = static_cast<std::size_t>(qh) * d,
                      kv_row = static_cast<std::size_t>(kvh) * d;
constexpr std::int32_t page_size = 16; // tokens per page of a paged cache

// A rank's paged cache: a pool of pages handed out from a free list (shuffled, so that a
// sequence's pages are scattered over the pool), and each sequence's page table and length.
struct page_pool {
  std::int32_t pages = 0;
  std::vector<std::int32_t> free;
  std::vector<std::vector<std::int32_t>> table;
  std::vector<std::int32_t> length;
  // The pool row of sequence b's token j.
  std::int64_t row(int b, std::int64_t j) const {
    return std::int64_t{table[b][j / page_size]} * page_size + j % page_size;
  }
  // Room for sequence b's next token: a page from the free list when its last is full.
  void make_room(int b) {
    if (length[b] == static_cast<std::int32_t>(table[b].size()) * page_size) {
      if (free.empty()) throw std::runtime_error("the page pool is exhausted");
      table[b].push_back(free.back());
      free.pop_back();
    }
  }
  // The plan's view: page offsets and the tables one after the other.
  ringattn::paged_cache view(std::vector<std::int32_t>& cu_pages,
                             std::vector<std::int32_t>& flat) const {
    cu_pages.assign(1, 0);
    flat.clear();
    for (const auto& t : table) {
      flat.insert(flat.end(), t.begin(), t.end());
      cu_pages.push_back(static_cast<std::int32_t>(flat.size()));
    }
    return {page_size, pages, cu_pages, flat, length};
  }
};

// Where a rank's buffers live: host vectors, or device memory (copied in and out as needed).
class buffers {
public:
  explicit buffers(bool gpu) : gpu_(gpu) {}
  buffers(const buffers&) = delete;
  buffers& operator=(const buffers&) = delete;
  ~buffers() {
#if defined(__CUDACC__)
    for (void* p : device_)
      cudaFree(p);
#endif
  }
  // `n` bytes, filled from `init` if given.
  void* make(std::size_t n, const void* init = nullptr) {
    if (!gpu_) {
      host_.emplace_back(std::max<std::size_t>(n, 16));
      if (init) std::memcpy(host_.back().data(), init, n);
      return host_.back().data();
    }
#if defined(__CUDACC__)
    void* p = nullptr;
    RINGATTN_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(n, 16)));
    device_.push_back(p);
    if (init) RINGATTN_CUDA_CHECK(cudaMemcpy(p, init, n, cudaMemcpyHostToDevice));
    return p;
#else
    return nullptr;
#endif
  }
  void copy(void* to, const void* from, std::size_t n) const {
    if (n == 0) return;
    if (!gpu_) {
      std::memcpy(to, from, n);
      return;
    }
#if defined(__CUDACC__)
    RINGATTN_CUDA_CHECK(cudaMemcpy(to, from, n, cudaMemcpyDefault));
#endif
  }
  template <class E>
  std::vector<E> read(const E* p, std::size_t n) const {
    std::vector<E> h(n);
    copy(h.data(), p, n * sizeof(E));
    return h;
  }

private:
  bool gpu_;
  std::vector<std::vector<std::byte>> host_;
  std::vector<void*> device_;
};

// What the ranks share: the whole sequences so far (for the oracle) and each step's new tokens.
struct shared_state {
  std::vector<std::int32_t> cu_prefill;
  std::vector<T> q, k, v;                          // the prefill batch
  std::vector<std::vector<T>> seq_q, seq_k, seq_v; // per sequence, every position so far
  // Per sequence, room for every position: the K/V values the caches hold (an FP8 cache's
  // dequantised ones), written by the rank that keeps the position.
  std::vector<std::vector<double>> held_k, held_v;
  std::vector<std::vector<T>> prefill_out; // per rank: its shard's prefill output
  std::vector<std::vector<T>> step_out;    // per rank: this step's decode output
  std::vector<std::vector<float>> step_lse;
  std::vector<std::uint64_t> step_bytes;
};

// The float64 oracle for `rows` of a packed batch of whole sequences (causal).
ringattn::reference::forward_result oracle(const std::vector<std::int32_t>& cu,
                                           const std::vector<T>& q, const std::vector<T>& k,
                                           const std::vector<T>& v,
                                           const std::vector<std::int64_t>& rows) {
  const std::int64_t n = cu.back();
  return ringattn::reference::attention_forward_rows(
      ringattn::reference::to_tensor(ringattn::thd_view<const T>(q.data(), n, qh, d)),
      ringattn::reference::to_tensor(ringattn::thd_view<const T>(k.data(), n, kvh, d)),
      ringattn::reference::to_tensor(ringattn::thd_view<const T>(v.data(), n, kvh, d)), cu, args,
      ringattn::position_window::of(ringattn::mask_kind::causal), rows);
}

// The same over keys and values given as float64 (`k`, `v`: [cu.back(), kv_heads, d]).
ringattn::reference::forward_result oracle(const std::vector<std::int32_t>& cu,
                                           const std::vector<T>& q, std::vector<double> k,
                                           std::vector<double> v,
                                           const std::vector<std::int64_t>& rows) {
  const std::int64_t n = cu.back();
  ringattn::reference::tensor kt(n, kvh, d), vt(n, kvh, d);
  kt.data = std::move(k);
  vt.data = std::move(v);
  return ringattn::reference::attention_forward_rows(
      ringattn::reference::to_tensor(ringattn::thd_view<const T>(q.data(), n, qh, d)), kt, vt, cu,
      args, ringattn::position_window::of(ringattn::mask_kind::causal), rows);
}

// Relative L2 error of `out` ([rows, q_heads, d]) against the oracle's rows.
double error_of(const std::vector<T>& out, const ringattn::reference::forward_result& ref) {
  std::vector<double> got(out.size());
  for (std::size_t i = 0; i < out.size(); ++i)
    got[i] = ringattn::to_float(out[i]);
  return ringattn::reference::relative_error(got, ref.out.data);
}

template <class P>
int run(int ranks, int tokens, int steps, bool gpu, bool paged, bool fp8) {
  shared_state st;
  st.cu_prefill = example::packed_batch(tokens, 3);
  const int batch = static_cast<int>(st.cu_prefill.size()) - 1;
  std::mt19937_64 rng(std::random_device{}());
  st.q = example::random_values<T>(tokens * q_row, rng);
  st.k = example::random_values<T>(tokens * kv_row, rng);
  st.v = example::random_values<T>(tokens * kv_row, rng);
  for (int b = 0; b < batch; ++b) {
    auto part = [&](const std::vector<T>& x, std::size_t row) {
      return std::vector<T>(x.begin() + st.cu_prefill[b] * row,
                            x.begin() + st.cu_prefill[b + 1] * row);
    };
    st.seq_q.push_back(part(st.q, q_row));
    st.seq_k.push_back(part(st.k, kv_row));
    st.seq_v.push_back(part(st.v, kv_row));
    const std::size_t room = (st.seq_k.back().size() / kv_row + steps) * kv_row;
    st.held_k.emplace_back(room);
    st.held_v.emplace_back(room);
  }
  // Every step's new tokens, drawn up front (the same on every rank).
  std::vector<std::int32_t> cu_new{0};
  for (int b = 0; b < batch; ++b)
    cu_new.push_back(b + 1);
  std::vector<std::vector<T>> new_q, new_k, new_v;
  for (int s = 0; s < steps; ++s) {
    new_q.push_back(example::random_values<T>(batch * q_row, rng));
    new_k.push_back(example::random_values<T>(batch * kv_row, rng));
    new_v.push_back(example::random_values<T>(batch * kv_row, rng));
  }
  const ringattn::partition_plan<P> plan(st.cu_prefill, ranks);
  st.prefill_out.resize(ranks);
  st.step_out.resize(ranks);
  st.step_lse.resize(ranks);
  st.step_bytes.resize(ranks);
  std::vector<std::vector<double>> step_errors(steps);
  std::vector<double> unquantised_errors(steps);
  bool same_everywhere = true;
  double prefill_error = 0.0;
  std::barrier sync(ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  ringattn::in_process_group group(ranks);
  auto rank_main = [&](int r) {
    auto comm = group.communicator(r);
#if defined(__CUDACC__)
    int gpus = 0;
    if (gpu) RINGATTN_CUDA_CHECK(cudaGetDeviceCount(&gpus));
    if (gpu) RINGATTN_CUDA_CHECK(cudaSetDevice(r % gpus)); // P virtual ranks per GPU
    cudaStream_t stream = nullptr;
    if (gpu) RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
#endif
    buffers mem(gpu);
    const std::int64_t n = plan.local_tokens(r);
    auto shard = [&](const std::vector<T>& full, std::size_t row, int heads) {
      std::vector<T> s(static_cast<std::size_t>(n) * row);
      ringattn::scatter(plan, r, ringattn::thd_view<const T>(full.data(), tokens, heads, d),
                        ringattn::thd_view<T>(s.data(), n, heads, d));
      return s;
    };
    const auto qs = shard(st.q, q_row, qh), ks = shard(st.k, kv_row, kvh),
               vs = shard(st.v, kv_row, kvh);

    // Prefill: the all-gather schedule over the rank's shards.
    ringattn::ring_attention<P, ringattn::in_process_communicator, ringattn::causal,
                             ringattn::all_gather_kv>
        prefill(comm, args, st.cu_prefill);
    auto* q = static_cast<T*>(mem.make(qs.size() * sizeof(T), qs.data()));
    auto* k = static_cast<T*>(mem.make(ks.size() * sizeof(T), ks.data()));
    auto* v = static_cast<T*>(mem.make(vs.size() * sizeof(T), vs.data()));
    auto* out = static_cast<T*>(mem.make(qs.size() * sizeof(T)));
    auto* lse = static_cast<float*>(mem.make(sizeof(float) * n * qh));
    const ringattn::thd_view<const T> qv(q, n, qh, d), kv(k, n, kvh, d), vv(v, n, kvh, d);
    if (gpu) {
#if defined(__CUDACC__)
      prefill.prepare_device();
      const std::size_t bytes = prefill.template device_workspace_bytes<T>();
      void* ws = mem.make(bytes);
      prefill.forward(qv, kv, vv, ringattn::thd_view<T>(out, n, qh, d), lse, ws, bytes, stream);
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
#endif
    } else {
      const std::size_t bytes = prefill.template host_workspace_bytes<T>();
      auto* ws = static_cast<std::byte*>(mem.make(bytes));
      prefill.forward_host(qv, kv, vv, ringattn::thd_view<T>(out, n, qh, d), lse, {ws, bytes});
    }
    st.prefill_out[r] = mem.read(out, qs.size());

    // The cache: per sequence a slab of the rank's prefill tokens and room for `steps` more, or
    // pages from a pool with room for as many.
    const auto local = plan.local_cu_seqlens(r);
    std::vector<std::int32_t> begin, length;
    std::int32_t capacity = 0;
    for (int b = 0; b < batch; ++b) {
      begin.push_back(capacity);
      length.push_back(local[b + 1] - local[b]);
      capacity +=
          paged ? ((length.back() + steps) / page_size + 1) * page_size : length.back() + steps;
    }
    page_pool pool{capacity / page_size,
                   {},
                   std::vector<std::vector<std::int32_t>>(batch),
                   std::vector<std::int32_t>(batch, 0)};
    for (std::int32_t i = 0; i < pool.pages; ++i)
      pool.free.push_back(i);
    std::shuffle(pool.free.begin(), pool.free.end(), std::mt19937(1234u + r));
    const std::size_t element = fp8 ? sizeof(ringattn::fp8_e4m3) : sizeof(T);
    auto* kc = static_cast<std::byte*>(mem.make(capacity * kv_row * element));
    auto* vc = static_cast<std::byte*>(mem.make(capacity * kv_row * element));
    // An FP8 cache's scales, one per (page, kv head) and K or V: a page's are set when it is
    // taken, from the largest magnitude of the rank's prefill rows of that head (a page the
    // prefill fills: of its own rows), and kept. Host values and their device copy.
    std::vector<float> k_scales(static_cast<std::size_t>(pool.pages) * kvh, 1.0f),
        v_scales = k_scales;
    auto* k_scales_at = static_cast<float*>(mem.make(k_scales.size() * sizeof(float)));
    auto* v_scales_at = static_cast<float*>(mem.make(v_scales.size() * sizeof(float)));
    auto largest = [&](const std::vector<T>& x, std::size_t first, std::size_t rows, int h) {
      float m = 0.0f;
      for (std::size_t i = first; i < first + rows; ++i)
        for (int e = 0; e < d; ++e)
          m = std::max(m, std::abs(ringattn::to_float(x[i * kv_row + h * d + e])));
      return m > 0.0f ? m / 448.0f : 1.0f;
    };
    auto set_scales = [&](std::int64_t page, const std::vector<T>& kr, const std::vector<T>& vr,
                          std::size_t first, std::size_t rows) {
      for (int h = 0; h < kvh; ++h) {
        const auto at = static_cast<std::size_t>(page * kvh + h);
        k_scales[at] = largest(kr, first, rows, h);
        v_scales[at] = largest(vr, first, rows, h);
      }
      mem.copy(k_scales_at + page * kvh, k_scales.data() + page * kvh, kvh * sizeof(float));
      mem.copy(v_scales_at + page * kvh, v_scales.data() + page * kvh, kvh * sizeof(float));
    };
    // `count` rows at `src_k`, `src_v` (this rank's memory) become cache rows `at`.. of sequence
    // b, row i at position `position(i)`: copied, or quantised with their pages' scales; the
    // values the cache now holds are recorded for the oracle.
    auto store = [&](const T* src_k, const T* src_v, std::int64_t at, std::int64_t count, int b,
                     auto position) {
      if (count == 0) return;
      if (!fp8) {
        mem.copy(kc + at * kv_row * element, src_k, count * kv_row * sizeof(T));
        mem.copy(vc + at * kv_row * element, src_v, count * kv_row * sizeof(T));
      } else {
        std::vector<std::int64_t> to(static_cast<std::size_t>(count));
        for (std::int64_t i = 0; i < count; ++i)
          to[static_cast<std::size_t>(i)] = at + i;
        const ringattn::thd_view<ringattn::fp8_e4m3> kd(reinterpret_cast<ringattn::fp8_e4m3*>(kc),
                                                        capacity, kvh, d),
            vd(reinterpret_cast<ringattn::fp8_e4m3*>(vc), capacity, kvh, d);
        const ringattn::thd_view<const T> ks_(src_k, count, kvh, d), vs_(src_v, count, kvh, d);
        const ringattn::page_scales scales{k_scales_at, v_scales_at};
        if (gpu) {
#if defined(__CUDACC__)
          auto* rows_at = static_cast<std::int64_t*>(mem.make(to.size() * 8, to.data()));
          ringattn::quantize_into_cache(ks_, rows_at, kd, scales, true, page_size, stream);
          ringattn::quantize_into_cache(vs_, rows_at, vd, scales, false, page_size, stream);
          RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
#endif
        } else {
          ringattn::quantize_into_cache_host(ks_, to, kd, scales, true, page_size);
          ringattn::quantize_into_cache_host(vs_, to, vd, scales, false, page_size);
        }
      }
      const auto kh = mem.read(kc + at * kv_row * element, count * kv_row * element);
      const auto vh = mem.read(vc + at * kv_row * element, count * kv_row * element);
      for (std::int64_t i = 0; i < count; ++i)
        for (int h = 0; h < kvh; ++h)
          for (int e = 0; e < d; ++e) {
            const std::size_t x = static_cast<std::size_t>(i * kv_row + h * d + e);
            const std::size_t y = static_cast<std::size_t>(position(i) * kv_row + h * d + e);
            if (fp8) {
              const std::size_t sc = static_cast<std::size_t>(((at + i) / page_size) * kvh + h);
              st.held_k[b][y] =
                  ringattn::to_float(reinterpret_cast<const ringattn::fp8_e4m3*>(kh.data())[x]) *
                  k_scales[sc];
              st.held_v[b][y] =
                  ringattn::to_float(reinterpret_cast<const ringattn::fp8_e4m3*>(vh.data())[x]) *
                  v_scales[sc];
            } else {
              st.held_k[b][y] = ringattn::to_float(reinterpret_cast<const T*>(kh.data())[x]);
              st.held_v[b][y] = ringattn::to_float(reinterpret_cast<const T*>(vh.data())[x]);
            }
          }
    };
    // Sequence b's token j of this rank's prefill shard goes to cache row `at`.
    auto keep = [&](int b, std::int64_t j, std::int64_t at, std::int64_t count) {
      store(k + (local[b] + j) * kv_row, v + (local[b] + j) * kv_row, at, count, b,
            [&](std::int64_t i) {
              return plan.global_token(r, local[b] + j + i) - st.cu_prefill[b];
            });
    };
    for (int b = 0; b < batch; ++b) {
      if (!paged) {
        keep(b, 0, begin[b], length[b]);
        continue;
      }
      for (std::int32_t j = 0; j < length[b]; j += page_size) {
        pool.make_room(b);
        const std::int32_t count = std::min(page_size, length[b] - j);
        if (fp8) set_scales(pool.table[b].back(), ks, vs, local[b] + j, count);
        keep(b, j, pool.row(b, j), count);
        pool.length[b] = j + count;
      }
    }
    std::vector<std::int32_t> cu_pages, flat_table;

    // Decode steps.
    ringattn::sharded_attention<ringattn::in_process_communicator, ringattn::causal> decode(comm,
                                                                                            args);
    if (gpu) {
#if defined(__CUDACC__)
      decode.prepare_device();
#endif
    }
    auto* dq = static_cast<T*>(mem.make(batch * q_row * sizeof(T)));
    auto* dk = static_cast<T*>(mem.make(batch * kv_row * sizeof(T)));
    auto* dv = static_cast<T*>(mem.make(batch * kv_row * sizeof(T)));
    auto* dout = static_cast<T*>(mem.make(batch * q_row * sizeof(T)));
    auto* dlse = static_cast<float*>(mem.make(batch * qh * sizeof(float)));
    for (int s = 0; s < steps; ++s) {
      mem.copy(dq, new_q[s].data(), new_q[s].size() * sizeof(T));
      mem.copy(dk, new_k[s].data(), new_k[s].size() * sizeof(T));
      mem.copy(dv, new_v[s].data(), new_v[s].size() * sizeof(T));
      if (paged)
        decode.plan(cu_new, pool.view(cu_pages, flat_table));
      else
        decode.plan(cu_new, begin, length, capacity);
      const ringattn::thd_view<const T> nq(dq, batch, qh, d), nk(dk, batch, kvh, d),
          nv(dv, batch, kvh, d), ck(reinterpret_cast<const T*>(kc), capacity, kvh, d),
          cv(reinterpret_cast<const T*>(vc), capacity, kvh, d);
      const ringattn::thd_view<const ringattn::fp8_e4m3> ck8(
          reinterpret_cast<const ringattn::fp8_e4m3*>(kc), capacity, kvh, d),
          cv8(reinterpret_cast<const ringattn::fp8_e4m3*>(vc), capacity, kvh, d);
      const ringattn::page_scales scales{k_scales_at, v_scales_at};
      const ringattn::thd_view<T> o(dout, batch, qh, d);
      const std::uint64_t before = comm.bytes_sent();
      if (gpu) {
#if defined(__CUDACC__)
        const std::size_t bytes = decode.template device_workspace_bytes<T>();
        void* ws = mem.make(bytes); // a serving loop keeps one of the largest step's size
        if (fp8)
          decode.forward(nq, nk, nv, ck8, cv8, scales, o, dlse, ws, bytes, stream);
        else
          decode.forward(nq, nk, nv, ck, cv, o, dlse, ws, bytes, stream);
        RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
#endif
      } else {
        const std::size_t bytes = decode.template host_workspace_bytes<T>();
        auto* ws = static_cast<std::byte*>(mem.make(bytes));
        if (fp8)
          decode.forward_host(nq, nk, nv, ck8, cv8, scales, o, dlse, {ws, bytes});
        else
          decode.forward_host(nq, nk, nv, ck, cv, o, dlse, {ws, bytes});
      }
      st.step_bytes[r] = comm.bytes_sent() - before;
      st.step_out[r] = mem.read(dout, batch * q_row);
      st.step_lse[r] = mem.read(dlse, static_cast<std::size_t>(batch) * qh);
      // Append each new token's K/V to its owner's cache (position mod P).
      std::vector<std::int64_t> lengths;
      for (int b = 0; b < batch; ++b)
        lengths.push_back(static_cast<std::int64_t>(st.seq_k[b].size() / kv_row));
      sync.arrive_and_wait(); // every rank has read the sequence lengths before rank 0 grows them
      for (const std::int64_t t : ringattn::owned_new_rows(r, ranks, cu_new, lengths)) {
        const auto b = static_cast<int>(t); // one new token per sequence: row t is sequence t
        if (paged) {
          const std::size_t had = pool.table[b].size();
          pool.make_room(b);
          if (fp8 && pool.table[b].size() != had) // a fresh page: the head's prefill scales
            set_scales(pool.table[b].back(), ks, vs, 0, static_cast<std::size_t>(n));
        }
        const std::int64_t at = paged ? pool.row(b, pool.length[b]) : begin[b] + length[b];
        store(dk + t * kv_row, dv + t * kv_row, at, 1, b, [&](std::int64_t) { return lengths[b]; });
        ++(paged ? pool.length[b] : length[b]);
      }
      if (r == 0) {
        // The whole sequences, for the oracle: each new token joins its sequence.
        // The oracle: the cached positions as the caches hold them, the new token as given.
        std::vector<std::int32_t> cu{0};
        std::vector<T> aq, ak, av;
        std::vector<double> hk, hv;
        std::vector<std::int64_t> rows;
        for (int b = 0; b < batch; ++b) {
          const std::size_t cached = st.seq_k[b].size();
          auto grow = [&](std::vector<T>& seq, const std::vector<T>& now, std::size_t row) {
            seq.insert(seq.end(), now.begin() + b * row, now.begin() + (b + 1) * row);
          };
          grow(st.seq_q[b], new_q[s], q_row);
          grow(st.seq_k[b], new_k[s], kv_row);
          grow(st.seq_v[b], new_v[s], kv_row);
          aq.insert(aq.end(), st.seq_q[b].begin(), st.seq_q[b].end());
          ak.insert(ak.end(), st.seq_k[b].begin(), st.seq_k[b].end());
          av.insert(av.end(), st.seq_v[b].begin(), st.seq_v[b].end());
          hk.insert(hk.end(), st.held_k[b].begin(), st.held_k[b].begin() + cached);
          hv.insert(hv.end(), st.held_v[b].begin(), st.held_v[b].begin() + cached);
          for (std::size_t e = cached; e < st.seq_k[b].size(); ++e) {
            hk.push_back(ringattn::to_float(st.seq_k[b][e]));
            hv.push_back(ringattn::to_float(st.seq_v[b][e]));
          }
          cu.push_back(cu.back() + static_cast<std::int32_t>(st.seq_k[b].size() / kv_row));
          rows.push_back(cu.back() - 1); // the new token: the sequence's last position
        }
        for (int other = 0; other < ranks; ++other)
          same_everywhere = same_everywhere &&
                            std::memcmp(st.step_out[other].data(), st.step_out[0].data(),
                                        st.step_out[0].size() * sizeof(T)) == 0 &&
                            std::memcmp(st.step_lse[other].data(), st.step_lse[0].data(),
                                        st.step_lse[0].size() * sizeof(float)) == 0;
        step_errors[s] = {error_of(st.step_out[0], oracle(cu, aq, hk, hv, rows)),
                          static_cast<double>(st.step_bytes[0])};
        unquantised_errors[s] = error_of(st.step_out[0], oracle(cu, aq, ak, av, rows));
      }
      sync.arrive_and_wait();
    }
#if defined(__CUDACC__)
    if (stream) cudaStreamDestroy(stream);
#endif
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        rank_main(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        group.abort(r, "rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads)
    t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);

  // The prefill's sample rows against the oracle over the prefill batch.
  const std::vector<std::int64_t> rows = example::sample_rows(st.cu_prefill, 16, rng);
  std::vector<T> got;
  for (const std::int64_t g : rows) {
    const ringattn::owner at = plan.locate(g); // the rank that holds the row, and where
    got.insert(got.end(), st.prefill_out[at.rank].begin() + at.local * q_row,
               st.prefill_out[at.rank].begin() + (at.local + 1) * q_row);
  }
  prefill_error = error_of(got, oracle(st.cu_prefill, st.q, st.k, st.v, rows));

  std::printf("sharded decode: %s prefill with the all-gather schedule, %d ranks (%s), %d tokens "
              "in %d sequences, %d:%d heads x %d, %s\n",
              P::name, ranks, gpu ? "device path" : "host path", tokens, batch, qh, kvh, d,
              fp8     ? "FP8 cache in pages of 16 tokens, a scale per page and kv head"
              : paged ? "cache in pages of 16 tokens"
                      : "cache in slabs");
  std::printf("  prefill: %zu sample rows against the float64 oracle: relative L2 %.2e\n",
              rows.size(), prefill_error);
  bool ok = prefill_error < 1e-2;
  for (int s = 0; s < steps; ++s) {
    std::printf("  decode step %d: %d new tokens, relative L2 %.2e against the oracle over the "
                "whole cache, %.0f bytes sent per rank\n",
                s + 1, batch, step_errors[s][0], step_errors[s][1]);
    if (fp8)
      std::printf("    (the oracle over the dequantised cache; over the unquantised K/V: %.2e)\n",
                  unquantised_errors[s]);
    ok = ok && step_errors[s][0] < 1e-2;
  }
  std::printf("  every rank's decode output bitwise equal: %s\n", same_everywhere ? "yes" : "no");
  ok = ok && same_everywhere;
  // bf16 outputs against float64: 1e-2 relative L2.
  std::printf("prefill and decode against the float64 oracle: %s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) try {
  int ranks = 4, tokens = 1001, steps = 4;
  std::string partitioner = "round_robin", device = "auto", cache = "slab";
  example::flags("sharded_decode",
                 "A context-parallel prefill (all-gather schedule), then decode steps over the "
                 "KV cache sharded across the ranks; both against the float64 reference.")
      .add("ranks", ranks, "ranks (threads of this process)")
      .add("tokens", tokens, "prefill tokens (three sequences)", 3)
      .add("steps", steps, "decode steps (one new token per sequence each)")
      .add("partitioner", partitioner, {"round_robin", "zigzag", "contiguous", "balanced"},
           "the prefill's layout, which the cache keeps")
      .add("cache", cache, {"slab", "paged", "fp8"},
           "a slab per sequence, pages of 16 tokens with a page table per sequence, or such "
           "pages holding FP8 (e4m3) K/V with a scale per page and kv head")
      .add("device", device, {"auto", "cpu", "gpu"}, "auto: the GPU where there is one")
      .parse(argc, argv);
  const bool gpu = example::gpu_count(device) > 0, fp8 = cache == "fp8",
             paged = cache == "paged" || fp8;
  if (partitioner == "zigzag") return run<ringattn::zigzag>(ranks, tokens, steps, gpu, paged, fp8);
  if (partitioner == "contiguous")
    return run<ringattn::contiguous>(ranks, tokens, steps, gpu, paged, fp8);
  if (partitioner == "balanced")
    return run<ringattn::balanced>(ranks, tokens, steps, gpu, paged, fp8);
  return run<ringattn::round_robin>(ranks, tokens, steps, gpu, paged, fp8);
} catch (const example::help_requested& h) {
  std::printf("%s", h.text.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
