#pragma once
// The extension's view of a sharded decode (`ringattn::sharded_attention`): one `decoder` runs
// the steps of one rank of a communicator the process keeps, or of every rank of an in-process
// group, behind a small virtual interface, as `plan` does for a ring (plan.hpp).
#include "plan.hpp"

#include <ringattn/arguments.cuh>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace ringattn_torch {

//! One rank's KV cache shard of a step, as `sharded_attention::plan` takes it: rows
//! `[begin[b], begin[b] + length[b])` of a cache of `rows` rows (`page_size` 0), or a pool of
//! `pages` pages of `page_size` rows whose sequence b lists its pages in
//! `page_table[cu_pages[b] .. cu_pages[b + 1])`.
struct cache_shard {
  std::vector<std::int32_t> length;
  std::vector<std::int32_t> begin; //!< packed or in place; unused for a paged cache
  std::int64_t rows = 0;
  std::int32_t page_size = 0; //!< 0: not paged
  std::int64_t pages = 0;
  std::vector<std::int32_t> cu_pages;       //!< batch + 1 offsets into page_table
  std::span<const std::int32_t> page_table; //!< the caller's table, read in place
};

//! One rank's tensors of a step: the new tokens (the same on every rank), its cache shard (a
//! paged pool as `[pages * page_size, kv_heads, dim]` rows), the output and lse it receives.
struct decode_io {
  view q, k, v, k_cache, v_cache, out;
  float* lse = nullptr;
};

//! The sharded decode of the ranks this process drives: one (a rank of a process group) or all
//! of them (virtual ranks of an in-process group). Each step is `plan`, then `step` with one io
//! per rank here and one workspace of `workspace_bytes` that holds every rank's share.
class decoder {
public:
  virtual ~decoder() = default;
  virtual int ranks_here() const = 0;
  virtual int size() const = 0;
  virtual int first_rank() const = 0;
  //! CUDA device, or -1 for the host path.
  virtual int device() const = 0;
  virtual std::uint64_t bytes_sent() const = 0;
  //! Plans the step: `cu_new` (the same on every rank) and one cache shard per rank here.
  //! Collective.
  virtual void plan(std::span<const std::int32_t> cu_new, std::span<const cache_shard> caches) = 0;
  //! Bytes of the planned step's workspace, all ranks here.
  virtual std::size_t workspace_bytes(element_type type) const = 0;
  //! The planned step; asynchronous on `stream` (a cudaStream_t; ignored on the host path).
  //! Collective.
  virtual void step(element_type type, std::span<const decode_io> io, void* workspace,
                    std::size_t workspace_bytes, void* stream) = 0;
  //! Stand in for a plan (`in_step` false) or a step that the bindings refused before reaching
  //! the decoder (`reason`, without the "ringattn: " prefix): the peers' call fails instead of
  //! waiting for this rank. Throws `ringattn::invalid_argument`.
  [[noreturn]] virtual void refuse(element_type type, bool in_step, const std::string& reason) = 0;
};

//! All `ranks` ranks as threads of this process on the host (CPU tensors).
std::unique_ptr<decoder> make_virtual_host_decoder(const ringattn::attention_arguments& args,
                                                   int ranks);
//! All `ranks` ranks as threads of this process on CUDA device `device`.
std::unique_ptr<decoder> make_virtual_device_decoder(const ringattn::attention_arguments& args,
                                                     int ranks, int device);
//! This rank of `ep` (an NCCL endpoint) on its device. Collective.
std::unique_ptr<decoder> make_device_decoder(const ringattn::attention_arguments& args,
                                             std::shared_ptr<endpoint> ep);
//! This rank of `ep` (a host endpoint) on the host. Collective.
std::unique_ptr<decoder> make_host_decoder(const ringattn::attention_arguments& args,
                                           std::shared_ptr<endpoint> ep);

} // namespace ringattn_torch
