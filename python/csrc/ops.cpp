// The PyTorch face of the extension: custom classes `ringattn.Endpoint` (this rank's end of a
// communicator kept across rings), `ringattn.Plan` (a planned ring) and `ringattn.Decoder` (the
// steps of a sharded decode), and the layout helpers,
// registered with TORCH_LIBRARY so that the library needs libtorch only (no Python headers).
// Arguments are checked here (tensor kinds, devices, ranks) and by the ring (shapes, layout) before
// any work is enqueued; the ring's invalid_argument reaches Python as ValueError.
#include "decoder.hpp"
#include "group_communicator.hpp"
#include "plan.hpp"

#include <ringattn/error.cuh>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace ringattn_torch {

namespace {

//! Runs `body`, turning the library's invalid_argument into a Python ValueError (the message
//! unchanged) and its other errors into RuntimeError.
template <class Body>
decltype(auto) translated(Body&& body) {
  try {
    return body();
  } catch (const ringattn::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const ringattn::error& e) {
    TORCH_CHECK(false, e.what());
  }
}

[[noreturn]] void bad(const std::string& what) { TORCH_CHECK_VALUE(false, "ringattn: ", what); }

partitioner_kind partitioner_of(const std::string& name) {
  if (name == "contiguous") return partitioner_kind::contiguous;
  if (name == "round_robin") return partitioner_kind::round_robin;
  if (name == "zigzag") return partitioner_kind::zigzag;
  if (name == "balanced") return partitioner_kind::balanced;
  bad("unknown partitioner '" + name + "' (contiguous, round_robin, zigzag or balanced)");
}

ringattn::mask_kind mask_of(const std::string& name) {
  if (name == "full") return ringattn::mask_kind::full;
  if (name == "causal") return ringattn::mask_kind::causal;
  if (name == "sliding_window") return ringattn::mask_kind::sliding_window;
  if (name == "causal_window") return ringattn::mask_kind::causal_window;
  bad("unknown mask '" + name + "' (full, causal, sliding_window or causal_window)");
}

schedule_kind schedule_of(const std::string& name) {
  if (name == "ring") return schedule_kind::ring;
  if (name == "all_gather") return schedule_kind::all_gather;
  if (name == "all_to_all") return schedule_kind::all_to_all;
  bad("unknown schedule '" + name + "' (ring, all_gather or all_to_all)");
}

kernel_kind kernel_of(const std::string& name) {
  if (name == "native") return kernel_kind::native;
  if (name == "cudnn") return kernel_kind::cudnn;
  bad("unknown kernel '" + name + "' (native or cudnn)");
}

element_type element_named(const std::string& name) {
  if (name == "float16") return element_type::f16;
  if (name == "bfloat16") return element_type::bf16;
  if (name == "float32") return element_type::f32;
  bad("unknown element type '" + name + "' (float16, bfloat16 or float32)");
}

std::vector<std::int32_t> cu_seqlens_of(const std::vector<std::int64_t>& cu,
                                        const char* name = "cu_seqlens") {
  std::vector<std::int32_t> out;
  out.reserve(cu.size());
  for (std::int64_t x : cu) {
    if (x < 0 || x > INT32_MAX)
      bad(std::string(name) + " entry " + std::to_string(x) + " is outside [0, 2^31)");
    out.push_back(static_cast<std::int32_t>(x));
  }
  return out;
}

layout layout_of(const std::string& partitioner, const std::string& mask,
                 const std::string& schedule, const std::string& kernel, const std::string& element,
                 const std::vector<std::int64_t>& dims, const std::vector<std::int64_t>& window,
                 double softmax_scale, const std::vector<std::int64_t>& cu_seqlens) {
  if (dims.size() != 4) bad("dims are [q_heads, kv_heads, head_dim, head_dim_v]");
  if (window.size() != 2) bad("window is [left, right]");
  for (std::int64_t d : dims)
    if (d < 0 || d > INT32_MAX) bad("a head count or width of " + std::to_string(d));
  layout l;
  l.partitioner = partitioner_of(partitioner);
  l.mask = mask_of(mask);
  l.schedule = schedule_of(schedule);
  l.kernel = kernel_of(kernel);
  l.element = element_named(element);
  l.args.q_heads = static_cast<std::int32_t>(dims[0]);
  l.args.kv_heads = static_cast<std::int32_t>(dims[1]);
  l.args.head_dim = static_cast<std::int32_t>(dims[2]);
  l.args.head_dim_v = static_cast<std::int32_t>(dims[3]);
  l.args.softmax_scale = static_cast<float>(softmax_scale);
  l.args.window_left = window[0];
  l.args.window_right = window[1];
  l.cu_seqlens = cu_seqlens_of(cu_seqlens);
  return l;
}

at::Device device_of(int index) {
  return index < 0 ? at::Device(at::kCPU)
                   : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
}

//! Checks a `[tokens, heads, dim]` tensor of a call running on `here` (`what`: a ring or a
//! decoder) against the call's first tensor.
void check_tensor(const at::Tensor& t, const at::Tensor& first, const char* name, at::Device here,
                  const char* what) {
  if (!t.defined()) bad(std::string(name) + " is undefined");
  if (t.device() != here)
    bad(std::string(name) + " is on " + t.device().str() + " but this " + what + " runs on " +
        here.str());
  if (t.scalar_type() != first.scalar_type())
    bad(std::string(name) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
        " but q has " + std::string(c10::toString(first.scalar_type())));
  if (t.dim() != 3)
    bad(std::string(name) + " must be [tokens, heads, dim] (got " + std::to_string(t.dim()) +
        " dimensions)");
  if (t.size(2) > 1 && t.stride(2) != 1)
    bad(std::string(name) + " must have unit stride in its last dimension");
}

view view_of(const at::Tensor& t) {
  return {t.data_ptr(),
          t.size(0),
          static_cast<std::int32_t>(t.size(1)),
          static_cast<std::int32_t>(t.size(2)),
          t.stride(0),
          t.stride(1)};
}

element_type element_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
  case at::kHalf: return element_type::f16;
  case at::kBFloat16: return element_type::bf16;
  case at::kFloat: return element_type::f32;
  default: break;
  }
  bad(std::string(name) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
      " (float16, bfloat16, or float32 on the CPU)");
}

} // namespace

