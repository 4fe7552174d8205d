#pragma once
//! \file
//! `sharded_attention<Communicator, BlockKernel>`: attention of new query tokens over a KV cache
//! sharded across ranks — decoding, or a prefill chunk, after a context-parallel prefill.
//!
//! Every rank holds the K/V of the cached tokens it owns (after a prefill: its partitioner's
//! shard; new tokens go to `owner_of(position, ranks)`, position mod P) and the same new tokens
//! on every rank: their queries, keys and values (`[new tokens, heads, head_dim]`, a packed batch
//! of sequences, `cu_new`). Per sequence every new token sees every cached token (the cache holds
//! the positions before it) and the new tokens up to its own (causal).
//!
//! A step: each rank attends with all new queries to its cache shard (a full block per sequence;
//! rank 0 also to the new tokens themselves, causally), giving a partial output and LSE per row
//! (fp32); the ranks exchange their partials (P - 1 pairwise exchanges of
//! `new tokens x q_heads x (head_dim + 1)` floats each) and every rank merges all P in rank
//! order with the library's LSE merge (core/state.cuh). Every rank thus ends with the same
//! result, bit for bit, equal to attention over the whole cache.
//!
//! \code
//! ringattn::sharded_attention<ringattn::in_process_communicator, ringattn::causal> dec(comm,
//! args); dec.plan(cu_new, cu_cache);            // this step's new tokens; this rank's cached
//! tokens std::vector<std::byte> ws(dec.host_workspace_bytes<T>()); dec.forward_host(q_new, k_new,
//! v_new, k_cache, v_cache, out, lse, ws); \endcode
//!
//! The cache shard is `[cached tokens, kv_heads, head_dim]`, its sequences packed in order
//! (`cu_cache`, this rank's own offsets); a sequence may have no cached token on a rank.

#include <ringattn/arguments.cuh>
#include <ringattn/block_kernel.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/error.cuh>
#include <ringattn/kernel/block.cuh>
#include <ringattn/kernel/host_forward.cuh>
#include <ringattn/ring/agreement.cuh>
#include <ringattn/tensor.cuh>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace ringattn {

//! The rank that keeps a new token's K/V: its position in the sequence modulo the rank count.
constexpr int owner_of(std::int64_t position, int ranks) {
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
  v.throw_if_invalid();
  std::vector<std::int64_t> rows;
  for (std::size_t b = 0; b < lengths.size(); ++b)
    for (std::int64_t t = cu_new[b]; t < cu_new[b + 1]; ++t)
      if (owner_of(lengths[b] + (t - cu_new[b]), ranks) == rank) rows.push_back(t);
  return rows;
}

template <class Communicator, class BlockKernel>
class sharded_attention {
  static_assert(host_communicator<Communicator>,
                "ringattn::sharded_attention: the first template argument must be a "
                "Communicator (ringattn::in_process_communicator, ringattn::mpi_communicator or "
                "ringattn::nccl_communicator)");
  static_assert(block_kernel<BlockKernel>,
                "ringattn::sharded_attention: the second template argument must be a BlockKernel "
                "(ringattn::full, ringattn::causal or ringattn::host_reference<Mask>)");
  static_assert(BlockKernel::mask == mask_kind::causal,
                "ringattn::sharded_attention: new tokens attend to the cache and causally to "
                "each other; take a causal BlockKernel");

public:
  //! Collective: every rank of `comm` constructs one with the same arguments (else every rank
  //! throws `invalid_argument`, naming the difference).
  sharded_attention(Communicator& comm, const attention_arguments& args)
      : comm_(comm), args_(args) {
    const validation own = args.validate();
    struct fingerprint {
      std::int32_t valid, q_heads, kv_heads, head_dim;
      std::uint32_t scale_bits, padding;
      std::uint64_t kernel;
    } mine{own ? 1 : 0,
           args.q_heads,
           args.kv_heads,
           args.head_dim,
           std::bit_cast<std::uint32_t>(static_cast<float>(args.scale())),
           0,
           detail::fnv1a(BlockKernel::name)};
    std::vector<fingerprint> all(static_cast<std::size_t>(comm.size()));
    comm.all_gather(&mine, sizeof mine, all.data());
    own.throw_if_invalid();
    validation v = validation::ok();
    for (std::size_t r = 0; r < all.size() && v; ++r) {
      const fingerprint& x = all[r];
      v.require(x.valid == 1, "rank ", r, " rejected its arguments (its own error says why)");
      if (!v) break;
      v.require(x.q_heads == mine.q_heads && x.kv_heads == mine.kv_heads &&
                    x.head_dim == mine.head_dim && x.scale_bits == mine.scale_bits,
                "rank ", r, " disagrees with rank ", comm.rank(),
                " on the heads, head_dim or scale");
      v.require(x.kernel == mine.kernel, "rank ", r, " disagrees with rank ", comm.rank(),
                " on the block kernel");
    }
    v.throw_if_invalid();
  }

