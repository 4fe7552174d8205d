#pragma once
// Attention over one whole sequence on one GPU with the block kernels, as a single-GPU user runs
// it: the forward (block_forward_plain: out and lse) and the whole backward (D = rowsum(dO . O),
// zeroed fp32 accumulators, the block backward, dQ/dK/dV written in T). The baseline the ring
// benchmarks divide by, and what bench_block_backward times.
#include "harness.cuh"

#include <ringattn/block/device/backward.cuh>
#include <ringattn/block/device/forward.cuh>

#include <vector>

namespace ringattn::bench {

template <class T>
class single_gpu_attention {
public:
  //! One sequence of `tokens`, full or causal, random inputs (device memory); q and k
  //! `head_dim` wide, v and the output `head_dim_v` (0: as wide).
  single_gpu_attention(std::int64_t tokens, int q_heads, int kv_heads, int head_dim, bool causal,
                       backward_options path = {}, int head_dim_v = 0)
      : s_(tokens), args_{.q_heads = q_heads,
                          .kv_heads = kv_heads,
                          .head_dim = head_dim,
                          .head_dim_v = head_dim_v},
        nq_(static_cast<std::size_t>(tokens * q_heads * head_dim)),
        nk_(static_cast<std::size_t>(tokens * kv_heads * head_dim)),
        no_(static_cast<std::size_t>(tokens * q_heads * args_.v_dim())),
        nv_(static_cast<std::size_t>(tokens * kv_heads * args_.v_dim())),
        groups_(one_group(causal)), forward_(groups_, tokens, tokens, args_),
        backward_(groups_, tokens, tokens, path) {
    backward_.supports(args_.qk_dim(), args_.v_dim()).throw_if_invalid();
    q_ = device_uniform<T>(nq_, 1), k_ = device_uniform<T>(nk_, 2);
    v_ = device_uniform<T>(nv_, 3), dout_ = device_uniform<T>(no_, 4);
    RINGATTN_CUDA_CHECK(cudaMalloc(&out_, sizeof(T) * no_));
    RINGATTN_CUDA_CHECK(cudaMalloc(&dq16_, sizeof(T) * nq_));
    RINGATTN_CUDA_CHECK(cudaMalloc(&dk16_, sizeof(T) * nk_));
    RINGATTN_CUDA_CHECK(cudaMalloc(&dv16_, sizeof(T) * nv_));
    for (float** p : {&lse_, &delta_})
      RINGATTN_CUDA_CHECK(cudaMalloc(p, sizeof(float) * tokens * q_heads));
    RINGATTN_CUDA_CHECK(cudaMalloc(&dq_, sizeof(float) * nq_));
    RINGATTN_CUDA_CHECK(cudaMalloc(&dk_, sizeof(float) * nk_));
    RINGATTN_CUDA_CHECK(cudaMalloc(&dv_, sizeof(float) * nv_));
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~single_gpu_attention() {
    for (T* p : {q_, k_, v_, dout_, out_, dq16_, dk16_, dv16_})
      cudaFree(p);
    for (float* p : {lse_, delta_, dq_, dk_, dv_})
      cudaFree(p);
  }
  single_gpu_attention(const single_gpu_attention&) = delete;
  single_gpu_attention& operator=(const single_gpu_attention&) = delete;

  //! out and lse from q, k, v.
  void forward(cudaStream_t stream) const {
    // The plain kernel writes out and lse directly; the state (any valid pointers) is not touched.
    const attention_state st{dq_, lse_, delta_, s_, args_.q_heads, args_.v_dim()};
    block_forward_plain<T>({q(), k(), v(), args_, st}, forward_, out_view(out_), lse_, stream);
  }
  //! dQ, dK, dV in T from the forward's out and lse and a random dout.
  void backward(cudaStream_t stream) const {
    compute_delta<T>(out_view(out_), out_view(dout_), delta_, stream);
    RINGATTN_CUDA_CHECK(cudaMemsetAsync(dq_, 0, sizeof(float) * nq_, stream));
    RINGATTN_CUDA_CHECK(cudaMemsetAsync(dk_, 0, sizeof(float) * nk_, stream));
    RINGATTN_CUDA_CHECK(cudaMemsetAsync(dv_, 0, sizeof(float) * nv_, stream));
    block_backward<T>({q(), k(), v(), out_view(dout_), lse_, delta_, args_, {dq_, dk_, dv_}},
                      backward_, stream);
    write_gradient<T>(dq_, {dq16_, s_, args_.q_heads, args_.head_dim}, stream);
    write_gradient<T>(dk_, {dk16_, s_, args_.kv_heads, args_.head_dim}, stream);
    write_gradient<T>(dv_, {dv16_, s_, args_.kv_heads, args_.v_dim()}, stream);
  }
  //! One kind of the tensor-core block backward's thread blocks alone (1: dK/dV, 2: dQ), into
  //! the fp32 accumulators as they are: where the backward's time goes.
  //! Under a non-deterministic schedule at head_dim 128 (the five-product kernel, one kind of
  //! block): 1 its blocks with dQ's reduction left out, 2 with it.
  void backward_kernel(int which, cudaStream_t stream) const {
    auto p = backward_.tc_params<T>(
        {q(), k(), v(), out_view(dout_), lse_, delta_, args_, {dq_, dk_, dv_}});
    if (backward_.five_products(args_.qk_dim(), args_.v_dim())) {
      if (which == 1)
        ringattn::detail::launch_block_backward_five<T, false>(p, stream);
      else
        ringattn::detail::launch_block_backward_five<T, true>(p, stream);
      return;
    }
    (which == 1 ? p.row_tile_count : p.key_tile_count) = 0;
    const int wgmma = backward_.wgmma(args_.head_dim) ? backward_.wgmma_warpgroups() : 0;
    if (args_.separate_widths())
      ringattn::detail::launch_block_backward_tc<T, 192, 128>(p, backward_.wgmma_warpgroups(),
                                                              stream);
    else if (args_.head_dim == 64)
      ringattn::detail::launch_block_backward_tc<T, 64>(p, wgmma, stream);
    else
      ringattn::detail::launch_block_backward_tc<T, 128>(p, wgmma, stream);
  }
  //! Whether the backward runs on tensor cores (mma.sync or wgmma).
  bool tensor_cores() const { return backward_.tensor_cores(args_.qk_dim(), args_.v_dim()); }

private:
  std::vector<block_group> one_group(bool causal) const {
    block_group g{0, s_, 1, {}};
    g.kv[0] = {0, s_, causal ? band{-unbounded, 0} : band{}};
    return {g};
  }
  thd_view<const T> view(const T* p, int heads) const { return {p, s_, heads, args_.head_dim}; }
  thd_view<const T> q() const { return view(q_, args_.q_heads); }
  thd_view<const T> k() const { return view(k_, args_.kv_heads); }
  thd_view<const T> v() const { return {v_, s_, args_.kv_heads, args_.v_dim()}; }
  thd_view<T> out_view(T* p) const { return {p, s_, args_.q_heads, args_.v_dim()}; }

  std::int64_t s_;
  attention_arguments args_;
  std::size_t nq_, nk_, no_, nv_;
  std::vector<block_group> groups_;
  device_block_schedule forward_;
  device_backward_schedule backward_;
  T *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *dout_ = nullptr, *out_ = nullptr;
  T *dq16_ = nullptr, *dk16_ = nullptr, *dv16_ = nullptr;
  float *lse_ = nullptr, *delta_ = nullptr, *dq_ = nullptr, *dk_ = nullptr, *dv_ = nullptr;
};

} // namespace ringattn::bench
