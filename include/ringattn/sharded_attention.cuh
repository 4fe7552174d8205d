#pragma once
//! \file
//! `sharded_attention<Communicator, BlockKernel>`: attention of new query tokens over a KV cache
//! sharded across ranks — decoding, or a prefill chunk, after a context-parallel prefill.
//!
//! Every rank holds the K/V of the cached tokens it owns (after a prefill: its partitioner's
//! shard; new tokens go to `owner_of(position, ranks)`, position mod P) and the same new tokens
//! on every rank: their queries, keys and values (`[new tokens, heads, head_dim]`, v and the
//! output `head_dim_v` wide; a packed batch of sequences, `cu_new`). Per sequence every new token
//! sees every cached token (the cache holds the positions before it) and the new tokens up to its
//! own (causal).
//!
//! A step: each rank attends with all new queries to its cache shard (a full block per sequence;
//! rank 0 also to the new tokens themselves, causally) into a partial fp32 state (o, reference
//! lse and weight sum per row, core/state.cuh), finished into a partial of the output's element
//! type (the normalised output `[q_heads x new tokens, head_dim_v]` and an fp32 lse per row); the
//! ranks exchange those (P - 1 pairwise exchanges of `step_bytes<T>() / (P - 1)` bytes each: in
//! exchange k rank r sends to r + k and receives from r - k) and every rank merges all P in rank
//! order (`merge_finished`). Every rank thus ends with the same result, bit for bit, equal to
//! attention over the whole cache.
//!
//! The facade includes no BlockKernel: include the model it names (`block_kernel.cuh` for
//! `ra::causal` below) or `ringattn.cuh`.
//!
//! \code
//! namespace ra = ringattn;
//! ra::sharded_attention<ra::in_process_communicator, ra::causal> step(comm, args); // collective
//! step.plan(cu_new, cu_cache);   // collective, every step: new tokens, this rank's cached ones
//! std::vector<std::byte> ws(step.host_workspace_bytes<__nv_bfloat16>());
//! step.forward_host(q_new, k_new, v_new, k_cache, v_cache, out, lse, ws);
//! // then each rank appends the K/V of owned_new_rows(rank, ranks, cu_new, lengths) to its cache
//! \endcode
//!
//! The cache shard is `[cached tokens, kv_heads, head_dim]` (v: `head_dim_v`), its sequences packed
//! in order
//! (`cu_cache`, this rank's own offsets); a sequence may have no cached token on a rank. The
//! device path (`prepare_device` once, `plan` per step, `forward` on a stream) computes on the
//! caller's stream and exchanges on a communication stream; a call allocates nothing and never
//! waits on the host. `plan` makes the BlockKernel's schedules of the step (their tables in device
//! memory the decoder reuses: no allocation once warm) and is collective: it is where the ranks
//! agree on the step.

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/block/device/host_forward.cuh>
#include <ringattn/block/device/state_ops.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/core/kv_scales.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/device_tables.cuh>
#include <ringattn/detail/streams.cuh>
#include <ringattn/error.cuh>
#include <ringattn/ring/agreement.cuh>
#include <ringattn/ring/call.cuh>
#include <ringattn/ring/device_engine.cuh>
#include <ringattn/ring/program.cuh>
#include <ringattn/ring/validation.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringattn {

//! The rank that keeps a new token's K/V: its position in the sequence modulo the rank count.
//! Throws `invalid_argument` for a negative position or no ranks.
constexpr int owner_of(std::int64_t position, int ranks) {
  if (ranks <= 0 || position < 0)
    throw invalid_argument("ringattn: owner_of(" + std::to_string(position) + ", " +
                           std::to_string(ranks) +
                           "): a position is at least 0 and there is at least one rank");
  return static_cast<int>(position % ranks);
}

//! The rows of the new tokens (`cu_new`, batch + 1 offsets) that rank `rank` of `ranks` keeps:
//! row `cu_new[b] + i` of sequence b sits at position `lengths[b] + i` (its sequence's length
//! before this step, over all ranks), kept by `owner_of` that position. In row order; a caller
//! appends these rows' K/V to its cache shard after the step.
inline std::vector<std::int64_t> owned_new_rows(int rank, int ranks,
                                                std::span<const std::int32_t> cu_new,
                                                std::span<const std::int64_t> lengths) {
  validation v = validation::ok();
  v.require(ranks > 0 && rank >= 0 && rank < ranks, "rank ", rank, " is not one of ", ranks);
  v.require(cu_new.size() >= 1 && lengths.size() + 1 == cu_new.size(),
            "lengths must hold one entry per sequence of cu_new (", cu_new.size() - 1, ")");
  v.require(cu_new.empty() || cu_new.front() == 0, "cu_new must start at 0");
  for (std::size_t b = 0; v && b < lengths.size(); ++b) {
    v.require(cu_new[b + 1] >= cu_new[b], "cu_new must not decrease (sequence ", b, ")");
    v.require(lengths[b] >= 0, "sequence ", b, " has a negative length (", lengths[b], ")");
  }
  v.throw_if_invalid();
  std::vector<std::int64_t> rows;
  for (std::size_t b = 0; b < lengths.size(); ++b)
    for (std::int64_t t = cu_new[b]; t < cu_new[b + 1]; ++t)
      if (owner_of(lengths[b] + (t - cu_new[b]), ranks) == rank) rows.push_back(t);
  return rows;
}

namespace detail {

//! The split-K/V schedule of a BlockKernel that has one (else an empty type).
template <class BlockKernel>
struct split_schedule_of {
  struct none {};
  using type = none;
};
template <class BlockKernel>
requires split_kv_block_kernel_for<BlockKernel, cudaStream_t>
struct split_schedule_of<BlockKernel> {
  using type = typename BlockKernel::split_schedule;
};

//! The steps a BlockKernel's split-K/V kernel takes, as its `split_shapes` states them.
template <class BlockKernel>
constexpr const char* split_shapes_of() {
  if constexpr (requires { BlockKernel::split_shapes; })
    return BlockKernel::split_shapes;
  else
    return "the shapes this BlockKernel's split kernel accepts";
}

//! A device BlockKernel whose split-K/V forward reads an FP8 cache (`fp8_e4m3` with `Scales`)
//! for steps of element type T.
template <class K, class T, class Scales>
concept reads_fp8_cache = split_kv_block_kernel_for<K, cudaStream_t> &&
    requires(const block_forward_args<T>& a, thd_view<const fp8_e4m3> c, Scales s,
             const typename K::split_schedule& ss, cudaStream_t stream) {
  K::device_split_forward(a, c, c, s, ss, true, stream);
};

//! The device side of a `sharded_attention`: the communication stream, two events, and the
//! BlockKernel's schedules of the planned step (the cache block, the new tokens' own block).
//! Schedules alternate between two generations, each with its own table pool: planning a step
//! reuses the tables of the step planned two before, once that step's last forward has finished
//! on the device (a host wait only while the device is more than a step behind), so a plan that
//! repeats makes no device allocation. Their copies run on the pool's stream; a forward waits
//! for them on the device (`generation::pool.uploaded()`).
//! Fixed to the steps' stream (`fix`), one generation serves every plan: its tables keep their
//! addresses and are copied on that stream, in order with the steps, and the split schedule's
//! launch is `split_launch::fixed`, so that a step captured in a CUDA graph replays later plans.
template <class BlockKernel>
class decode_device_resources {
  static constexpr bool has_split = split_kv_block_kernel_for<BlockKernel, cudaStream_t>;
  static constexpr bool has_paged_split =
      has_split && requires(std::span<const block_group> groups, const attention_arguments& args,
                            const key_pages& pages) {
    {
      BlockKernel::make_split_schedule(groups, 0, 0, args, pages)
      } -> std::same_as<typename split_schedule_of<BlockKernel>::type>;
  };

public:
  //! Whether the BlockKernel plans split schedules of a fixed launch (`fix`).
  static constexpr bool has_fixed_split =
      has_paged_split && requires(std::span<const block_group> groups,
                                  const attention_arguments& args, const key_pages& pages) {
    BlockKernel::make_split_schedule(groups, 0, 0, args, split_launch::fixed);
    BlockKernel::make_split_schedule(groups, 0, 0, args, pages, split_launch::fixed);
  };