  //! Plans a step: `cu_new` (batch + 1 offsets, the same on every rank) packs the new tokens,
  //! `cu_cache` (batch + 1 offsets) this rank's cached tokens of the same sequences. Host work
  //! only; a step with other lengths plans again.
  void plan(std::span<const std::int32_t> cu_new, std::span<const std::int32_t> cu_cache) {
    validation v = validation::ok();
    v.require(cu_new.size() >= 2 && cu_new.size() == cu_cache.size(),
              "cu_new and cu_cache must both hold batch + 1 offsets (got ", cu_new.size(), " and ",
              cu_cache.size(), ")");
    for (std::size_t b = 0; v && b < cu_new.size(); ++b) {
      v.require(cu_new[b] >= 0 && cu_cache[b] >= 0, "offsets must not be negative");
      if (b > 0)
        v.require(cu_new[b] >= cu_new[b - 1] && cu_cache[b] >= cu_cache[b - 1],
                  "offsets must not decrease (sequence ", b - 1, ")");
    }
    v.require(!cu_new.empty() && cu_new.front() == 0 && cu_cache.front() == 0,
              "offsets must start at 0");
    v.throw_if_invalid();
    new_tokens_ = cu_new.back();
    cache_tokens_ = cu_cache.back();
    cache_groups_.clear();
    new_groups_.clear();
    for (std::size_t b = 0; b + 1 < cu_new.size(); ++b) {
      const std::int64_t n = cu_new[b + 1] - cu_new[b], m = cu_cache[b + 1] - cu_cache[b];
      if (n == 0) continue;
      if (m > 0) {
        block_group g{cu_new[b], n, 1, {}};
        g.kv[0] = {cu_cache[b], m, band{-unbounded, unbounded}};
        cache_groups_.push_back(g);
      }
      block_group g{cu_new[b], n, 1, {}};
      g.kv[0] = {cu_new[b], n, band{-unbounded, 0}};
      new_groups_.push_back(g);
    }
    validate_groups(cache_groups_, new_tokens_, cache_tokens_).throw_if_invalid();
    validate_groups(new_groups_, new_tokens_, new_tokens_).throw_if_invalid();
    planned_ = true;
  }

  std::int64_t new_tokens() const noexcept { return new_tokens_; }
  std::int64_t cache_tokens() const noexcept { return cache_tokens_; }
  //! Bytes this rank sends in one step: its partial (fp32 output and LSE) to each other rank.
  std::size_t step_bytes() const {
    return static_cast<std::size_t>(comm_.size() - 1) * partial_bytes();
  }
  //! Workspace of `forward_host`: the fp32 state and every rank's partial.
  template <element T>
  std::size_t host_workspace_bytes() const {
    return state_bytes() + static_cast<std::size_t>(comm_.size()) * partial_bytes();
  }

