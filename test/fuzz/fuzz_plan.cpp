// libFuzzer target over the partition planner and argument validation (docs/reliability.md).
// Input: a partitioner, a rank count, cu_seqlens (as lengths, or as raw entries that may be
// negative or out of order) and raw attention arguments. Invariants checked:
//   - validation never crashes, and what it accepts is what the planner and kernels assume;
//   - a valid plan gives every token exactly one owner; locate and global_token are inverse;
//     position ids count from each sequence's start; shards are within bounds;
//   - host scatter then gather is the identity;
//   - every (query rank, key rank) block list of a causal plan groups into valid kernel groups.
// A broken invariant aborts with a message (libFuzzer reports it as a crash with the input).
#include "fuzz_input.hpp"

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace ringattn;

namespace {
using fuzz::reader;
using fuzz::require;

template <class P>
void check_plan(const std::vector<std::int32_t>& cu, int ranks) {
  const validation v = partition_plan<P>::validate(cu, ranks);
  if (!v) {
    require(!v.reason().empty(), "a rejection without a reason");
    return;
  }
  const partition_plan<P> plan(cu, ranks);
  const std::int64_t total = plan.tokens();
  std::int64_t sum = 0;
  for (int r = 0; r < ranks; ++r) {
    require(plan.local_tokens(r) >= 0, "a negative shard");
    require(plan.rank_offset(r) == sum, "rank offsets are not the prefix sums of the shards");
    sum += plan.local_tokens(r);
  }
  require(sum == total, "the shards do not add up to the batch");
  std::vector<unsigned char> seen(static_cast<std::size_t>(total), 0);
  for (std::int64_t g = 0; g < total; ++g) {
    const owner o = plan.locate(g);
    require(o.rank >= 0 && o.rank < ranks, "an owner out of range");
    require(o.local >= 0 && o.local < plan.local_tokens(o.rank), "a local index out of range");
    require(plan.global_token(o.rank, o.local) == g, "locate and global_token disagree");
    unsigned char& s = seen[static_cast<std::size_t>(plan.rank_offset(o.rank) + o.local)];
    require(s == 0, "a shard slot owned twice");
    s = 1;
  }
  for (int r = 0; r < ranks; ++r) {
    const auto pos = plan.position_ids(r);
    require(static_cast<std::int64_t>(pos.size()) == plan.local_tokens(r), "position ids count");
    for (std::int64_t l = 0; l < plan.local_tokens(r); ++l) {
      const std::int64_t g = plan.global_token(r, l);
      require(pos[static_cast<std::size_t>(l)] == g - cu[plan.sequence_of(g)],
              "a position id not counted from its sequence's start");
    }
  }
  // Scatter then gather: one float per token, its own index.
  std::vector<float> full(static_cast<std::size_t>(total)), back(full.size(), -1.0f),
      shards(full.size(), -1.0f);
  for (std::int64_t g = 0; g < total; ++g)
    full[static_cast<std::size_t>(g)] = static_cast<float>(g);
  for (int r = 0; r < ranks; ++r)
    scatter(plan, r, thd_view<const float>(full.data(), total, 1, 1),
            thd_view<float>(shards.data() + plan.rank_offset(r), plan.local_tokens(r), 1, 1));
  gather(plan, thd_view<const float>(shards.data(), total, 1, 1),
         thd_view<float>(back.data(), total, 1, 1));
  require(back == full, "scatter then gather is not the identity");
  // Causal blocks of every pair group into kernel groups that validate.
  const position_window causal_window{unbounded, 0};
  for (int q = 0; q < ranks; ++q)
    for (int k = 0; k < ranks; ++k) {
      const auto groups = group_blocks(plan.blocks(q, k, causal_window));
      require(validate_groups(groups, plan.local_tokens(q), plan.local_tokens(k)).is_ok(),
              "a plan's blocks make invalid kernel groups");
    }
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  reader in{data, size};
  const int which = in.take<std::uint8_t>() % 4;
  const int ranks = 1 + in.take<std::uint8_t>() % 16;
  const int entries = in.take<std::uint8_t>() % 10;
  const bool raw = (in.take<std::uint8_t>() & 1) != 0;
  std::vector<std::int32_t> cu;
  if (raw) { // anything, checked by validation
    for (int i = 0; i < entries; ++i)
      cu.push_back(in.take<std::int16_t>());
  } else { // lengths of up to 599 tokens: a valid layout
    cu.push_back(0);
    for (int i = 1; i < entries; ++i)
      cu.push_back(cu.back() + in.take<std::uint16_t>() % 600);
  }
  const attention_arguments args{in.take<std::int32_t>(), in.take<std::int32_t>(),
                                 in.take<std::int32_t>(),
                                 std::bit_cast<float>(in.take<std::uint32_t>())};
  const validation a = args.validate();
  if (a) {
    require(args.q_heads > 0 && args.kv_heads > 0 && args.q_heads % args.kv_heads == 0,
            "accepted heads the kernels cannot take");
    require(args.head_dim == 64 || args.head_dim == 128 || args.head_dim == 192 ||
                args.head_dim == 256,
            "accepted an unsupported head_dim");
    require(std::isfinite(args.scale()) && args.scale() > 0.0, "accepted a bad scale");
  } else {
    require(!a.reason().empty(), "a rejection without a reason");
  }
  switch (which) {
  case 0: check_plan<contiguous>(cu, ranks); break;
  case 1: check_plan<round_robin>(cu, ranks); break;
  case 2: check_plan<zigzag>(cu, ranks); break;
  default: check_plan<balanced>(cu, ranks); break;
  }
  return 0;
}