//! This rank's end of a communicator kept across rings.
struct Endpoint : torch::CustomClassHolder {
  explicit Endpoint(std::shared_ptr<endpoint> e) : impl(std::move(e)) {}
  std::int64_t rank() const { return impl->rank(); }
  std::int64_t size() const { return impl->size(); }
  std::int64_t device() const { return impl->device(); }
  std::int64_t bytes_sent() const { return static_cast<std::int64_t>(impl->bytes_sent()); }
  std::shared_ptr<endpoint> impl;
};

//! A planned ring for the ranks this process runs (one, or every virtual rank).
struct Plan : torch::CustomClassHolder {
  explicit Plan(std::unique_ptr<plan> s) : impl(std::move(s)) {}

  std::int64_t ranks_here() const { return impl->ranks_here(); }
  std::int64_t size() const { return impl->size(); }
  std::int64_t first_rank() const { return impl->first_rank(); }
  std::int64_t device() const { return impl->device(); }
  std::int64_t bytes_sent() const { return static_cast<std::int64_t>(impl->bytes_sent()); }
  std::int64_t local_tokens(std::int64_t i) const {
    if (i < 0 || i >= impl->ranks_here())
      bad("rank index " + std::to_string(i) + " is out of range [0, " +
          std::to_string(impl->ranks_here()) + ")");
    return impl->local_tokens(static_cast<int>(i));
  }