  struct generation {
    table_pool pool;     // before the schedules: they give their tables back to it
    ordering_event done; // recorded after each forward on these schedules
    std::vector<typename BlockKernel::forward_schedule> cache; // the cache block, round by round
    std::optional<typename BlockKernel::forward_schedule> own;
    std::optional<typename split_schedule_of<BlockKernel>::type> split; // the cache block, split
  };

  //! Plans from now on copy their tables on `stream` into fixed places (see the class notes).
  //! Before the first plan.
  void fix(cudaStream_t stream) {
    fixed_ = stream;
    generations_[0].pool.fix(stream);
    current_ = 0;
  }
  //! The stream given to `fix`, or null.
  std::optional<cudaStream_t> fixed() const noexcept { return fixed_; }

  //! The step's schedules, on the device the resources live on. The cache block goes to the
  //! BlockKernel's split-K/V forward where it has one and takes the block (few query rows per
  //! sequence: decoding): `split_groups` over the cache rows, or over the rows of `pages` (a
  //! paged cache) where the kernel reads through a page table. Otherwise the block forward runs
  //! the rounds `cache_rounds()` returns one after the other (a paged cache: runs of consecutive
  //! pool rows). Fixed (`fix`), the split forward must take the block (the caller checks).
  template <class Rounds>
  void schedule(Rounds&& cache_rounds, std::span<const block_group> split_groups,
                const key_pages* pages, std::span<const block_group> new_groups,
                std::int64_t new_tokens, std::int64_t cache_tokens,
                const attention_arguments& args) {
    if (!fixed_) current_ ^= 1;
    generation& g = generations_[current_];
    if (!fixed_) RINGATTN_CUDA_CHECK(cudaEventSynchronize(g.done));
    g.cache.clear();
    g.own.reset();
    g.split.reset();
    g.pool.begin();
    const table_pool::use from(g.pool);
    const split_launch launch = fixed_ ? split_launch::fixed : split_launch::fitted;
    if (!split_groups.empty()) {
      if constexpr (has_paged_split) {
        if (pages && BlockKernel::takes_split(split_groups, args)) {
          const std::int64_t rows =
              static_cast<std::int64_t>(pages->table.size()) * pages->page_size;
          if constexpr (has_fixed_split)
            g.split.emplace(BlockKernel::make_split_schedule(split_groups, new_tokens, rows, args,
                                                             *pages, launch));
          else
            g.split.emplace(
                BlockKernel::make_split_schedule(split_groups, new_tokens, rows, args, *pages));
        }
      }
      if constexpr (has_split) {
        if (!pages && BlockKernel::takes_split(split_groups, args)) {
          if constexpr (has_fixed_split)
            g.split.emplace(BlockKernel::make_split_schedule(split_groups, new_tokens, cache_tokens,
                                                             args, launch));
          else
            g.split.emplace(
                BlockKernel::make_split_schedule(split_groups, new_tokens, cache_tokens, args));
        }
      }
    }
    if (!g.split && !split_groups.empty()) {
      const std::vector<std::vector<block_group>>& rounds = cache_rounds();
      g.cache.reserve(rounds.size());
      for (const auto& round : rounds)
        if (!round.empty())
          g.cache.push_back(
              BlockKernel::make_forward_schedule(round, new_tokens, cache_tokens, args));
    }
    if (!new_groups.empty())
      g.own.emplace(BlockKernel::make_forward_schedule(new_groups, new_tokens, new_tokens, args));
    // The tables' copies, enqueued as each schedule was made: a forward waits for them on the
    // device. (A schedule that throws leaves its predecessors' copies pending: the staging they
    // read is reused only after the next plan's `begin` has waited for them.)
    g.pool.finish();
    if (!g.pool.fits()) // the caller keeps a fixed step's shapes: its tables keep their sizes
      throw std::logic_error("ringattn: a fixed decode step's tables outgrew their places");
  }
  //! The planned step's schedules.
  generation& now() noexcept { return generations_[current_]; }
  const generation& now() const noexcept { return generations_[current_]; }
  //! Device scratch the schedules ask for (0 for a model that asks for none).
  std::size_t scratch_bytes() const {
    const generation& g = now();
    std::size_t most = 0;
    if constexpr (requires(const typename BlockKernel::forward_schedule& f) {
                    { f.scratch_bytes() } -> std::convertible_to<std::size_t>;
                  }) {
      for (const auto& f : g.cache)
        most = std::max<std::size_t>(most, f.scratch_bytes());
      if (g.own) most = std::max<std::size_t>(most, g.own->scratch_bytes());
    }
    if constexpr (has_split)
      if (g.split) most = std::max<std::size_t>(most, g.split->scratch_bytes());
    return most;
  }

  comm_stream comm; // comm.device(): the device the resources live on
  ordering_event computed, arrived;

private:
  generation generations_[2];
  int current_ = 0;
  std::optional<cudaStream_t> fixed_;
};

} // namespace detail

//! A paged K/V cache shard (`sharded_attention::plan(cu_new, paged_cache)`): k_cache and v_cache
//! are a pool of `pages` pages of `page_size` token rows (`[pages * page_size, kv_heads,
//! head_dim]`); sequence b's `cache_length[b]` cached tokens fill its pages in order, listed in
//! `page_table[cu_pages[b] .. cu_pages[b + 1])`: token j is pool row
//! `page_table[cu_pages[b] + j / page_size] * page_size + j % page_size`. Pages past a sequence's
//! last token (its room to grow) are not read, and sequences may share pages (a common prefix).
//! The page allocator is the caller's; a new token is appended into its owner rank's pool.
struct paged_cache {
  std::int32_t page_size = 0;                 //!< a power of two from 16 to 256
  std::int64_t pages = 0;                     //!< pages in the pool
  std::span<const std::int32_t> cu_pages;     //!< batch + 1 offsets into page_table
  std::span<const std::int32_t> page_table;   //!< pool pages of each sequence, in token order
  std::span<const std::int32_t> cache_length; //!< cached tokens of each sequence on this rank
};

//! `sharded_attention::prepare_device(graph_steps{stream})`: every step runs on `stream`, and a
//! step captured there in a CUDA graph replays the steps planned after it (see `prepare_device`).
struct graph_steps {
  cudaStream_t stream = nullptr;
};

template <class Communicator, class BlockKernel>
class sharded_attention {
  static_assert(host_communicator<Communicator>,
                "ringattn::sharded_attention: the first template argument must be a "
                "Communicator (ringattn::in_process_communicator, ringattn::mpi_communicator or "
                "ringattn::nccl_communicator)");
  static_assert(block_kernel<BlockKernel>,
                "ringattn::sharded_attention: the second template argument must be a BlockKernel "
                "(ringattn::causal, ringattn::cudnn_kernel<ringattn::causal_mask, T> or "
                "ringattn::host_reference<ringattn::causal_mask>)");
  static_assert(BlockKernel::mask == mask_kind::causal,
                "ringattn::sharded_attention: new tokens attend to the cache and causally to "
                "each other; take a causal BlockKernel");

public:
  //! Collective: every rank of `comm` constructs one with the same arguments (else every rank
  //! throws `invalid_argument`, naming the difference).
  sharded_attention(Communicator& comm, const attention_arguments& args)
      : comm_(comm), args_(args), fingerprint_(agree(comm, args)), gate_(comm, fingerprint_, 0) {}

