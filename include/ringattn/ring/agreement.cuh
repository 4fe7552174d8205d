#pragma once
//! \file
//! Plan-time agreement of a ring: every rank validates its own arguments, then all exchange a
//! fingerprint in one all-gather — also the ranks whose arguments are invalid, so that every rank
//! fails together, at once, whether one rank rejected its arguments or the ranks disagree; nobody
//! is left waiting.

#include <ringattn/arguments.cuh>
#include <ringattn/error.cuh>
#include <ringattn/partition/plan.cuh>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace ringattn::detail {

//! What every rank of a ring must agree on.
struct ring_fingerprint {
  std::int32_t valid; // 0: this rank rejected its own arguments (the rest is then unset)
  std::int32_t reserved = 0;
  std::int64_t tokens;
  std::uint64_t cu_seqlens_hash;
  std::uint64_t partitioner_hash;
  std::uint64_t kernel_hash;
  std::uint64_t schedule_hash;
  std::int32_t ranks, batch, q_heads, kv_heads, head_dim, mask;
  std::uint32_t scale_bits;
  std::int32_t head_dim_v;
  std::int64_t window_left, window_right;
};
static_assert(std::has_unique_object_representations_v<ring_fingerprint>,
              "the fingerprint's bytes are hashed: no padding");

inline std::uint64_t fnv1a(const void* p, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
inline std::uint64_t fnv1a(const char* s) { return fnv1a(s, std::char_traits<char>::length(s)); }

//! The plan every rank of `comm` agrees on, or `invalid_argument` on every rank. `kernel` names
//! the BlockKernel model (its type), `mask` its mask, `schedule` the Schedule model. `fingerprint`
//! receives a hash of what the ranks agreed on (the same on every rank), by which later calls name
//! their ring.
template <class Partitioner, class Communicator>
partition_plan<Partitioner>
agreed_plan(Communicator& comm, const attention_arguments& args, std::span<const std::int32_t> cu,
            mask_kind mask, const char* kernel, const char* schedule, std::uint64_t& fingerprint) {
  validation own = args.validate(mask);
  own.require(partition_plan<Partitioner>::validate(cu, comm.size()));
  ring_fingerprint mine{};
  mine.valid = own.is_ok() ? 1 : 0;
  if (own) {
    mine.tokens = cu.back();
    mine.cu_seqlens_hash = fnv1a(cu.data(), cu.size_bytes());
    mine.partitioner_hash = fnv1a(Partitioner::name);
    mine.kernel_hash = fnv1a(kernel);
    mine.schedule_hash = fnv1a(schedule);
    mine.ranks = comm.size();
    mine.batch = static_cast<std::int32_t>(cu.size()) - 1;
    mine.q_heads = args.q_heads;
    mine.kv_heads = args.kv_heads;
    mine.head_dim = args.qk_dim();
    mine.head_dim_v = args.v_dim();
    mine.mask = static_cast<std::int32_t>(mask);
    mine.scale_bits = std::bit_cast<std::uint32_t>(static_cast<float>(args.scale()));
    mine.window_left = args.window_left;
    mine.window_right = args.window_right;
  }
  std::vector<ring_fingerprint> all(static_cast<std::size_t>(comm.size()));
  comm.all_gather(&mine, sizeof mine, all.data());
  own.throw_if_invalid();
  validation v = validation::ok();
  for (int r = 0; r < comm.size() && v; ++r)
    v.require(all[static_cast<std::size_t>(r)].valid == 1, "rank ", r,
              " rejected its arguments (its own error says why)");
  const ring_fingerprint& ref = all[0];
  for (int r = 1; r < comm.size() && v; ++r) {
    const ring_fingerprint& x = all[static_cast<std::size_t>(r)];
    auto differ = [&](bool same, const char* what, auto a, auto b) {
      v.require(same, "rank ", r, " disagrees with rank 0 on ", what, " (", a, " vs ", b, ")");
    };
    differ(x.ranks == ref.ranks, "the number of ranks", x.ranks, ref.ranks);
    differ(x.q_heads == ref.q_heads, "q_heads", x.q_heads, ref.q_heads);
    differ(x.kv_heads == ref.kv_heads, "kv_heads", x.kv_heads, ref.kv_heads);
    differ(x.head_dim == ref.head_dim, "head_dim", x.head_dim, ref.head_dim);
    differ(x.head_dim_v == ref.head_dim_v, "head_dim_v", x.head_dim_v, ref.head_dim_v);
    differ(x.scale_bits == ref.scale_bits, "the softmax scale", std::bit_cast<float>(x.scale_bits),
           std::bit_cast<float>(ref.scale_bits));
    differ(x.mask == ref.mask, "the mask", to_string(static_cast<mask_kind>(x.mask)),
           to_string(static_cast<mask_kind>(ref.mask)));
    differ(x.window_left == ref.window_left, "window_left", x.window_left, ref.window_left);
    differ(x.window_right == ref.window_right, "window_right", x.window_right, ref.window_right);
    differ(x.kernel_hash == ref.kernel_hash, "the block kernel", "a different one", kernel);
    v.require(x.schedule_hash == ref.schedule_hash, "rank ", r,
              " disagrees with rank 0 on the schedule (this rank's is ", schedule, ")");
    differ(x.partitioner_hash == ref.partitioner_hash, "the partitioner", "a different one",
           Partitioner::name);
    differ(x.tokens == ref.tokens, "the total token count", x.tokens, ref.tokens);
    differ(x.batch == ref.batch, "the number of sequences", x.batch, ref.batch);
    differ(x.cu_seqlens_hash == ref.cu_seqlens_hash, "cu_seqlens", "other lengths", "rank 0's");
  }
  v.throw_if_invalid();
  fingerprint = fnv1a(&mine, sizeof mine);
  return partition_plan<Partitioner>(cu, comm.size());
}

} // namespace ringattn::detail
