#pragma once
//! \file
//! What one call of a block kernel computes: a rank's queries against one K/V block, described as
//! *block groups*, and what an epilogue does with the state (`step_epilogue`).
//!
//! A block group is one query segment (rows `[q_begin, q_begin + q_count)` of the rank's Q shard)
//! with the key segments of the K/V block it attends to (at most `max_blocks_per_group`: zigzag
//! gives two), each with its band `lo <= j - i <= hi` on local indices (i: row within the query
//! segment, j: column within the key segment). Groups of one call never share query rows, so a
//! kernel may give each group's rows to one thread block and merge into the state without atomics.
//!
//! \code
//! auto blocks = plan.blocks(rank, src, ringattn::position_window::of(mask_kind::causal));
//! auto groups = ringattn::group_blocks(blocks);      // what the block kernel takes
//! \endcode

#include <ringattn/arguments.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/error.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace ringattn {

//! Groups a plan's blocks (`partition_plan::blocks`) by query segment, in the order their first
//! blocks come. Empty blocks are dropped. O(n log n) in the blocks.
inline std::vector<block_group> group_blocks(std::span<const block> blocks) {
  std::vector<block_group> groups;
  std::map<std::pair<std::int64_t, std::int64_t>, std::size_t> index; // (q_begin, q_count)
  for (const block& b : blocks) {
    if (b.kind == block_kind::empty) continue;
    const auto [it, added] = index.try_emplace({b.q.local_begin, b.q.count}, groups.size());
    if (added) groups.push_back({b.q.local_begin, b.q.count, 0, {}});
    block_group& g = groups[it->second];
    if (g.count == max_blocks_per_group)
      throw invalid_argument("ringattn: a query segment meets more than " +
                             std::to_string(max_blocks_per_group) + " key segments in one block");
    g.kv[g.count++] = {b.kv.local_begin, b.kv.count, b.mask};
  }
  return groups;
}

//! Query rows the groups cover (groups never share rows: `validate_groups`).
inline std::int64_t rows_of(std::span<const block_group> groups) {
  std::int64_t n = 0;
  for (const block_group& g : groups)
    n += g.q_count;
  return n;
}

//! Checks that groups fit a Q shard of `q_tokens` and a K/V block of `kv_tokens` rows and that no
//! two groups share a query row (the kernels rely on it).
inline validation validate_groups(std::span<const block_group> groups, std::int64_t q_tokens,
                                  std::int64_t kv_tokens) {
  validation r = validation::ok();
  // Lengths are int32 throughout (cu_seqlens, the kernels' work tiles): a larger shard is refused
  // here rather than wrapping around.
  constexpr std::int64_t most = std::numeric_limits<std::int32_t>::max();
  r.require(q_tokens <= most && kv_tokens <= most, "a block of ", q_tokens, " query and ",
            kv_tokens, " key tokens exceeds the int32 limit of ", most, " tokens");
  r.require(groups.size() <= static_cast<std::size_t>(most), "more than ", most, " groups");
  std::vector<std::pair<std::int64_t, std::int64_t>> rows;
  for (std::size_t g = 0; g < groups.size() && r; ++g) {
    const block_group& x = groups[g];
    r.require(x.q_begin >= 0 && x.q_count >= 0 && x.q_begin + x.q_count <= q_tokens, "group ", g,
              " covers query rows [", x.q_begin, ", ", x.q_begin + x.q_count,
              ") outside the Q shard of ", q_tokens, " tokens");
    r.require(x.count >= 0 && x.count <= max_blocks_per_group, "group ", g, " has ", x.count,
              " key segments (at most ", max_blocks_per_group, ")");
    for (int i = 0; i < x.count && r; ++i)
      r.require(x.kv[i].kv_begin >= 0 && x.kv[i].kv_count >= 0 &&
                    x.kv[i].kv_begin + x.kv[i].kv_count <= kv_tokens,
                "group ", g, " reads key rows [", x.kv[i].kv_begin, ", ",
                x.kv[i].kv_begin + x.kv[i].kv_count, ") outside the K/V block of ", kv_tokens,
                " tokens");
    if (x.q_count > 0) rows.emplace_back(x.q_begin, x.q_begin + x.q_count);
  }
  std::sort(rows.begin(), rows.end());
  for (std::size_t i = 1; i < rows.size() && r; ++i)
    r.require(rows[i].first >= rows[i - 1].second, "two groups share query rows (", rows[i].first,
              " < ", rows[i - 1].second, ")");
  return r;
}

//! What a block kernel's epilogue does with the running state in one call (a ring decides it per
//! step when its schedule is built, ring/schedule.cuh):
//! - `none`: no query sees the block; nothing runs;
//! - `plain`: no state; the block's result is the output (`out` and the lse);
//! - `fresh`: the first merge, covering every query row: writes the state without reading it;
//! - `merge`: merges into the state;
//! - `merge_out`: the last merge, covering every query row: merges and writes the output itself
//!   (the state's lse becomes the rows' lse).
enum class step_epilogue { none, plain, fresh, merge, merge_out };

constexpr const char* to_string(step_epilogue e) noexcept {
  switch (e) {
  case step_epilogue::none: return "none";
  case step_epilogue::plain: return "plain";
  case step_epilogue::fresh: return "fresh";
  case step_epilogue::merge: return "merge";
  case step_epilogue::merge_out: return "merge_out";
  }
  return "?";
}

//! How a split-K/V schedule sizes its launch: `fitted` to the step's lengths, or `fixed`: the
//! same launch for every step of the same groups (query rows per group, head shapes) on the same
//! device whatever their key counts, groups without keys kept (their rows see nothing in this
//! block) and units past the step's left empty, so that a launch captured in a CUDA graph serves
//! later steps of other lengths. At most one wave of thread blocks then, or a unit per group.
enum class split_launch { fitted, fixed };

} // namespace ringattn
