#pragma once
// Bytes a rank sends under the all-to-all schedule, from the shapes alone (the formula of
// docs/schedules.md): forward, its n_r tokens of every other rank's heads of q, k, v, then, of its
// own heads, every other shard's output rows and lse; backward, q, k, v, out, dout and lse the
// same way, then every other shard's dq, dk, dv of its heads (dk, dv in fp32 where kv heads are
// replicated, P > kv_heads).
#include <ringattn/arguments.cuh>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace ringattn::test {

struct all_to_all_bytes {
  std::uint64_t forward = 0, backward = 0;
};

//! `tokens`: every rank's shard size; `element`: bytes of one element of T.
inline all_to_all_bytes all_to_all_bytes_of(const std::vector<std::int64_t>& tokens, int r,
                                            const attention_arguments& a, std::uint64_t element) {
  const auto p = static_cast<std::uint64_t>(tokens.size());
  const std::uint64_t hq = static_cast<std::uint64_t>(a.q_heads) / p;
  const bool replicated = p > static_cast<std::uint64_t>(a.kv_heads);
  const std::uint64_t hk = replicated ? 1 : static_cast<std::uint64_t>(a.kv_heads) / p;
  const std::uint64_t d = static_cast<std::uint64_t>(a.qk_dim());
  const std::uint64_t dv = static_cast<std::uint64_t>(a.v_dim());
  const std::uint64_t e = element, f = sizeof(float);
  const auto n = static_cast<std::uint64_t>(tokens[static_cast<std::size_t>(r)]);
  all_to_all_bytes b;
  for (std::size_t s = 0; s < tokens.size(); ++s) {
    if (static_cast<int>(s) == r) continue;
    const auto m = static_cast<std::uint64_t>(tokens[s]);
    b.forward += n * (hq * d + hk * d + hk * dv) * e + m * hq * dv * e + m * hq * f;
    b.backward += n * (hq * d + hk * d + hk * dv + 2 * hq * dv) * e + n * hq * f + m * hq * d * e +
                  m * hk * (d + dv) * (replicated ? f : e);
  }
  return b;
}

} // namespace ringattn::test
