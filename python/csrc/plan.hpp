#pragma once
// The extension's view of a ring: one `plan` is a planned `ring_attention` (or, for virtual
// ranks, one per rank of an in-process group) behind a small virtual interface, so that the
// PyTorch bindings (compiled against torch's headers) and the ring's instantiations (compiled by
// nvcc where they run on the GPU) meet through plain pointers and shapes only.
#include <ringattn/arguments.cuh>
#include <ringattn/core/mask.cuh>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace ringattn_torch {

enum class partitioner_kind { contiguous, round_robin, zigzag, balanced };
enum class schedule_kind { ring, all_gather, all_to_all };
enum class element_type { f16, bf16, f32 };
//! The BlockKernel of a plan's ring on the device: the library's own kernels, or cuDNN's fused
//! attention (`cudnn_kernel<Mask, T, cudnn_atomic>`, in builds that have it). The host path runs
//! the host twin, which both share.
enum class kernel_kind { native, cudnn };

//! What a plan is planned for: the policies by kind, the arguments and the global layout.
struct layout {
  partitioner_kind partitioner = partitioner_kind::zigzag;
  ringattn::mask_kind mask = ringattn::mask_kind::causal;
  schedule_kind schedule = schedule_kind::ring;
  kernel_kind kernel = kernel_kind::native;
  //! The element type a cuDNN plan is made for (a cuDNN graph is built per element type); the
  //! native kernels take fp16 and bf16 (and fp32 on the host) with one plan.
  element_type element = element_type::bf16;
  ringattn::attention_arguments args;
  std::vector<std::int32_t> cu_seqlens;
};

//! A `[tokens, heads, dim]` tensor: data pointer, shape and element strides (dim stride 1).
struct view {
  void* data = nullptr;
  std::int64_t tokens = 0;
  std::int32_t heads = 0;
  std::int32_t dim = 0;
  std::int64_t token_stride = 0;
  std::int64_t head_stride = 0;
};

//! One rank's tensors of a forward.
struct forward_io {
  view q, k, v, out;
  float* lse = nullptr;
  float* max_logit = nullptr; //!< [q_heads], or null: not asked for
};

//! One rank's tensors of a backward.
struct backward_io {
  view q, k, v, out;
  const float* lse = nullptr;
  view dout, dq, dk, dv;
};

//! A planned ring for the ranks this process drives: one (a rank of a process group) or all of
//! them (virtual ranks of an in-process group). Calls take one io per rank here and one workspace
//! of `workspace_bytes` that holds every rank's share.
class plan {
public:
  virtual ~plan() = default;
  //! Ranks this plan runs: 1, or the size of a virtual group.
  virtual int ranks_here() const = 0;
  //! The group's size and the first rank this plan runs.
  virtual int size() const = 0;
  virtual int first_rank() const = 0;
  //! Tokens of the shard of the i-th rank here.
  virtual std::int64_t local_tokens(int i) const = 0;
  //! CUDA device the plan runs on, or -1 for the host path.
  virtual int device() const = 0;
  //! Bytes of the workspace a forward (`backward` false) or backward takes, all ranks here.
  virtual std::size_t workspace_bytes(element_type type, bool backward) const = 0;
  //! Bytes the ranks here have sent so far.
  virtual std::uint64_t bytes_sent() const = 0;
  //! Asynchronous on `stream` (a cudaStream_t; ignored on the host path).
  virtual void forward(element_type type, std::span<const forward_io> io, void* workspace,
                       std::size_t workspace_bytes, void* stream) = 0;
  virtual void backward(element_type type, std::span<const backward_io> io, void* workspace,
                        std::size_t workspace_bytes, void* stream) = 0;
  //! Stands in for a call the bindings refused before reaching the ring (`reason`, without the
  //! "ringattn: " prefix): the peers' call fails naming this rank instead of waiting for it.
  //! Throws `ringattn::invalid_argument`.
  [[noreturn]] virtual void refuse(element_type type, bool backward, const std::string& reason) = 0;
};

//! One rank's end of a communicator the process keeps across plans (a process group's NCCL
//! communicator, or its CPU backend).
class endpoint {
public:
  virtual ~endpoint() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  //! -1 for a host endpoint.
  virtual int device() const = 0;
  virtual std::uint64_t bytes_sent() const = 0;
};

// Factories. Each throws `ringattn::invalid_argument` (or `communication_error`) with the
// library's sentence when the layout cannot be planned or the ranks disagree.

//! All `ranks` ranks as threads of this process on the host (CPU tensors).
std::unique_ptr<plan> make_virtual_host_plan(const layout& l, int ranks);
//! All `ranks` ranks as threads of this process on CUDA device `device`.
std::unique_ptr<plan> make_virtual_device_plan(const layout& l, int ranks, int device);
//! This rank of `ep` (an NCCL endpoint) on its device. Collective over the endpoint's ranks.
std::unique_ptr<plan> make_device_plan(const layout& l, std::shared_ptr<endpoint> ep);
//! This rank of `ep` (a host endpoint) on the host. Collective over the endpoint's ranks.
std::unique_ptr<plan> make_host_plan(const layout& l, std::shared_ptr<endpoint> ep);

//! The NCCL unique id's bytes (ncclGetUniqueId), to be shared through a process group.
std::vector<std::uint8_t> nccl_unique_id();
//! Joins an NCCL communicator of `size` ranks as `rank` on CUDA device `device`, bounded by
//! `timeout_ms`. Collective.
std::shared_ptr<endpoint> make_nccl_endpoint(std::span<const std::uint8_t> id, int size, int rank,
                                             int device, std::int64_t timeout_ms);
//! Whether this build has the device path (CUDA kernels and NCCL).
bool has_device_path();
//! Whether this build has the cuDNN block kernel on its device path.
bool has_cudnn_kernel();

//! Token indices into the global packed batch of rank `rank`'s shard (its order), and their
//! positions within their sequences.
std::vector<std::int64_t> token_indices(partitioner_kind p, std::span<const std::int32_t> cu,
                                        int ranks, int rank);
std::vector<std::int32_t> position_ids(partitioner_kind p, std::span<const std::int32_t> cu,
                                       int ranks, int rank);

} // namespace ringattn_torch
