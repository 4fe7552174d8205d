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

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>

namespace ringattn::detail {

//! The host path's own checks: none beyond the shapes.
inline constexpr auto no_device_checks = [](validation&) {};

class ring_checks {
public:
  ring_checks(const attention_arguments& args, std::int64_t local_tokens, int rank)
      : args_(args), n_(local_tokens), rank_(rank) {}

  //! `forward(q, k, v, out, lse, workspace)`'s arguments against this rank's shard. `device`
  //! (a path's own checks: placement, alignment) runs on `r` once the shapes hold, before the
  //! overlap checks, so that a view's own fault is named before what it overlaps.
  template <element T, class Device = decltype(no_device_checks)>
  validation forward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                     thd_view<const T> out, const float* lse, std::span<const std::byte> workspace,
                     std::size_t need, const Device& device = no_device_checks) const {
    validation r = views(q, k, v, out);
    if (!r) return r;
    shards(r, q, k, v, out, lse);
    require_workspace(r, workspace, need);
    if (r) device(r);
    if (!r) return r;
    const region outputs[] = {region_of(out, "out"),
                              region_of(lse, sizeof(float) * lse_entries(), "lse"),
                              region_of(workspace.data(), need, "the workspace")};
    const region inputs[] = {region_of(q, "q"), region_of(k, "k"), region_of(v, "v")};
    require_disjoint(r, outputs, inputs);
    return r;
  }