  //! Plans a step: `cu_new` (batch + 1 offsets, the same on every rank) packs the new tokens,
  //! `cu_cache` (batch + 1 offsets) this rank's cached tokens of the same sequences, packed.
  //! Collective: every rank plans every step (one small all-gather); a rank whose offsets are
  //! invalid, or whose `cu_new` differs from rank 0's, makes every rank throw `invalid_argument`.
  //! After `prepare_device()` it also makes the step's device schedules.
  void plan(std::span<const std::int32_t> cu_new, std::span<const std::int32_t> cu_cache) {
    validation v = validation::ok();
    v.require(cu_cache.size() >= 1, "cu_cache must hold batch + 1 offsets");
    v.require(cu_cache.empty() || cu_cache.front() == 0, "cu_cache must start at 0");
    std::vector<std::int32_t> begin, length;
    for (std::size_t b = 0; v && b + 1 < cu_cache.size(); ++b) {
      // In 64 bits: offsets that decrease are refused, never subtracted into an overflow.
      const std::int64_t n = static_cast<std::int64_t>(cu_cache[b + 1]) - cu_cache[b];
      v.require(n >= 0, "cu_cache must not decrease (sequence ", b, ": ", cu_cache[b], " then ",
                cu_cache[b + 1], ")");
      begin.push_back(cu_cache[b]);
      length.push_back(v ? static_cast<std::int32_t>(n) : 0);
    }
    plan_checked(v, cu_new, begin, length, cu_cache.empty() ? 0 : cu_cache.back());
  }
  //! Plans a step over a cache of `cache_tokens` rows in which sequence b holds its
  //! `cache_length[b]` cached tokens from row `cache_begin[b]` on (rows beyond them, a
  //! sequence's room to grow, are not read): a cache that appends in place. Otherwise as above.
  void plan(std::span<const std::int32_t> cu_new, std::span<const std::int32_t> cache_begin,
            std::span<const std::int32_t> cache_length, std::int64_t cache_tokens) {
    plan_checked(validation::ok(), cu_new, cache_begin, cache_length, cache_tokens);
  }
  //! Plans a step over a paged cache shard (`paged_cache`; k_cache and v_cache of the forward are
  //! its pool, `pages x page_size` rows). Otherwise as above. The plan keeps a copy of the page
  //! table (the spans need not outlive the call). On the device the split-K/V kernel reads the
  //! pages through it (head_dim 64 or 128, at most 64 query rows per kv head); other shapes run
  //! the block forward over runs of consecutive pages, as `forward_host` does.
  void plan(std::span<const std::int32_t> cu_new, const paged_cache& cache) {
    constexpr std::int64_t most = std::numeric_limits<std::int32_t>::max();
    const bool fits =
        cache.page_size > 0 && cache.pages >= 0 && cache.pages <= most / cache.page_size;
    plan_checked(validation::ok(), cu_new, {}, cache.cache_length,
                 fits ? cache.pages * cache.page_size : 0, &cache);
  }

  //! Stands in for a `plan` (`in_step` false) or a step (`forward`, or `forward_host` where
  //! `device` is false; element type T) that this rank's caller refused before reaching it:
  //! collective like the call it replaces, so that the peers' call fails naming this rank
  //! instead of waiting for it. Throws `invalid_argument` with `reason`.
  template <element T>
  [[noreturn]] void refuse(bool in_step, bool device, const std::string& reason) {
    validation no = validation::ok();
    no.require(false, reason);
    if (in_step)
      gate_.run(no, device ? detail::call_kind::forward : detail::call_kind::forward_host,
                dtype_of_v<T>, slot_bytes<T>(), [] {});
    else
      plan_checked(no, {}, {}, {}, 0);
    throw invalid_argument("ringattn: " + reason); // not reached: the agreement throws first
  }

  const attention_arguments& arguments() const noexcept { return args_; }
  int rank() const noexcept { return comm_.rank(); }
  int size() const noexcept { return comm_.size(); }
  std::int64_t new_tokens() const noexcept { return new_tokens_; }
  std::int64_t cache_tokens() const noexcept { return cache_tokens_; }
  //! Bytes this rank sends in one step of element type T: its finished partial to each other rank
  //! (per new token and query head, head_dim_v elements of T and an fp32 lse; 16-byte aligned).
  template <element T>
  std::size_t step_bytes() const {
    return static_cast<std::size_t>(comm_.size() - 1) * slot_bytes<T>();
  }
  //! Workspace of `forward_host`: this rank's fp32 partial state and every rank's finished partial.
  template <element T>
  std::size_t host_workspace_bytes() const {
    return state_bytes() + static_cast<std::size_t>(comm_.size()) * slot_bytes<T>();
  }
  //! Workspace of `forward`: the partial states and the BlockKernel's scratch of this step.
  template <element T>
  std::size_t device_workspace_bytes() const {
    const std::size_t partials = host_workspace_bytes<T>();
    std::size_t scratch = 0;
    if constexpr (has_device_path)
      if (device_) scratch = device_->scratch_bytes();
    return scratch ? ring_workspace::align(partials) + scratch : partials;
  }

  //! Why `forward_host(...)` cannot run, or ok.
  template <element T>
  validation validate_forward(std::type_identity_t<thd_view<const T>> q_new,
                              std::type_identity_t<thd_view<const T>> k_new,
                              std::type_identity_t<thd_view<const T>> v_new,
                              std::type_identity_t<thd_view<const T>> k_cache,
                              std::type_identity_t<thd_view<const T>> v_cache, thd_view<T> out,
                              const float* lse, std::span<const std::byte> workspace) const {
    return check<T>(q_new, k_new, v_new, k_cache, v_cache, out, lse, workspace,
                    host_workspace_bytes<T>(), detail::no_device_checks);
  }

  //! One step on host memory. `q_new`, `k_new`, `v_new`: the new tokens (the same on every rank);
  //! `k_cache`, `v_cache`: this rank's cache shard; `out` like `q_new` and `lse`
  //! `[q_heads, new tokens]` (natural log) receive the same result on every rank. Collective:
  //! bad arguments on any rank make every rank throw `invalid_argument` before anything is sent.
  template <element T>
  void forward_host(std::type_identity_t<thd_view<const T>> q_new,
                    std::type_identity_t<thd_view<const T>> k_new,
                    std::type_identity_t<thd_view<const T>> v_new,
                    std::type_identity_t<thd_view<const T>> k_cache,
                    std::type_identity_t<thd_view<const T>> v_cache, thd_view<T> out, float* lse,
                    std::span<std::byte> workspace) {
    const validation ok =
        validate_forward<T>(q_new, k_new, v_new, k_cache, v_cache, out, lse, workspace);
    host_step<T>(ok, q_new, k_new, v_new, out, lse, workspace, [&](const attention_state& state) {
      for (const auto& round : cache_rounds())
        if (!round.empty())
          BlockKernel::host_forward(block_forward_args<T>{q_new, k_cache, v_cache, args_, state},
                                    round);
    });
  }