  //! out, lse of every rank here. `out` and `lse` may be given (written in place), else made.
  //! With `max_logit`, also every rank's max logits (`[q_heads]` fp32, the same on every rank);
  //! else that list is empty.
  std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
  forward(const std::vector<at::Tensor>& q, const std::vector<at::Tensor>& k,
          const std::vector<at::Tensor>& v, std::optional<std::vector<at::Tensor>> out,
          std::optional<std::vector<at::Tensor>> lse, std::int64_t stream, bool max_logit) {
    std::vector<at::Tensor> outs, lses, max_logits;
    std::vector<forward_io> io;
    at::Tensor ws;
    const element_type type = prepared(false, q, [&](element_type t) {
      const std::size_t n = check_count(q.size(), "q");
      check_count(k.size(), "k"), check_count(v.size(), "v");
      outs.resize(n), lses.resize(n), io.resize(n), max_logits.resize(max_logit ? n : 0);
      for (std::size_t i = 0; i < n; ++i) {
        check(q[i], q[0], "q"), check(k[i], q[0], "k"), check(v[i], q[0], "v");
        outs[i] = given(out, i, "out", q[0], {q[i].size(0), q[i].size(1), v[i].size(2)});
        lses[i] = given_lse(lse, i, q[i]);
        io[i] = {view_of(q[i]), view_of(k[i]), view_of(v[i]), view_of(outs[i]),
                 lses[i].data_ptr<float>()};
        if (max_logit) {
          max_logits[i] = at::empty({q[i].size(1)}, q[i].options().dtype(at::kFloat));
          io[i].max_logit = max_logits[i].data_ptr<float>();
        }
      }
      ws = workspace(t, false, q[0]);
    });
    translated([&] {
      impl->forward(type, io, ws.data_ptr(), static_cast<std::size_t>(ws.numel()),
                    reinterpret_cast<void*>(stream));
    });
    return {outs, lses, max_logits};
  }

  //! dq, dk, dv of every rank here (given or made).
  std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
  backward(const std::vector<at::Tensor>& q, const std::vector<at::Tensor>& k,
           const std::vector<at::Tensor>& v, const std::vector<at::Tensor>& out,
           const std::vector<at::Tensor>& lse, const std::vector<at::Tensor>& dout,
           std::optional<std::vector<at::Tensor>> dq, std::optional<std::vector<at::Tensor>> dk,
           std::optional<std::vector<at::Tensor>> dv, std::int64_t stream) {
    std::vector<at::Tensor> dqs, dks, dvs;
    std::vector<backward_io> io;
    at::Tensor ws;
    const element_type type = prepared(true, q, [&](element_type t) {
      const std::size_t n = check_count(q.size(), "q");
      check_count(k.size(), "k"), check_count(v.size(), "v"), check_count(out.size(), "out");
      check_count(lse.size(), "lse"), check_count(dout.size(), "dout");
      dqs.resize(n), dks.resize(n), dvs.resize(n), io.resize(n);
      for (std::size_t i = 0; i < n; ++i) {
        check(q[i], q[0], "q"), check(k[i], q[0], "k"), check(v[i], q[0], "v");
        check(out[i], q[0], "out"), check(dout[i], q[0], "dout");
        check_lse(lse[i], q[i]);
        dqs[i] = given(dq, i, "dq", q[0], q[i].sizes().vec());
        dks[i] = given(dk, i, "dk", q[0], k[i].sizes().vec());
        dvs[i] = given(dv, i, "dv", q[0], v[i].sizes().vec());
        io[i] = {view_of(q[i]),
                 view_of(k[i]),
                 view_of(v[i]),
                 view_of(out[i]),
                 lse[i].data_ptr<float>(),
                 view_of(dout[i]),
                 view_of(dqs[i]),
                 view_of(dks[i]),
                 view_of(dvs[i])};
      }
      ws = workspace(t, true, q[0]);
    });
    translated([&] {
      impl->backward(type, io, ws.data_ptr(), static_cast<std::size_t>(ws.numel()),
                     reinterpret_cast<void*>(stream));
    });
    return {dqs, dks, dvs};
  }

