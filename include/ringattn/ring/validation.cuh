#pragma once
//! \file
//! What a ring call checks before anything is sent, written or enqueued: every view is sound and
//! has the shape of this rank's shard, the workspace is large enough and aligned, and on the
//! device path that every buffer is device memory of the device the ring was prepared on and
//! meets the kernels' alignment. The block groups are not re-checked: the schedule validated
//! them once, at plan time.

#include <ringattn/arguments.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace ringattn::detail {

class ring_checks {
public:
  ring_checks(const attention_arguments& args, std::int64_t local_tokens, int rank)
      : args_(args), n_(local_tokens), rank_(rank) {}

  //! `forward(q, k, v, out, lse, workspace)`'s arguments against this rank's shard.
  template <element T>
  validation forward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                     thd_view<const T> out, const float* lse, std::span<const std::byte> workspace,
                     std::size_t need) const {
    validation r = views(q, k, v, out);
    if (!r) return r;
    shards(r, q, k, v, out, lse);
    require_workspace(r, workspace, need);
    return r;
  }

  //! `backward(...)`'s arguments against this rank's shard.
  template <element T>
  validation backward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                      thd_view<const T> out, const float* lse, thd_view<const T> dout,
                      thd_view<T> dq, thd_view<T> dk, thd_view<T> dv,
                      std::span<const std::byte> workspace, std::size_t need) const {
    validation r = views(q, k, v, out);
    r.require(validate_view(dout, "dout"));
    r.require(validate_view(dq, "dq"))
        .require(validate_view(dk, "dk"))
        .require(validate_view(dv, "dv"));
    if (!r) return r;
    shards(r, q, k, v, out, lse);
    shard(r, dout, "dout", args_.q_heads);
    shard(r, dq, "dq", args_.q_heads);
    shard(r, dk, "dk", args_.kv_heads);
    shard(r, dv, "dv", args_.kv_heads);
    require_workspace(r, workspace, need);
    return r;
  }

  struct named_buffer {
    const void* data;
    const char* name;
  };
  //! The current device and the stream's are `device` (where the ring was prepared), and every
  //! buffer is device memory there (or managed), so no kernel ever dereferences a host pointer.
  //! `call` names the entry point in messages. Allocates nothing unless it fails.
  static validation placement(int device, cudaStream_t stream,
                              std::span<const named_buffer> buffers, const char* call) {
    validation r = validation::ok();
    int current = -1;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&current));
    r.require(current == device, "the current device is ", current, " but prepare_device() ran on ",
              device);
    if (stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread) {
      int on = -1;
      RINGATTN_CUDA_CHECK(cudaStreamGetDevice(stream, &on));
      r.require(on == device, "the stream belongs to device ", on, "; this rank runs on device ",
                device);
    }
    for (const named_buffer& b : buffers) {
      if (b.data == nullptr || !r) continue;
      cudaPointerAttributes a{};
      const cudaError_t e = cudaPointerGetAttributes(&a, b.data);
      if (e != cudaSuccess) { // older drivers report unregistered host memory this way
        (void)cudaGetLastError();
        r.require(false, b.name, " is not device memory (", cudaGetErrorName(e), ")");
        continue;
      }
      if (a.type == cudaMemoryTypeManaged || (a.type == cudaMemoryTypeDevice && a.device == device))
        continue;
      if (a.type == cudaMemoryTypeDevice)
        r.require(false, b.name, " is device memory of another device (", a.device,
                  "; this rank runs on device ", device, ")");
      else
        r.require(false, b.name, " is host memory; the device ", call, " takes device memory");
    }
    return r;
  }

private:
  template <element T>
  static validation views(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                          thd_view<const T> out) {
    validation r = validation::ok();
    r.require(validate_view(q, "q")).require(validate_view(k, "k")).require(validate_view(v, "v"));
    r.require(validate_view(out, "out"));
    return r;
  }
  // A view of this rank's shard: [local tokens, heads, head_dim].
  template <class View>
  void shard(validation& r, const View& x, const char* name, int heads) const {
    r.require(x.tokens == n_ && x.heads == heads && x.head_dim == args_.head_dim, name, " is [",
              x.tokens, ", ", x.heads, ", ", x.head_dim, "] but rank ", rank_, "'s shard is [", n_,
              ", ", heads, ", ", args_.head_dim, "]");
  }
  template <element T>
  void shards(validation& r, thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
              thd_view<const T> out, const float* lse) const {
    shard(r, q, "q", args_.q_heads);
    shard(r, k, "k", args_.kv_heads);
    shard(r, v, "v", args_.kv_heads);
    shard(r, out, "out", args_.q_heads);
    r.require(n_ == 0 || lse != nullptr, "lse is a null pointer");
  }
  // A workspace of at least `need` bytes, 16-byte aligned.
  static void require_workspace(validation& r, std::span<const std::byte> workspace,
                                std::size_t need) {
    r.require(workspace.size() >= need, "the workspace has ", workspace.size(), " bytes; ", need,
              " are needed");
    r.require(workspace.data() != nullptr || need == 0, "the workspace is a null pointer");
    r.require(aligned_to(workspace.data(), 16), "the workspace must be 16-byte aligned");
  }

  attention_arguments args_;
  std::int64_t n_;
  int rank_;
};

} // namespace ringattn::detail