  //! One step on host memory over an FP8 cache shard: `k_cache` and `v_cache` hold e4m3
  //! elements, each read as its value times its scale in `scales` (host memory: `head_scales`,
  //! `[kv_heads]` each, or with a paged plan `page_scales`, `[pages, kv_heads]` each; see
  //! `quantize_e4m3`). The new tokens' own K/V stay in T. Otherwise as above.
  template <element T, kv_scales Scales>
  void forward_host(std::type_identity_t<thd_view<const T>> q_new,
                    std::type_identity_t<thd_view<const T>> k_new,
                    std::type_identity_t<thd_view<const T>> v_new, thd_view<const fp8_e4m3> k_cache,
                    thd_view<const fp8_e4m3> v_cache, Scales scales, thd_view<T> out, float* lse,
                    std::span<std::byte> workspace) {
    detail::ring_checks::region scale_regions[2];
    const validation ok = check<T>(
        q_new, k_new, v_new, k_cache, v_cache, out, lse, workspace, host_workspace_bytes<T>(),
        [&](validation& r) { r.require(check_scales(scales, scale_regions)); }, scale_regions);
    const int shift = paged_ ? std::countr_zero(static_cast<std::uint32_t>(pages_.page_size)) : 0;
    host_step<T>(ok, q_new, k_new, v_new, out, lse, workspace, [&](const attention_state& state) {
      for (const auto& round : cache_rounds())
        if (!round.empty())
          detail::host_block_forward_fp8(block_forward_args<T>{q_new, {}, {}, args_, state}, round,
                                         k_cache, v_cache, scales, shift);
    });
  }

private:
  // The host step once validated (`ok`): this rank's partial (the new tokens' own block, then
  // `cache_block(state)`), the exchange, the merge.
  template <element T, class CacheBlock>
  void host_step(const validation& ok, thd_view<const T> q_new, thd_view<const T> k_new,
                 thd_view<const T> v_new, thd_view<T> out, float* lse,
                 std::span<std::byte> workspace, CacheBlock&& cache_block) {
    gate_.run(ok, detail::call_kind::forward_host, dtype_of_v<T>, slot_bytes<T>(), [&] {
      const int p = comm_.size(), me = comm_.rank();
      const attention_state state = partial_state(reinterpret_cast<float*>(workspace.data()));
      std::byte* slots = workspace.data() + state_bytes();
      detail::decode_engine e{
          [&](int rank) {
            reset(state);
            if (!new_groups_.empty())
              BlockKernel::host_forward(block_forward_args<T>{q_new, k_new, v_new, args_, state},
                                        new_groups_);
            cache_block(state);
            finish_partial(state, slot_o<T>(slots, rank), slot_lse<T>(slots, rank));
          },
          [&](const detail::message& m) {
            comm_.exchange(slots + m.send_slot * slot_bytes<T>(), m.send_bytes, m.to,
                           slots + m.recv_slot * slot_bytes<T>(), m.recv_bytes, m.from, m.tag);
          },
          [&] {
            merge_finished_partials(slot_o<T>(slots, 0), slot_stride<T, T>(), slot_lse<T>(slots, 0),
                                    slot_stride<T, float>(), p, out, lse);
          }};
      detail::decode_program::step(e, me, p, q_new.tokens, slot_bytes<T>());
    });
  }

public:
  //! Device path, plan time: the communication stream and events on the current device (and the
  //! planned step's schedules, if any). Once per rank, before `forward`.
  void prepare_device() requires device_communicator_for<Communicator, cudaStream_t> {
    static_assert(has_device_path,
                  "ringattn::sharded_attention::prepare_device: this BlockKernel has no device "
                  "path (ringattn::host_reference runs on the host only; use ringattn::causal)");
    if constexpr (has_device_path) {
      if (device_) return;
      comm_.prepare_device();
      auto d = std::make_unique<device_resources>();
      if (planned_) schedule_device(*d);
      device_ = std::move(d);
    }
  }
  //! Device path, plan time, for steps replayed from a CUDA graph: as above, and every step runs
  //! on `steps.stream`, where each plan copies its tables (in order with the steps, without
  //! waiting on the host) into the same device memory plan after plan, and the split-K/V
  //! kernel's launch does not depend on the lengths (`split_launch::fixed`). A step captured on
  //! that stream (`cudaStreamBeginCapture` around `forward`) then replays every later plan's
  //! step: plan, replay, plan, replay. Each plan must keep the first plan's launch (every rank
  //! throws `invalid_argument` naming what changed, before anything is enqueued): the same
  //! `cu_new`, the same cache rows (a slab or paged cache of fixed size; a packed cache grows),
  //! the same page size, and a step the split kernel takes (head_dim 64 or 128 with v as wide,
  //! at most 64 query rows per kv head and sequence). The exchange between ranks must be
  //! capturable (NCCL's is; the in-process communicator's is not: capture one rank). Once per
  //! rank, before the first plan.
  void
  prepare_device(graph_steps steps) requires device_communicator_for<Communicator, cudaStream_t> {
    static_assert(has_graph_steps,
                  "ringattn::sharded_attention::prepare_device(graph_steps): steps replayed "
                  "from a CUDA graph run the split-K/V kernel with a fixed launch, which this "
                  "BlockKernel does not have (take ringattn::causal)");
    if constexpr (has_graph_steps) {
      validation v = validation::ok();
      v.require(!device_ && !planned_, "prepare_device(graph_steps) comes once, before the "
                                       "first plan and instead of prepare_device()");
      v.throw_if_invalid();
      comm_.prepare_device();
      auto d = std::make_unique<device_resources>();
      d->fix(steps.stream);
      device_ = std::move(d);
    }
  }

#if defined(__CUDACC__)
  //! One step on device memory, asynchronous on `stream`: the arguments of `forward_host` as
  //! device pointers, `workspace` device memory of `device_workspace_bytes<T>()`. Collective;
  //! every rank's `out` and `lse` receive the same bits. Validation as in `forward_host`, before
  //! anything is enqueued.
  template <device_element T>
  void forward(std::type_identity_t<thd_view<const T>> q_new,
               std::type_identity_t<thd_view<const T>> k_new,
               std::type_identity_t<thd_view<const T>> v_new,
               std::type_identity_t<thd_view<const T>> k_cache,
               std::type_identity_t<thd_view<const T>> v_cache, thd_view<T> out, float* lse,
               void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
    device_step<T>(q_new, k_new, v_new, k_cache, v_cache, no_scales{}, out, lse, workspace,
                   workspace_bytes, stream);
  }
  //! One step on device memory over an FP8 cache shard (`k_cache`, `v_cache` of e4m3, `scales`
  //! in device memory; see the host overload). The split-K/V kernel reads it, so the step must
  //! be one it takes (head_dim 64 or 128 with v as wide, at most 64 query rows per kv head and
  //! sequence: new tokens x query heads per kv head); else every rank throws `invalid_argument`.
  //! Otherwise as above.
  template <device_element T, kv_scales Scales>
  void forward(std::type_identity_t<thd_view<const T>> q_new,
               std::type_identity_t<thd_view<const T>> k_new,
               std::type_identity_t<thd_view<const T>> v_new, thd_view<const fp8_e4m3> k_cache,
               thd_view<const fp8_e4m3> v_cache, Scales scales, thd_view<T> out, float* lse,
               void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
    static_assert(detail::reads_fp8_cache<BlockKernel, T, Scales>,
                  "ringattn::sharded_attention::forward: an FP8 cache is read by a BlockKernel's "
                  "split-K/V forward over FP8 caches, which this BlockKernel does not have (take "
                  "ringattn::causal)");
    device_step<T>(q_new, k_new, v_new, k_cache, v_cache, scales, out, lse, workspace,
                   workspace_bytes, stream);
  }

private:
  template <device_element T, cache_element C, class Scales>
  void device_step(thd_view<const T> q_new, thd_view<const T> k_new, thd_view<const T> v_new,
                   thd_view<const C> k_cache, thd_view<const C> v_cache, Scales scales,
                   thd_view<T> out, float* lse, void* workspace, std::size_t workspace_bytes,
                   cudaStream_t stream) {
    constexpr bool quantized = !std::same_as<C, T>;
    const std::span<std::byte> ws(static_cast<std::byte*>(workspace), workspace_bytes);
    using checks = detail::ring_checks;
    checks::named_buffer buffers[] = {{q_new.data, "q_new"},
                                      {k_new.data, "k_new"},
                                      {v_new.data, "v_new"},
                                      {k_cache.data, "k_cache"},
                                      {v_cache.data, "v_cache"},
                                      {out.data, "out"},
                                      {lse, "lse"},
                                      {workspace, "the workspace"},
                                      {nullptr, "scales.k"},
                                      {nullptr, "scales.v"}};
    checks::region scale_regions[2];
    auto device = [&](validation& ok) {
      if constexpr (quantized) {
        ok.require(check_scales(scales, scale_regions));
        buffers[8].data = scales.k, buffers[9].data = scales.v;
        if (ok && device_ != nullptr)
          ok.require(device_->now().split || cache_groups_.empty(),
                     "an FP8 cache is read by the split-K/V kernel, which takes ",
                     detail::split_shapes_of<BlockKernel>(),
                     "; this step's shapes go to the block forward, which reads fp16/bf16 "
                     "caches only");
      }
      ok.require(device_ != nullptr, "prepare_device() must run before the device forward");
      if (ok) ok.require(checks::placement(device_->comm.device(), stream, buffers, "forward"));
      if constexpr (has_graph_steps)
        if (ok && device_->fixed())
          ok.require(*device_->fixed() == stream,
                     "the steps run on the stream given to prepare_device(graph_steps), where "
                     "the plans copy their tables; this forward names another");
      ok.require(rows_aligned_to(q_new, 16),
                 "q_new must be 16-byte aligned with token and head strides that are multiples "
                 "of 8 elements (the kernels load 16-byte vectors)");
      ok.require(rows_aligned_to(k_new, 16) && rows_aligned_to(v_new, 16),
                 "k_new and v_new must be 16-byte aligned with token and head strides that are "
                 "multiples of 8 elements (the kernels read them in place)");
      ok.require(rows_aligned_to(k_cache, 16) && rows_aligned_to(v_cache, 16),
                 "k_cache and v_cache must be 16-byte aligned with token and head strides that "
                 "are multiples of 16 bytes (the kernels read them in place)");
      ok.require(rows_aligned_to(out, 4), "out must be 4-byte aligned with even strides");
    };
    const validation ok =
        check<T>(q_new, k_new, v_new, k_cache, v_cache, out, lse, ws,
                 device_ ? device_workspace_bytes<T>() : 0, device, scale_regions);
    gate_.run(ok, detail::call_kind::forward, dtype_of_v<T>, slot_bytes<T>(), [&] {
      if constexpr (has_device_path)
        device_forward<T>(q_new, k_new, v_new, k_cache, v_cache, scales, out, lse, ws.data(),
                          stream);
    });
  }

public:
#endif

private:
  static constexpr bool has_device_path = device_block_kernel_for<BlockKernel, cudaStream_t>;
  using device_resources =
      std::conditional_t<has_device_path, detail::decode_device_resources<BlockKernel>,
                         detail::no_device_resources>;
  static constexpr bool has_graph_steps = [] {
    if constexpr (has_device_path)
      return detail::decode_device_resources<BlockKernel>::has_fixed_split;
    else
      return false;
  }();
  // Whether the steps are fixed for replays from a CUDA graph (`prepare_device(graph_steps)`).
  bool graph_fixed() const noexcept {
    if constexpr (has_graph_steps)
      return device_ && device_->fixed().has_value();
    else
      return false;
  }