  std::unique_ptr<plan> impl;

private:
  //! Runs the bindings' checks and allocations (`body`, given the element type); where they
  //! fail, the call is refused through the ring so that no peer waits for this rank.
  template <class Body>
  element_type prepared(bool backward, const std::vector<at::Tensor>& q, Body&& body) {
    element_type type = element_type::bf16;
    std::string problem;
    try {
      if (q.empty()) bad("q: no tensors");
      if (!q[0].defined()) bad("q is undefined");
      type = element_of(q[0], "q");
      if (impl->device() >= 0 && type == element_type::f32)
        bad("the device path takes float16 or bfloat16 tensors (got float32)");
      body(type);
    } catch (const c10::Error& e) {
      problem = e.msg();
    }
    if (!problem.empty()) {
      const std::string prefix = "ringattn: ";
      if (problem.starts_with(prefix)) problem.erase(0, prefix.size());
      translated([&] { impl->refuse(type, backward, problem); });
    }
    return type;
  }
  std::size_t check_count(std::size_t got, const char* name) const {
    if (got != static_cast<std::size_t>(impl->ranks_here()))
      bad(std::string(name) + ": this ring runs " + std::to_string(impl->ranks_here()) +
          " rank(s) here and takes one tensor per rank, got " + std::to_string(got));
    return got;
  }
  at::Device device_here() const { return device_of(impl->device()); }
  void check(const at::Tensor& t, const at::Tensor& first, const char* name) const {
    check_tensor(t, first, name, device_here(), "ring");
  }
  void check_lse(const at::Tensor& l, const at::Tensor& q) const {
    if (!l.defined() || l.device() != device_here() || l.scalar_type() != at::kFloat ||
        l.dim() != 2 || l.size(0) != q.size(1) || l.size(1) != q.size(0) || !l.is_contiguous())
      bad("lse must be a contiguous float32 [q_heads, tokens] tensor on " + device_here().str() +
          " ([" + std::to_string(q.size(1)) + ", " + std::to_string(q.size(0)) + "])");
  }
  at::Tensor given(const std::optional<std::vector<at::Tensor>>& list, std::size_t i,
                   const char* name, const at::Tensor& like,
                   std::vector<std::int64_t> shape) const {
    if (!list) return at::empty(shape, like.options());
    check_count(list->size(), name);
    const at::Tensor& t = (*list)[i];
    check(t, like, name);
    if (t.sizes().vec() != shape) bad(std::string(name) + " has the wrong shape");
    return t;
  }
  at::Tensor given_lse(const std::optional<std::vector<at::Tensor>>& list, std::size_t i,
                       const at::Tensor& q) const {
    if (!list) return at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
    check_count(list->size(), "lse");
    check_lse((*list)[i], q);
    return (*list)[i];
  }
  at::Tensor workspace(element_type type, bool backward, const at::Tensor& like) const {
    const std::size_t bytes = translated([&] { return impl->workspace_bytes(type, backward); });
    return at::empty({static_cast<std::int64_t>(bytes)}, like.options().dtype(at::kByte));
  }
};

//! The steps of a sharded decode for the ranks this process runs (one, or every virtual rank).
struct Decoder : torch::CustomClassHolder {
  explicit Decoder(std::unique_ptr<decoder> d) : impl(std::move(d)) {}

  std::int64_t ranks_here() const { return impl->ranks_here(); }
  std::int64_t size() const { return impl->size(); }
  std::int64_t first_rank() const { return impl->first_rank(); }
  std::int64_t device() const { return impl->device(); }
  std::int64_t bytes_sent() const { return static_cast<std::int64_t>(impl->bytes_sent()); }

