#pragma once
// Bytes a rank sends under the all-to-all schedule and its hybrid, from the shapes alone (the
// formula of docs/ring.md): forward, its n_r tokens of every other rank's heads of q, k, v,
// then, of its own heads, every other shard's output rows and lse; backward, q, k, v, out, dout
// and lse the same way, then every other shard's dq, dk, dv of its heads (dk, dv in fp32 where
// ranks share kv heads: replicated ones, P > kv_heads, or the groups of the hybrid).
#include <ringattn/arguments.cuh>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ringattn::test {

struct all_to_all_bytes {
  std::uint64_t forward = 0, backward = 0;
};

//! `tokens`: every rank's shard size; `element`: bytes of one element of T; `group`: ranks per
//! group of the hybrid (0: all of them, the plain all-to-all). Within the group: q (and the
//! backward's out, dout, lse) of this rank's tokens out, the group's output rows, lse and dq
//! back; across every rank: K/V of this rank's tokens out, dK/dV rows back.
inline all_to_all_bytes all_to_all_bytes_of(const std::vector<std::int64_t>& tokens, int r,
                                            const attention_arguments& a, std::uint64_t element,
                                            int group = 0) {
  const int p = static_cast<int>(tokens.size());
  const int g = group == 0 ? p : group;
  const std::uint64_t hq = static_cast<std::uint64_t>(a.q_heads / g);
  const int replicas = g > a.kv_heads ? g / a.kv_heads : 1;
  const bool shared = (p / g) * replicas > 1;
  const std::uint64_t hk = g > a.kv_heads ? 1 : static_cast<std::uint64_t>(a.kv_heads / g);
  const std::uint64_t d = static_cast<std::uint64_t>(a.qk_dim());
  const std::uint64_t dv = static_cast<std::uint64_t>(a.v_dim());
  const std::uint64_t e = element, f = sizeof(float);
  const auto n = static_cast<std::uint64_t>(tokens[static_cast<std::size_t>(r)]);
  all_to_all_bytes b;
  for (int s = 0; s < p; ++s) {
    if (s == r) continue;
    const auto m = static_cast<std::uint64_t>(tokens[static_cast<std::size_t>(s)]);
    b.forward += n * hk * (d + dv) * e;
    b.backward += n * hk * (d + dv) * e + m * hk * (d + dv) * (shared ? f : e);
    if (s / g != r / g) continue;
    b.forward += n * hq * d * e + m * hq * dv * e + m * hq * f;
    b.backward += n * (hq * d + 2 * hq * dv) * e + n * hq * f + m * hq * d * e;
  }
  return b;
}

} // namespace ringattn::test