  static std::uint64_t agree(Communicator& comm, const attention_arguments& args) {
    const validation own = args.validate(BlockKernel::mask);
    struct fingerprint {
      std::int32_t valid, q_heads, kv_heads, head_dim, head_dim_v;
      std::uint32_t scale_bits, ranks, reserved; // no padding: the bytes are hashed
      std::uint64_t kernel;
    } mine{own ? 1 : 0,
           args.q_heads,
           args.kv_heads,
           args.qk_dim(),
           args.v_dim(),
           std::bit_cast<std::uint32_t>(static_cast<float>(args.scale())),
           static_cast<std::uint32_t>(comm.size()),
           0,
           detail::fnv1a(BlockKernel::name)};
    static_assert(std::has_unique_object_representations_v<fingerprint>);
    std::vector<fingerprint> all(static_cast<std::size_t>(comm.size()));
    comm.all_gather(&mine, sizeof mine, all.data());
    own.throw_if_invalid();
    validation v = validation::ok();
    for (std::size_t r = 0; r < all.size() && v; ++r) {
      const fingerprint& x = all[r];
      v.require(x.valid == 1, "rank ", r, " rejected its arguments (its own error says why)");
      if (!v) break;
      v.require(x.q_heads == mine.q_heads && x.kv_heads == mine.kv_heads &&
                    x.head_dim == mine.head_dim && x.head_dim_v == mine.head_dim_v &&
                    x.scale_bits == mine.scale_bits,
                "rank ", r, " disagrees with rank ", comm.rank(),
                " on the heads, head_dim, head_dim_v or scale");
      v.require(x.kernel == mine.kernel, "rank ", r, " disagrees with rank ", comm.rank(),
                " on the block kernel");
    }
    v.throw_if_invalid();
    return detail::fnv1a(&mine, sizeof mine);
  }

