#pragma once
// What a rank sends, counted from the plan alone (brute force over the plan's blocks); the tests
// compare the communicators' byte counts with it.
// - ring_pass forward: after each step but the last, the block it used goes on to the next rank
//   unless no rank at a later hop sees any of it.
// - all_gather_kv: exchange t (1 .. steps - 1) sends the own block to rank r + t where that rank
//   sees some of it (forward, and again in the backward), and the backward returns the fp32
//   dK/dV share of each block r sees to its owner.
#include <ringattn/core/mask.cuh>
#include <ringattn/core/segment.cuh>

#include <cstdint>

namespace ringattn::test {

template <class T, class Ring>
std::uint64_t ring_forward_bytes(const Ring& attn, int r, mask_kind mask) {
  const auto& plan = attn.plan();
  const int p = plan.ranks(), steps = attn.schedule().step_count();
  const position_window w = attn.arguments().window(mask);
  std::uint64_t bytes = 0;
  for (int t = 0; t + 1 < steps; ++t) {
    const int source = ((r - t) % p + p) % p;
    bool seen = false;
    for (int u = t + 1; u < steps && !seen; ++u)
      seen = !plan.blocks((source + u) % p, source, w).empty();
    if (seen) bytes += attn.template block_bytes<T>(source);
  }
  return bytes;
}

template <class T, class Ring>
std::uint64_t all_gather_bytes(const Ring& attn, int r, mask_kind mask) {
  const auto& plan = attn.plan();
  const int p = plan.ranks(), steps = attn.schedule().step_count();
  const position_window w = attn.arguments().window(mask);
  std::uint64_t bytes = 0;
  for (int t = 1; t < steps; ++t)
    if (!plan.blocks((r + t) % p, r, w).empty()) bytes += attn.template block_bytes<T>(r);
  return bytes;
}

template <class Ring>
std::uint64_t all_gather_share_bytes(const Ring& attn, int r, mask_kind mask) {
  const auto& plan = attn.plan();
  const auto& a = attn.arguments();
  const int p = plan.ranks(), steps = attn.schedule().step_count();
  const position_window w = a.window(mask);
  std::uint64_t bytes = 0;
  for (int t = 1; t < steps; ++t) {
    const int source = ((r - t) % p + p) % p;
    if (!plan.blocks(r, source, w).empty())
      bytes += sizeof(float) * static_cast<std::uint64_t>(attn.schedule().travel_tokens(source)) *
               a.kv_heads * (a.qk_dim() + a.v_dim());
  }
  return bytes;
}

} // namespace ringattn::test
