#pragma once
// What a rank sends in a ring_pass forward, counted from the plan alone: after each step but the
// last, the block it used goes on to the next rank unless no rank at a later hop sees any of it
// (brute force over every later rank's blocks). The tests compare the communicator's byte count
// with it.
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

} // namespace ringattn::test