  //! One step, planned from its caches and run; returns every rank's out and lse.
  //! `q`, `k`, `v`: the new tokens (`cu_new`), the same on every rank. `k_cache`, `v_cache`: one
  //! cache shard per rank here, `[rows, kv_heads, dim]`, or a pool of pages
  //! `[pages, page_size, kv_heads, dim]` where `page_tables` holds one integer CPU tensor
  //! `[batch, pages per sequence]` per rank here. `lengths`: each rank's cached tokens per
  //! sequence, rank after rank; `begins` likewise the row each starts at (empty: packed in
  //! order). `problem`: a refusal the caller found, raised here while the peers learn of it.
  std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>>
  step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
       const std::vector<at::Tensor>& k_cache, const std::vector<at::Tensor>& v_cache,
       const std::vector<std::int64_t>& cu_new, const std::vector<std::int64_t>& lengths,
       const std::vector<std::int64_t>& begins, const std::vector<at::Tensor>& page_tables,
       std::int64_t stream, const std::string& problem) {
    const auto n = static_cast<std::size_t>(impl->ranks_here());
    element_type type = element_type::bf16;
    std::vector<std::int32_t> cu;
    std::vector<cache_shard> shards(n);
    std::vector<decode_io> io(n);
    std::vector<at::Tensor> outs(n), lses(n), tables(n);
    refused(type, false, [&] {
      if (!problem.empty()) bad(problem);
      if (!q.defined()) bad("q is undefined");
      type = element_of(q, "q");
      if (impl->device() >= 0 && type == element_type::f32)
        bad("the device path takes float16 or bfloat16 tensors (got float32)");
      const at::Device here = device_of(impl->device());
      check_tensor(q, q, "q", here, "decoder"), check_tensor(k, q, "k", here, "decoder");
      check_tensor(v, q, "v", here, "decoder");
      cu = cu_seqlens_of(cu_new, "cu_new");
      if (cu.size() < 2) bad("cu_new must hold batch + 1 offsets");
      const std::size_t batch = cu.size() - 1;
      count(k_cache.size(), n, "k_cache", "rank here");
      count(v_cache.size(), n, "v_cache", "rank here");
      count(lengths.size(), n * batch, "lengths", "sequence of each rank here");
      if (!begins.empty()) count(begins.size(), n * batch, "begins", "sequence of each rank here");
      const bool paged = !page_tables.empty();
      if (paged) count(page_tables.size(), n, "page_tables", "rank here");
      if (paged && !begins.empty()) bad("a paged cache takes page tables, not begins");
      for (std::size_t i = 0; i < n; ++i) {
        cache_shard& c = shards[i];
        c.length = int32s(lengths, i * batch, batch, "lengths");
        view kc, vc;
        if (paged) {
          kc = pool_of(k_cache[i], q, here, "k_cache"),
          vc = pool_of(v_cache[i], q, here, "v_cache");
          if (k_cache[i].size(0) != v_cache[i].size(0) || k_cache[i].size(1) != v_cache[i].size(1))
            bad("k_cache and v_cache must be pools of the same pages");
          c.page_size = static_cast<std::int32_t>(k_cache[i].size(1));
          c.pages = k_cache[i].size(0);
          page_table_of(page_tables[i], c, batch, tables[i]);
        } else {
          check_tensor(k_cache[i], q, "k_cache", here, "decoder");
          check_tensor(v_cache[i], q, "v_cache", here, "decoder");
          if (k_cache[i].size(0) != v_cache[i].size(0))
            bad("k_cache and v_cache must hold the same rows");
          kc = view_of(k_cache[i]), vc = view_of(v_cache[i]);
          c.rows = k_cache[i].size(0);
          if (!begins.empty()) {
            c.begin = int32s(begins, i * batch, batch, "begins");
          } else {
            std::int64_t row = 0;
            for (std::int32_t m : c.length) {
              if (row > INT32_MAX) bad("the packed cache exceeds 2^31 rows");
              c.begin.push_back(static_cast<std::int32_t>(row));
              row += m;
            }
          }
        }
        outs[i] = at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
        lses[i] = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
        io[i] = {view_of(q),
                 view_of(k),
                 view_of(v),
                 kc,
                 vc,
                 view_of(outs[i]),
                 lses[i].data_ptr<float>()};
      }
    });
    translated([&] { impl->plan(cu, shards); });
    at::Tensor ws;
    refused(type, true, [&] {
      const std::size_t bytes = translated([&] { return impl->workspace_bytes(type); });
      ws = at::empty({static_cast<std::int64_t>(bytes)}, q.options().dtype(at::kByte));
    });
    translated([&] {
      impl->step(type, io, ws.data_ptr(), static_cast<std::size_t>(ws.numel()),
                 reinterpret_cast<void*>(stream));
    });
    return {outs, lses};
  }

  std::unique_ptr<decoder> impl;