  //! `backward(...)`'s arguments against this rank's shard; `device` as in `forward`.
  template <element T, class Device = decltype(no_device_checks)>
  validation backward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                      thd_view<const T> out, const float* lse, thd_view<const T> dout,
                      thd_view<T> dq, thd_view<T> dk, thd_view<T> dv,
                      std::span<const std::byte> workspace, std::size_t need,
                      const Device& device = no_device_checks) const {
    validation r = views(q, k, v, out);
    r.require(validate_view(dout, "dout"));
    r.require(validate_view(dq, "dq"))
        .require(validate_view(dk, "dk"))
        .require(validate_view(dv, "dv"));
    if (!r) return r;
    shards(r, q, k, v, out, lse);
    shard(r, dout, "dout", args_.q_heads, args_.v_dim());
    shard(r, dq, "dq", args_.q_heads, args_.qk_dim());
    shard(r, dk, "dk", args_.kv_heads, args_.qk_dim());
    shard(r, dv, "dv", args_.kv_heads, args_.v_dim());
    require_workspace(r, workspace, need);
    if (r) device(r);
    if (!r) return r;
    const region outputs[] = {region_of(dq, "dq"), region_of(dk, "dk"), region_of(dv, "dv"),
                              region_of(workspace.data(), need, "the workspace")};
    const region inputs[] = {
        region_of(q, "q"),       region_of(k, "k"),
        region_of(v, "v"),       region_of(out, "out"),
        region_of(dout, "dout"), region_of(lse, sizeof(float) * lse_entries(), "lse")};
    require_disjoint(r, outputs, inputs);
    return r;
  }

  struct named_buffer {
    const void* data;
    const char* name;
  };
  //! The current device and the stream's are `device` (where the ring was prepared), and every
  //! buffer is device memory there (or managed), so no kernel ever dereferences a host pointer.
  //! The stream's device is not checked while the stream is being captured.
  //! `call` names the entry point in messages. Allocates nothing unless it fails.
  static validation placement(int device, cudaStream_t stream,
                              std::span<const named_buffer> buffers, const char* call) {
    validation r = validation::ok();
    int current = -1;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&current));
    r.require(current == device, "the current device is ", current, " but prepare_device() ran on ",
              device);
    if (stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread) {
      // A capturing stream cannot be asked for its device (the call is not permitted during
      // capture); the buffers are still checked against the device.
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      RINGATTN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
      if (capturing == cudaStreamCaptureStatusNone) {
        int on = -1;
        RINGATTN_CUDA_CHECK(cudaStreamGetDevice(stream, &on));
        r.require(on == device, "the stream belongs to device ", on, "; this rank runs on device ",
                  device);
      }
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

  //! The device forward's own checks: prepared (`device` >= 0: where), placement, alignment.
  template <class T>
  static void device_forward(validation& ok, int device, cudaStream_t stream,
                             std::span<const named_buffer> buffers, thd_view<const T> q,
                             thd_view<const T> out, const float* lse) {
    ok.require(device >= 0, "prepare_device() must run before the device forward");
    if (ok) ok.require(placement(device, stream, buffers, "forward"));
    ok.require(rows_aligned_to(q, 16), "q must be 16-byte aligned with token and head strides "
                                       "that are multiples of 8 elements (the kernels load 16-byte "
                                       "vectors)");
    ok.require(rows_aligned_to(out, 4), "out must be 4-byte aligned with even token and head "
                                        "strides");
    ok.require(aligned_to(lse, 4), "lse must be 4-byte aligned");
  }
  //! The device backward's own checks. The block backward reads q and dout in place (k and v
  //! travel in the workspace).
  template <class T>
  static void device_backward(validation& ok, int device, cudaStream_t stream,
                              std::span<const named_buffer> buffers, thd_view<const T> q,
                              thd_view<const T> dout, const float* lse) {
    ok.require(device >= 0, "prepare_device() must run before the device backward");
    if (ok) ok.require(placement(device, stream, buffers, "backward"));
    ok.require(rows_aligned_to(q, 16) && rows_aligned_to(dout, 16),
               "q and dout must be 16-byte aligned with token and head strides that are "
               "multiples of 8 elements (the kernels load 16-byte vectors)");
    ok.require(aligned_to(lse, 4), "lse must be 4-byte aligned");
  }

  //! Memory a call reads or writes, for the overlap checks: `tokens` rows `token_stride` bytes
  //! apart, each `row` bytes from its start (a dense buffer is one row).
  struct region {
    const char* name;
    std::uintptr_t base = 0;
    std::int64_t tokens = 0, token_stride = 0, row = 0;
  };
  template <class T>
  static region region_of(const thd_view<T>& v, const char* name) {
    if (v.tokens <= 0) return {name};
    const auto e = static_cast<std::int64_t>(sizeof(T));
    return {name, reinterpret_cast<std::uintptr_t>(v.data), v.tokens, v.token_stride * e,
            ((static_cast<std::int64_t>(v.heads) - 1) * v.head_stride + v.head_dim) * e};
  }
  static region region_of(const void* p, std::size_t bytes, const char* name) {
    if (p == nullptr || bytes == 0) return {name};
    return {name, reinterpret_cast<std::uintptr_t>(p), 1, 0, static_cast<std::int64_t>(bytes)};
  }
  //! Whether two regions may share a byte. Views with one token stride (the parts of a packed
  //! qkv tensor, say) are compared row by row at their relative offset; others by their spans.
  static bool overlap(const region& a, const region& b) {
    if (a.tokens == 0 || b.tokens == 0) return false;
    auto end = [](const region& x) {
      return x.base + static_cast<std::uintptr_t>((x.tokens - 1) * x.token_stride + x.row);
    };
    if (end(a) <= b.base || end(b) <= a.base) return false;
    if (a.token_stride != b.token_stride || a.token_stride <= 0 || a.tokens == 1 || b.tokens == 1)
      return true;
    // b's rows start `shift` bytes after a's rows (mod the stride); rows of both stay inside one
    // stride, so a's row [0, a.row) meets b's rows only at `shift` or `shift - stride`.
    const std::int64_t s = a.token_stride;
    const std::int64_t d = static_cast<std::int64_t>(b.base - a.base);
    const std::int64_t shift = ((d % s) + s) % s;
    auto meets = [&](std::int64_t at) { return at < a.row && at + b.row > 0; };
    return meets(shift) || meets(shift - s);
  }
  //! No output shares memory with another output or an input (inputs may share: read only).
  static void require_disjoint(validation& r, std::span<const region> outputs,
                               std::span<const region> inputs) {
    for (std::size_t i = 0; i < outputs.size() && r; ++i) {
      for (std::size_t j = i + 1; j < outputs.size() && r; ++j)
        r.require(!overlap(outputs[i], outputs[j]), outputs[i].name, " and ", outputs[j].name,
                  " overlap (outputs must not share memory)");
      for (std::size_t j = 0; j < inputs.size() && r; ++j)
        r.require(!overlap(outputs[i], inputs[j]), outputs[i].name, " overlaps the input ",
                  inputs[j].name);
    }
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
  // A view of this rank's shard: [local tokens, heads, width].
  template <class View>
  void shard(validation& r, const View& x, const char* name, int heads, int width) const {
    r.require(x.tokens == n_ && x.heads == heads && x.head_dim == width, name, " is [", x.tokens,
              ", ", x.heads, ", ", x.head_dim, "] but rank ", rank_, "'s shard is [", n_, ", ",
              heads, ", ", width, "]");
  }
  template <element T>
  void shards(validation& r, thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
              thd_view<const T> out, const float* lse) const {
    shard(r, q, "q", args_.q_heads, args_.qk_dim());
    shard(r, k, "k", args_.kv_heads, args_.qk_dim());
    shard(r, v, "v", args_.kv_heads, args_.v_dim());
    shard(r, out, "out", args_.q_heads, args_.v_dim());
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

  std::size_t lse_entries() const { return static_cast<std::size_t>(n_) * args_.q_heads; }

  attention_arguments args_;
  std::int64_t n_;
  int rank_;
};

} // namespace ringattn::detail