  // The common plan: this rank's own validation `own` so far, then the agreement, then the
  // groups: per sequence with new tokens, a full block against its cached tokens here and (rank
  // 0) the causal block of the new tokens against themselves.
  // A paged cache (`paged` not null) has no `cache_begin`: its groups come from the page table.
  void plan_checked(validation own, std::span<const std::int32_t> cu_new,
                    std::span<const std::int32_t> cache_begin,
                    std::span<const std::int32_t> cache_length, std::int64_t cache_tokens,
                    const paged_cache* paged = nullptr) {
    own.require(paged ? validate_paged(cu_new, *paged)
                      : validate_step(cu_new, cache_begin, cache_length, cache_tokens));
    // This rank's groups, made and checked before the agreement: whatever can fail on one rank
    // fails into `own`, so that every rank throws together.
    // A paged cache's groups count their key rows through the page table (`key_pages`).
    std::vector<block_group> cache_groups, new_groups;
    const bool fixed = graph_fixed();
    const std::int64_t cache_rows =
        paged ? static_cast<std::int64_t>(paged->page_table.size()) * paged->page_size
              : cache_tokens;
    if (own) {
      for (std::size_t b = 0; b + 1 < cu_new.size(); ++b) {
        const std::int64_t n = cu_new[b + 1] - cu_new[b], m = cache_length[b];
        if (n == 0) continue;
        if (m > 0 || fixed) { // fixed steps keep a group per sequence (a split launch's size)
          block_group g{cu_new[b], n, 1, {}};
          g.kv[0] = {paged ? std::int64_t{paged->cu_pages[b]} * paged->page_size : cache_begin[b],
                     m, band{-unbounded, unbounded}};
          cache_groups.push_back(g);
        }
        if (comm_.rank() == 0) { // the new tokens' own block: one rank computes it
          block_group g{cu_new[b], n, 1, {}};
          g.kv[0] = {cu_new[b], n, band{-unbounded, 0}};
          new_groups.push_back(g);
        }
      }
      own.require(validate_groups(cache_groups, cu_new.back(), cache_rows));
      if (own) own.require(validate_groups(new_groups, cu_new.back(), cu_new.back()));
      if (own && fixed) own.require(check_fixed(cu_new, cache_groups, cache_rows, paged));
    }
    struct step_fingerprint {
      std::int32_t valid, batch;
      std::int64_t new_tokens;
      std::uint64_t cu_new_hash;
    } mine{own ? 1 : 0, static_cast<std::int32_t>(cu_new.size()) - 1, own ? cu_new.back() : 0,
           detail::fnv1a(cu_new.data(), cu_new.size_bytes())};
    std::vector<step_fingerprint> all(static_cast<std::size_t>(comm_.size()));
    planned_ = false;
    comm_.all_gather(&mine, sizeof mine, all.data());
    own.throw_if_invalid();
    validation v = validation::ok();
    for (std::size_t r = 0; r < all.size() && v; ++r)
      v.require(all[r].valid == 1, "rank ", r, " rejected its step (its own error says why)");
    for (std::size_t r = 1; r < all.size() && v; ++r)
      v.require(all[r].batch == all[0].batch && all[r].new_tokens == all[0].new_tokens &&
                    all[r].cu_new_hash == all[0].cu_new_hash,
                "rank ", r,
                " plans other new tokens than rank 0 (cu_new must be the same on "
                "every rank: ",
                all[r].batch, " sequences, ", all[r].new_tokens, " tokens vs ", all[0].batch, ", ",
                all[0].new_tokens, ")");
    v.throw_if_invalid();
    if (fixed && !fixed_launch_)
      fixed_launch_ =
          launch_key{cu_new.back(), mine.cu_new_hash, cache_rows, paged ? paged->page_size : 0};
    new_tokens_ = cu_new.back();
    cache_tokens_ = cache_tokens;
    cache_groups_ = std::move(cache_groups);
    new_groups_ = std::move(new_groups);
    paged_ = paged != nullptr;
    rounds_built_ = false;
    if (paged) {
      pages_.page_size = paged->page_size;
      pages_.table.assign(paged->page_table.begin(), paged->page_table.end());
    }
    cache_covers_ = rows_of(cache_groups_) == new_tokens_;
    // Every rank counts the step before anything that could still throw on one rank alone.
    gate_.replan(detail::fnv1a(&mine, sizeof mine, fingerprint_ + ++plans_));
    if constexpr (has_device_path)
      if (device_) schedule_device(*device_);
    planned_ = true;
  }

  // The planned step's device schedules.
  void schedule_device(device_resources& d) {
    if constexpr (has_device_path) {
      const key_pages pages{pages_.table, pages_.page_size};
      d.schedule(
          [this]() -> const auto& { return cache_rounds(); }, cache_groups_,
          paged_ ? &pages : nullptr, new_groups_, new_tokens_, cache_tokens_, args_);
    }
  }

  // The cache block in rounds, one block-kernel call each: a packed or slab cache's groups in
  // one; a paged cache's runs of consecutive pool rows (built from the plan's copy of the page
  // table when first asked for; valid by construction, the pages having been checked).
  const std::vector<std::vector<block_group>>& cache_rounds() {
    if (rounds_built_) return cache_rounds_;
    // The previous step's rounds keep their storage (rounds left empty are skipped).
    for (auto& round : cache_rounds_)
      round.clear();
    if (cache_rounds_.empty()) cache_rounds_.emplace_back();
    if (!paged_) {
      cache_rounds_[0].assign(cache_groups_.begin(), cache_groups_.end());
    } else {
      for (const block_group& g : cache_groups_)
        add_page_runs(cache_rounds_, pages_.page_size,
                      pages_.table.data() + g.kv[0].kv_begin / pages_.page_size, g.kv[0].kv_count,
                      g.q_begin, g.q_count);
    }
    rounds_built_ = true;
    return cache_rounds_;
  }

  // A sequence's `m` cached tokens in pages of `size` (`pages`: its page table) as runs of
  // consecutive pool rows (pages that follow each other in the pool join one run),
  // `max_blocks_per_group` runs a group: runs 2r and 2r + 1 of every sequence make round r.
  static void add_page_runs(std::vector<std::vector<block_group>>& rounds, std::int64_t size,
                            const std::int32_t* pages, std::int64_t m, std::int64_t q_begin,
                            std::int64_t n) {
    std::size_t run = 0;
    for (std::int64_t j = 0; j < m; ++run) { // j: the run's first token, at a page's start
      const std::int64_t row = std::int64_t{pages[j / size]} * size;
      std::int64_t count = std::min(size, m - j);
      while (j + count < m && std::int64_t{pages[(j + count) / size]} * size == row + count)
        count += std::min(size, m - j - count);
      const std::size_t r = run / max_blocks_per_group;
      if (rounds.size() <= r) rounds.emplace_back();
      if (run % max_blocks_per_group == 0) rounds[r].push_back(block_group{q_begin, n, 0, {}});
      block_group& g = rounds[r].back();
      g.kv[g.count++] = {row, count, band{-unbounded, unbounded}};
      j += count;
    }
  }

  // A step fixed for replays from a CUDA graph: one the split kernel takes, with the launch of
  // the first such plan (`fixed_launch_`, once there is one).
  validation check_fixed(std::span<const std::int32_t> cu_new,
                         std::span<const block_group> cache_groups, std::int64_t cache_rows,
                         const paged_cache* paged) const {
    validation v = validation::ok();
    if constexpr (has_graph_steps)
      v.require(cache_groups.empty() || BlockKernel::takes_split(cache_groups, args_),
                "a step replayed from a CUDA graph runs the split-K/V kernel, which takes ",
                detail::split_shapes_of<BlockKernel>());
    if (!v || !fixed_launch_) return v;
    const launch_key& first = *fixed_launch_;
    v.require(cu_new.back() == first.new_tokens &&
                  detail::fnv1a(cu_new.data(), cu_new.size_bytes()) == first.cu_new_hash,
              "a step replayed from a CUDA graph keeps the first plan's cu_new (its ",
              first.new_tokens, " new tokens, sequence by sequence; this plan has ", cu_new.back(),
              ")");
    v.require(cache_rows == first.cache_rows,
              "a step replayed from a CUDA graph keeps the first plan's cache of ",
              first.cache_rows, " rows (a slab or paged cache of fixed size); this plan's has ",
              cache_rows);
    v.require((paged ? paged->page_size : 0) == first.page_size,
              "a step replayed from a CUDA graph keeps the first plan's cache layout (",
              first.page_size ? "pages of " + std::to_string(first.page_size) + " tokens"
                              : std::string("slab"),
              ")");
    return v;
  }

  static validation validate_new(std::span<const std::int32_t> cu_new) {
    validation v = validation::ok();
    v.require(cu_new.size() >= 2, "cu_new must hold batch + 1 offsets (got ", cu_new.size(), ")");
    if (!v) return v;
    v.require(cu_new.front() == 0, "cu_new must start at 0");
    for (std::size_t b = 0; v && b + 1 < cu_new.size(); ++b)
      v.require(cu_new[b + 1] >= cu_new[b], "cu_new must not decrease (sequence ", b, ")");
    return v;
  }