private:
  //! Runs the bindings' part of a call (`body`); where it fails, the plan (`in_step` false) or
  //! the step is refused through the decoder so that no peer waits for this rank.
  template <class Body>
  void refused(const element_type& type, bool in_step, Body&& body) {
    std::string problem;
    try {
      body();
    } catch (const c10::Error& e) {
      problem = e.msg();
    }
    if (problem.empty()) return;
    const std::string prefix = "ringattn: ";
    while (problem.starts_with(prefix))
      problem.erase(0, prefix.size());
    translated([&] { impl->refuse(type, in_step, problem); });
  }
  //! That `name` holds `want` entries, one per `each` ("rank here", "sequence of each rank here").
  static void count(std::size_t got, std::size_t want, const char* name, const char* each) {
    if (got != want)
      bad(std::string(name) + " takes one entry per " + each + ": " + std::to_string(want) +
          ", got " + std::to_string(got));
  }
  static std::vector<std::int32_t> int32s(const std::vector<std::int64_t>& all, std::size_t from,
                                          std::size_t n, const char* name) {
    std::vector<std::int32_t> out(n);
    for (std::size_t b = 0; b < n; ++b) {
      const std::int64_t x = all[from + b];
      if (x < 0 || x > INT32_MAX)
        bad(std::string(name) + " entry " + std::to_string(x) + " is outside [0, 2^31)");
      out[b] = static_cast<std::int32_t>(x);
    }
    return out;
  }
  //! A page pool `[pages, page_size, kv_heads, dim]` as its rows.
  static view pool_of(const at::Tensor& t, const at::Tensor& q, at::Device here, const char* name) {
    if (!t.defined() || t.dim() != 4)
      bad(std::string(name) + " of a paged cache must be [pages, page_size, kv_heads, dim]");
    check_tensor(t.select(1, 0), q, name, here, "decoder");
    if (t.size(0) > 1 && t.stride(0) != t.size(1) * t.stride(1))
      bad(std::string(name) + "'s pages must follow each other in memory (stride(0) == "
                              "page_size * stride(1))");
    return {t.data_ptr(),
            t.size(0) * t.size(1),
            static_cast<std::int32_t>(t.size(2)),
            static_cast<std::int32_t>(t.size(3)),
            t.stride(1),
            t.stride(2)};
  }
  //! Sequence b's pages are row b of the table `[batch, width]`, read in place where it is a
  //! contiguous int32 tensor (else through the int32 copy `held`, which the step keeps; int64
  //! entries beyond int32 become its limits, outside any pool); entries past a sequence's pages
  //! are not read. The library checks the pages a step reads.
  static void page_table_of(const at::Tensor& t, cache_shard& c, std::size_t batch,
                            at::Tensor& held) {
    if (!t.defined() || t.device() != at::Device(at::kCPU) || t.dim() != 2 ||
        (t.scalar_type() != at::kInt && t.scalar_type() != at::kLong) ||
        t.size(0) != static_cast<std::int64_t>(batch))
      bad("a page table is an int32 or int64 CPU tensor [batch, pages per sequence] ([" +
          std::to_string(batch) + ", *])");
    if (t.numel() > INT32_MAX) bad("a page table of more than 2^31 entries");
    held = (t.scalar_type() == at::kLong ? t.clamp(INT32_MIN, INT32_MAX) : t)
               .to(at::kInt)
               .contiguous();
    const auto width = static_cast<std::int32_t>(held.size(1));
    c.cu_pages.resize(batch + 1);
    for (std::size_t b = 0; b <= batch; ++b)
      c.cu_pages[b] = static_cast<std::int32_t>(b) * width;
    c.page_table = {held.data_ptr<std::int32_t>(), static_cast<std::size_t>(held.numel())};
  }
};