  //! One step on host memory. `q_new`, `k_new`, `v_new`: the new tokens (the same on every rank);
  //! `k_cache`, `v_cache`: this rank's cache shard; `out` like `q_new` and `lse`
  //! `[q_heads, new tokens]` (natural log) receive the same result on every rank. Collective.
  template <element T>
  void forward_host(std::type_identity_t<thd_view<const T>> q_new,
                    std::type_identity_t<thd_view<const T>> k_new,
                    std::type_identity_t<thd_view<const T>> v_new,
                    std::type_identity_t<thd_view<const T>> k_cache,
                    std::type_identity_t<thd_view<const T>> v_cache, thd_view<T> out, float* lse,
                    std::span<std::byte> workspace) {
    validation v = check<T>(q_new, k_new, v_new, k_cache, v_cache, out, lse, workspace);
    if (!v) comm_.abort(v.reason());
    v.throw_if_invalid();
    const std::int64_t n = new_tokens_;
    const int qh = args_.q_heads, d = args_.head_dim, p = comm_.size(), me = comm_.rank();
    std::byte* base = workspace.data();
    float* o = reinterpret_cast<float*>(base);
    float* sum = o + n * qh * d;
    float* ref = sum + n * qh;
    const attention_state state{o, ref, sum, n, qh, d};
    // This rank's partial: its cache shard, and (rank 0) the new tokens themselves.
    reset(state);
    if (!cache_groups_.empty())
      BlockKernel::host_forward(block_forward_args<T>{q_new, k_cache, v_cache, args_, state},
                                cache_groups_);
    if (me == 0 && !new_groups_.empty())
      BlockKernel::host_forward(block_forward_args<T>{q_new, k_new, v_new, args_, state},
                                new_groups_);
    float* mine = partial(base, me);
    finalize(state, thd_view<float>(mine, n, qh, d));
    std::memcpy(mine + n * qh * d, ref, sizeof(float) * static_cast<std::size_t>(n * qh));
    try {
      for (int k = 1; k < p; ++k)
        comm_.exchange(mine, partial_bytes(), (me + k) % p, partial(base, (me - k + p) % p),
                       partial_bytes(), (me - k + p) % p, k);
    } catch (...) {
      comm_.abort("a rank's partial did not arrive");
      throw;
    }
    // Every rank merges the P partials in rank order: the same bits everywhere.
    reset(state);
    for (int r = 0; r < p; ++r) {
      const float* part = partial(base, r);
      const float* part_lse = part + n * qh * d;
      for (std::int64_t t = 0; t < n; ++t)
        for (int h = 0; h < qh; ++h) {
          const float lse_b = part_lse[h * n + t];
          const row_merge m = merge_into(state.lse_at(t, h), lse_b);
          float* row = state.o_row(t, h);
          const float* block = part + (t * qh + h) * d; // finalize wrote [n, q_heads, d]
          for (int e = 0; e < d; ++e)
            row[e] = row[e] * m.old + block[e] * m.block;
          state.sum_at(t, h) = state.sum_at(t, h) * m.old + m.block;
          state.lse_at(t, h) = m.new_ref;
        }
    }
    finalize(state, out);
    std::memcpy(lse, ref, sizeof(float) * static_cast<std::size_t>(n * qh));
  }

private:
  std::size_t state_bytes() const {
    const auto rows = static_cast<std::size_t>(new_tokens_) * args_.q_heads;
    return rows * (static_cast<std::size_t>(args_.head_dim) + 2) * sizeof(float);
  }
  std::size_t partial_bytes() const {
    const auto rows = static_cast<std::size_t>(new_tokens_) * args_.q_heads;
    return rows * (static_cast<std::size_t>(args_.head_dim) + 1) * sizeof(float);
  }
  float* partial(std::byte* base, int r) const {
    return reinterpret_cast<float*>(base + state_bytes() +
                                    static_cast<std::size_t>(r) * partial_bytes());
  }
  template <element T>
  validation check(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                   thd_view<const T> kc, thd_view<const T> vc, thd_view<T> out, const float* lse,
                   std::span<std::byte> workspace) const {
    validation r = validation::ok();
    r.require(planned_, "call plan(cu_new, cu_cache) before forward_host");
    if (!r) return r;
    const int qh = args_.q_heads, kvh = args_.kv_heads, d = args_.head_dim;
    auto shape = [&](const auto& x, const char* name, std::int64_t tokens, int heads) {
      r.require(validate_view(x, name));
      r.require(x.tokens == tokens && x.heads == heads && x.head_dim == d, name, " is [", x.tokens,
                ", ", x.heads, ", ", x.head_dim, "] but the plan wants [", tokens, ", ", heads,
                ", ", d, "]");
    };
    shape(q, "q_new", new_tokens_, qh);
    shape(k, "k_new", new_tokens_, kvh);
    shape(v, "v_new", new_tokens_, kvh);
    shape(kc, "k_cache", cache_tokens_, kvh);
    shape(vc, "v_cache", cache_tokens_, kvh);
    shape(out, "out", new_tokens_, qh);
    r.require(lse != nullptr || new_tokens_ == 0, "lse is null");
    r.require(workspace.size() >= host_workspace_bytes<T>(), "the workspace holds ",
              workspace.size(), " bytes; this step needs ", host_workspace_bytes<T>());
    r.require(reinterpret_cast<std::uintptr_t>(workspace.data()) % alignof(float) == 0,
              "the workspace must be aligned to ", alignof(float), " bytes");
    return r;
  }

  Communicator& comm_;
  attention_arguments args_;
  std::int64_t new_tokens_ = 0, cache_tokens_ = 0;
  std::vector<block_group> cache_groups_, new_groups_;
  bool planned_ = false;
};

} // namespace ringattn