  static validation validate_paged(std::span<const std::int32_t> cu_new, const paged_cache& c) {
    validation v = validate_new(cu_new);
    if (!v) return v;
    const std::size_t batch = cu_new.size() - 1;
    constexpr std::int64_t most = std::numeric_limits<std::int32_t>::max();
    v.require(c.page_size >= 16 && c.page_size <= 256 &&
                  std::has_single_bit(static_cast<std::uint32_t>(c.page_size)),
              "page_size must be a power of two from 16 to 256 (got ", c.page_size, ")");
    v.require(c.pages >= 0, "the pool holds a negative number of pages (", c.pages, ")");
    if (!v) return v;
    v.require(c.pages <= most / c.page_size, "a pool of ", c.pages, " pages of ", c.page_size,
              " tokens exceeds the int32 limit of ", most, " rows (its offsets are int32)");
    v.require(c.cu_pages.size() == batch + 1 && c.cache_length.size() == batch,
              "the paged cache must describe the ", batch, " sequences of cu_new (got ",
              c.cu_pages.size(), " page offsets and ", c.cache_length.size(), " lengths)");
    if (!v) return v;
    v.require(c.cu_pages.front() == 0, "cu_pages must start at 0");
    v.require(static_cast<std::size_t>(c.cu_pages.back()) == c.page_table.size(),
              "cu_pages must end at the page table's size (", c.page_table.size(), "), not at ",
              c.cu_pages.back());
    v.require(static_cast<std::int64_t>(c.page_table.size()) <= most / c.page_size,
              "a page table of ", c.page_table.size(), " pages of ", c.page_size,
              " tokens exceeds the int32 limit of ", most, " rows (the kernels count through it)");
    for (std::size_t b = 0; v && b < batch; ++b) {
      const std::int64_t first = c.cu_pages[b], held = std::int64_t{c.cu_pages[b + 1]} - first,
                         length = c.cache_length[b];
      v.require(held >= 0, "cu_pages must not decrease (sequence ", b, ")");
      v.require(length >= 0, "sequence ", b, " has a negative cache length (", length, ")");
      if (!v) break;
      const std::int64_t needed = (length + c.page_size - 1) / c.page_size;
      v.require(needed <= held, "sequence ", b, "'s ", length, " cached tokens need ", needed,
                " pages of ", c.page_size, "; its page table lists ", held);
      if (!v) break;
      // The pages read, in one pass the compiler vectorises; the first bad one named if any.
      const std::int32_t* pages = c.page_table.data() + first;
      std::int32_t lo = 0, hi = 0;
      for (std::int64_t k = 0; k < needed; ++k)
        lo = std::min(lo, pages[k]), hi = std::max(hi, pages[k]);
      if (lo >= 0 && hi < c.pages) continue;
      for (std::int64_t k = 0; v && k < needed; ++k)
        v.require(pages[k] >= 0 && pages[k] < c.pages, "sequence ", b, "'s page ", k, " is ",
                  pages[k], ", outside the pool of ", c.pages, " pages");
    }
    return v;
  }

  static validation validate_step(std::span<const std::int32_t> cu_new,
                                  std::span<const std::int32_t> begin,
                                  std::span<const std::int32_t> length, std::int64_t cache_tokens) {
    validation v = validate_new(cu_new);
    if (!v) return v;
    const std::size_t batch = cu_new.size() - 1;
    v.require(begin.size() == batch && length.size() == batch, "the cache must describe the ",
              batch, " sequences of cu_new (got ", begin.size(), " and ", length.size(), ")");
    v.require(cache_tokens >= 0, "the cache holds a negative number of tokens");
    constexpr std::int64_t most = std::numeric_limits<std::int32_t>::max();
    v.require(cache_tokens <= most, "the cache shard of ", cache_tokens,
              " rows exceeds the int32 limit of ", most, " rows (its offsets are int32)");
    for (std::size_t b = 0; v && b < batch; ++b) {
      v.require(begin[b] >= 0 && length[b] >= 0 &&
                    static_cast<std::int64_t>(begin[b]) + length[b] <= cache_tokens,
                "sequence ", b, "'s cached tokens [", begin[b], ", ",
                static_cast<std::int64_t>(begin[b]) + length[b], ") are not inside the cache of ",
                cache_tokens, " tokens");
    }
    return v;
  }

  std::int64_t rows() const { return new_tokens_ * args_.q_heads; }
  static constexpr std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }
  // This rank's partial state (fp32): o [q_heads, new tokens, head_dim_v], reference lse, weight
  // sum; then the finished partials, slot r rank r's: the normalised output [rows, head_dim_v] of
  // T, then each row's lse (fp32).
  std::size_t state_bytes() const {
    return ring_workspace::align(static_cast<std::size_t>(rows()) * (args_.v_dim() + 2) *
                                 sizeof(float));
  }
  template <class T>
  std::size_t slot_o_bytes() const {
    return align16(static_cast<std::size_t>(rows()) * args_.v_dim() * sizeof(T));
  }
  template <class T>
  std::size_t slot_bytes() const {
    return slot_o_bytes<T>() + align16(static_cast<std::size_t>(rows()) * sizeof(float));
  }
  template <class T>
  T* slot_o(std::byte* slots, int r) const {
    return reinterpret_cast<T*>(slots + r * slot_bytes<T>());
  }
  template <class T>
  float* slot_lse(std::byte* slots, int r) const {
    return reinterpret_cast<float*>(slots + r * slot_bytes<T>() + slot_o_bytes<T>());
  }
  // The distance between two slots in elements of E (T for the outputs, float for the lse).
  template <class T, class E>
  std::int64_t slot_stride() const {
    return static_cast<std::int64_t>(slot_bytes<T>() / sizeof(E));
  }
  attention_state partial_state(float* base) const {
    float* o = base;
    return {o,
            o + rows() * args_.v_dim(),
            o + rows() * (args_.v_dim() + 1),
            new_tokens_,
            args_.q_heads,
            args_.v_dim()};
  }

  template <element T, cache_element C, class Device>
  validation check(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                   thd_view<const C> kc, thd_view<const C> vc, thd_view<T> out, const float* lse,
                   std::span<const std::byte> workspace, std::size_t need, const Device& device,
                   std::span<const detail::ring_checks::region> more_inputs = {}) const {
    using checks = detail::ring_checks;
    validation r = validation::ok();
    r.require(planned_, "call plan(cu_new, cu_cache) before the forward");
    if (!r) return r;
    const int qh = args_.q_heads, kvh = args_.kv_heads, dk = args_.qk_dim(), dv = args_.v_dim();
    auto shape = [&](const auto& x, const char* name, std::int64_t tokens, int heads, int d) {
      r.require(validate_view(x, name));
      if (r)
        r.require(x.tokens == tokens && x.heads == heads && x.head_dim == d, name, " is [",
                  x.tokens, ", ", x.heads, ", ", x.head_dim, "] but the plan wants [", tokens, ", ",
                  heads, ", ", d, "]");
    };
    shape(q, "q_new", new_tokens_, qh, dk);
    shape(k, "k_new", new_tokens_, kvh, dk);
    shape(v, "v_new", new_tokens_, kvh, dv);
    shape(kc, "k_cache", cache_tokens_, kvh, dk);
    shape(vc, "v_cache", cache_tokens_, kvh, dv);
    shape(out, "out", new_tokens_, qh, dv);
    r.require(lse != nullptr || new_tokens_ == 0, "lse is a null pointer");
    r.require(workspace.size() >= need, "the workspace holds ", workspace.size(),
              " bytes; this step needs ", need);
    r.require(workspace.data() != nullptr || need == 0, "the workspace is a null pointer");
    r.require(aligned_to(workspace.data(), 16), "the workspace must be 16-byte aligned");
    if (r) device(r);
    if (!r) return r;
    const auto lse_bytes = static_cast<std::size_t>(rows()) * sizeof(float);
    const checks::region outputs[] = {checks::region_of(out, "out"),
                                      checks::region_of(lse, lse_bytes, "lse"),
                                      checks::region_of(workspace.data(), need, "the workspace")};
    const checks::region inputs[] = {
        checks::region_of(q, "q_new"), checks::region_of(k, "k_new"), checks::region_of(v, "v_new"),
        checks::region_of(kc, "k_cache"), checks::region_of(vc, "v_cache")};
    checks::require_disjoint(r, outputs, inputs);
    checks::require_disjoint(r, outputs, more_inputs);
    return r;
  }

  // An FP8 cache's scales: present, of the layout the plan allows, and their regions (each of
  // `Scales::entries` floats) for the overlap checks.
  template <kv_scales Scales>
  validation check_scales(const Scales& scales,
                          std::span<detail::ring_checks::region, 2> regions) const {
    validation r = validation::ok();
    constexpr bool per_page = std::same_as<Scales, page_scales>;
    if (per_page)
      r.require(paged_, "page_scales need a step planned over a paged cache "
                        "(plan(cu_new, paged_cache)); a slab or packed cache takes head_scales");
    if (!r) return r;
    const std::int64_t pages = paged_ ? cache_tokens_ / pages_.page_size : 0;
    const auto bytes =
        static_cast<std::size_t>(Scales::entries(pages, args_.kv_heads)) * sizeof(float);
    r.require(cache_tokens_ == 0 || (scales.k != nullptr && scales.v != nullptr), "the ",
              Scales::name, "' k or v is a null pointer (an FP8 cache of ", cache_tokens_,
              " rows reads ", bytes / sizeof(float), " scales each)");
    r.require(aligned_to(scales.k, alignof(float)) && aligned_to(scales.v, alignof(float)), "the ",
              Scales::name, " must be aligned to 4 bytes (fp32)");
    regions[0] = detail::ring_checks::region_of(scales.k, bytes, "scales.k");
    regions[1] = detail::ring_checks::region_of(scales.v, bytes, "scales.v");
    return r;
  }