namespace {

c10::intrusive_ptr<Endpoint> nccl_endpoint_op(const at::Tensor& id, std::int64_t size,
                                              std::int64_t rank, std::int64_t device,
                                              std::int64_t timeout_ms) {
  if (id.scalar_type() != at::kByte || id.dim() != 1 || id.device() != at::Device(at::kCPU))
    bad("the NCCL unique id is a 1-D uint8 CPU tensor");
  const at::Tensor bytes = id.contiguous();
  return c10::make_intrusive<Endpoint>(translated([&] {
    return make_nccl_endpoint(
        {bytes.data_ptr<std::uint8_t>(), static_cast<std::size_t>(bytes.numel())},
        static_cast<int>(size), static_cast<int>(rank), static_cast<int>(device), timeout_ms);
  }));
}

c10::intrusive_ptr<Endpoint> group_endpoint_op(const std::string& group_name,
                                               std::int64_t timeout_ms) {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(group_name);
  } catch (const std::exception& e) {
    bad("no process group named '" + group_name + "': " + e.what());
  }
  return c10::make_intrusive<Endpoint>(make_group_endpoint(std::move(group), timeout_ms));
}

at::Tensor nccl_unique_id_op() {
  const std::vector<std::uint8_t> id = translated([] { return nccl_unique_id(); });
  at::Tensor t = at::empty({static_cast<std::int64_t>(id.size())}, at::kByte);
  std::copy(id.begin(), id.end(), t.data_ptr<std::uint8_t>());
  return t;
}

c10::intrusive_ptr<Plan> plan_op(const std::optional<c10::intrusive_ptr<Endpoint>>& ep,
                                 std::int64_t virtual_ranks, std::int64_t device,
                                 const std::string& partitioner, const std::string& mask,
                                 const std::string& schedule, const std::string& kernel,
                                 const std::string& element, const std::vector<std::int64_t>& dims,
                                 const std::vector<std::int64_t>& window, double softmax_scale,
                                 const std::vector<std::int64_t>& cu_seqlens) {
  const layout l = layout_of(partitioner, mask, schedule, kernel, element, dims, window,
                             softmax_scale, cu_seqlens);
  return c10::make_intrusive<Plan>(translated([&]() -> std::unique_ptr<plan> {
    if (ep) {
      const auto& e = (*ep)->impl;
      return e->device() >= 0 ? make_device_plan(l, e) : make_host_plan(l, e);
    }
    if (virtual_ranks < 1) bad("virtual_ranks must be at least 1");
    return device >= 0 ? make_virtual_device_plan(l, static_cast<int>(virtual_ranks),
                                                  static_cast<int>(device))
                       : make_virtual_host_plan(l, static_cast<int>(virtual_ranks));
  }));
}

c10::intrusive_ptr<Decoder> decoder_op(const std::optional<c10::intrusive_ptr<Endpoint>>& ep,
                                       std::int64_t virtual_ranks, std::int64_t device,
                                       const std::vector<std::int64_t>& dims,
                                       double softmax_scale) {
  if (dims.size() != 4) bad("dims are [q_heads, kv_heads, head_dim, head_dim_v]");
  for (std::int64_t d : dims)
    if (d < 0 || d > INT32_MAX) bad("a head count or width of " + std::to_string(d));
  ringattn::attention_arguments args;
  args.q_heads = static_cast<std::int32_t>(dims[0]);
  args.kv_heads = static_cast<std::int32_t>(dims[1]);
  args.head_dim = static_cast<std::int32_t>(dims[2]);
  args.head_dim_v = static_cast<std::int32_t>(dims[3]);
  args.softmax_scale = static_cast<float>(softmax_scale);
  return c10::make_intrusive<Decoder>(translated([&]() -> std::unique_ptr<decoder> {
    if (ep) {
      const auto& e = (*ep)->impl;
      return e->device() >= 0 ? make_device_decoder(args, e) : make_host_decoder(args, e);
    }
    if (virtual_ranks < 1) bad("virtual_ranks must be at least 1");
    return device >= 0 ? make_virtual_device_decoder(args, static_cast<int>(virtual_ranks),
                                                     static_cast<int>(device))
                       : make_virtual_host_decoder(args, static_cast<int>(virtual_ranks));
  }));
}

//! A per-token layout answer (`of`: token_indices or position_ids) for rank `rank` of `ranks`, as
//! an int64 CPU tensor.
template <class Of>
at::Tensor layout_tensor(Of of, const std::string& partitioner,
                         const std::vector<std::int64_t>& cu_seqlens, std::int64_t ranks,
                         std::int64_t rank) {
  const auto cu = cu_seqlens_of(cu_seqlens);
  const auto values = translated([&] {
    return of(partitioner_of(partitioner), cu, static_cast<int>(ranks), static_cast<int>(rank));
  });
  at::Tensor t = at::empty({static_cast<std::int64_t>(values.size())}, at::kLong);
  std::copy(values.begin(), values.end(), t.data_ptr<std::int64_t>());
  return t;
}

at::Tensor token_indices_op(const std::string& partitioner,
                            const std::vector<std::int64_t>& cu_seqlens, std::int64_t ranks,
                            std::int64_t rank) {
  return layout_tensor(&token_indices, partitioner, cu_seqlens, ranks, rank);
}

at::Tensor position_ids_op(const std::string& partitioner,
                           const std::vector<std::int64_t>& cu_seqlens, std::int64_t ranks,
                           std::int64_t rank) {
  return layout_tensor(&position_ids, partitioner, cu_seqlens, ranks, rank);
}

bool has_device_path_op() { return has_device_path(); }
bool has_cudnn_kernel_op() { return has_cudnn_kernel(); }

} // namespace

} // namespace ringattn_torch

TORCH_LIBRARY(ringattn, m) {
  using namespace ringattn_torch;
  m.class_<Endpoint>("Endpoint")
      .def("rank", &Endpoint::rank)
      .def("size", &Endpoint::size)
      .def("device", &Endpoint::device)
      .def("bytes_sent", &Endpoint::bytes_sent);
  m.class_<Plan>("Plan")
      .def("ranks_here", &Plan::ranks_here)
      .def("size", &Plan::size)
      .def("first_rank", &Plan::first_rank)
      .def("device", &Plan::device)
      .def("bytes_sent", &Plan::bytes_sent)
      .def("local_tokens", &Plan::local_tokens)
      .def("forward", &Plan::forward)
      .def("backward", &Plan::backward);
  m.class_<Decoder>("Decoder")
      .def("ranks_here", &Decoder::ranks_here)
      .def("size", &Decoder::size)
      .def("first_rank", &Decoder::first_rank)
      .def("device", &Decoder::device)
      .def("bytes_sent", &Decoder::bytes_sent)
      .def("step", &Decoder::step);
  m.def("nccl_unique_id", &nccl_unique_id_op);
  m.def("nccl_endpoint", &nccl_endpoint_op);
  m.def("group_endpoint", &group_endpoint_op);
  m.def("plan", &plan_op);
  m.def("decoder", &decoder_op);
  m.def("token_indices", &token_indices_op);
  m.def("position_ids", &position_ids_op);
  m.def("has_device_path", &has_device_path_op);
  m.def("has_cudnn_kernel", &has_cudnn_kernel_op);
}