#if defined(__CUDACC__)
  // This rank's partial state (the own block first on rank 0, covering every row; else the cache
  // block, which covers every row unless a sequence has no cached token here), its exchange on
  // the communication stream, and the merge once every partial has arrived.
  template <class T, class C, class Scales>
  void device_forward(thd_view<const T> q_new, thd_view<const T> k_new, thd_view<const T> v_new,
                      thd_view<const C> k_cache, thd_view<const C> v_cache, Scales scales,
                      thd_view<T> out, float* lse, std::byte* workspace, cudaStream_t stream) {
    device_resources& d = *device_;
    auto& g = d.now();
    const int p = comm_.size(), me = comm_.rank();
    const attention_state state = partial_state(reinterpret_cast<float*>(workspace));
    std::byte* slots = workspace + state_bytes();
    std::byte* scratch =
        workspace +
        ring_workspace::align(state_bytes() + static_cast<std::size_t>(p) * slot_bytes<T>());
    // The tables' copies: on this stream already where the steps are fixed to it; else waited
    // for on the device (an external wait node under stream capture: a replay waits for the
    // copies of this plan, long done).
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    RINGATTN_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    const bool captured = capturing != cudaStreamCaptureStatusNone;
    if (!d.fixed() && g.pool.uploaded())
      RINGATTN_CUDA_CHECK(
          cudaStreamWaitEvent(stream, g.pool.uploaded(), captured ? cudaEventWaitExternal : 0));
    // The partial: the own block first where there is one (covering every row), then the cache
    // block; a rank with neither sends an empty state.
    const auto partial = [&](int rank) {
      bool written = false;
      if (g.own) {
        BlockKernel::device_forward(
            step_epilogue::fresh, block_forward_args<T>{q_new, k_new, v_new, args_, state, scratch},
            *g.own, out, nullptr, stream);
        written = true;
      }
      if (!g.cache.empty() || g.split) {
        bool fresh = !written && cache_covers_;
        if (!written && !fresh) reset(state, stream);
        if constexpr (!std::same_as<C, T>) { // an FP8 cache: the split kernel (checked)
          const block_forward_args<T> cache{q_new, {}, {}, args_, state, scratch};
          if (g.split)
            BlockKernel::device_split_forward(cache, k_cache, v_cache, scales, *g.split, fresh,
                                              stream);
        } else {
          const block_forward_args<T> cache{q_new, k_cache, v_cache, args_, state, scratch};
          if constexpr (requires {
                          BlockKernel::device_split_forward(cache, *g.split, fresh, stream);
                        })
            if (g.split) BlockKernel::device_split_forward(cache, *g.split, fresh, stream);
          for (const auto& round : g.cache) { // the first round covers every sequence with a cache
            BlockKernel::device_forward(fresh ? step_epilogue::fresh : step_epilogue::merge, cache,
                                        round, out, nullptr, stream);
            fresh = false;
          }
        }
        written = true;
      }
      if (!written) reset(state, stream);
      finish_partial(state, slot_o<T>(slots, rank), slot_lse<T>(slots, rank), stream);
    };
    // The exchanges on the communication stream, after the partial; the merge after them.
    bool exchanged = false;
    const auto exchange = [&](const detail::message& m) {
      if (!exchanged) {
        RINGATTN_CUDA_CHECK(cudaEventRecord(d.computed, stream));
        RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.computed, 0));
        exchanged = true;
      }
      comm_.exchange_async(slots + m.send_slot * slot_bytes<T>(), m.send_bytes, m.to,
                           slots + m.recv_slot * slot_bytes<T>(), m.recv_bytes, m.from, m.tag,
                           d.comm);
    };
    const auto merge = [&] {
      if (exchanged) {
        RINGATTN_CUDA_CHECK(cudaEventRecord(d.arrived, d.comm));
        RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.arrived, 0));
      }
      merge_finished_partials<T>(slot_o<T>(slots, 0), slot_stride<T, T>(), slot_lse<T>(slots, 0),
                                 slot_stride<T, float>(), p, out, lse, stream);
    };
    detail::decode_engine e{partial, exchange, merge};
    detail::decode_program::step(e, me, p, q_new.tokens, slot_bytes<T>());
    // The schedules' tables are reused two plans on, after this (their last reader) completes
    // (fixed steps: by the next plan's copies on this stream). An event recorded under stream
    // capture cannot be waited on from the host: a captured step is the caller's to order before
    // that plan.
    if (!captured && !d.fixed()) RINGATTN_CUDA_CHECK(cudaEventRecord(g.done, stream));
  }
#endif

  Communicator& comm_;
  attention_arguments args_;
  std::uint64_t fingerprint_;
  detail::call_gate<Communicator> gate_;
  std::uint64_t plans_ = 0;
  std::int64_t new_tokens_ = 0, cache_tokens_ = 0;
  // The cache block's groups: one per sequence with new tokens and cached tokens here (a paged
  // cache's key rows counted through the page table), and the same in rounds (`cache_rounds`).
  std::vector<block_group> cache_groups_;
  std::vector<std::vector<block_group>> cache_rounds_;
  std::vector<block_group> new_groups_;
  struct {
    std::int32_t page_size = 0;
    std::vector<std::int32_t> table;
  } pages_; // a paged step's page table (`paged_`)
  bool paged_ = false;
  bool rounds_built_ = false;
  bool cache_covers_ = false;
  bool planned_ = false;
  // The launch of the first plan of steps fixed for CUDA graphs (`prepare_device(graph_steps)`).
  struct launch_key {
    std::int64_t new_tokens;
    std::uint64_t cu_new_hash;
    std::int64_t cache_rows;
    std::int32_t page_size;
  };
  std::optional<launch_key> fixed_launch_;
  std::unique_ptr<device_resources> device_;
};

} // namespace ringattn
