// libFuzzer target over views, sizes and the overlap checks (docs/reliability.md). Input: raw view
// shapes and strides (any 64-bit values), raw attention arguments with token counts up to
// 2^31 - 1, and two small views laid over one arena. Invariants checked:
//   - view validation never overflows (UBSan aborts on any signed overflow) and accepts only views
//     whose last element's byte offset fits a 64-bit count;
//   - the ring's workspace layout of valid arguments computes every size without wrapping;
//   - the overlap check never misses two views that share a byte (checked byte by byte), and is
//     exact for dense views of one token stride with two tokens or more.
// A broken invariant aborts with a message (libFuzzer reports it as a crash with the input).
#include "fuzz_input.hpp"

#include <ringattn/arguments.cuh>
#include <ringattn/ring/validation.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_bf16.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

using fuzz::reader;
using fuzz::require;

alignas(16) std::array<T, 2048> arena; // 4 KB the small views lie in

// Raw shapes: validation must not overflow, and what it accepts must be addressable.
void check_raw_view(reader& in) {
  thd_view<const T> v(arena.data(), in.take<std::int64_t>(), in.take<std::int32_t>(),
                      in.take<std::int32_t>(), in.take<std::int64_t>(), in.take<std::int64_t>());
  const validation r = validate_view(v, "q");
  if (!r) {
    require(!r.reason().empty(), "a rejection without a reason");
    return;
  }
  if (v.tokens == 0) return;
  std::int64_t last = 0, x = 0; // the last element's offset, then in bytes
  bool wraps = __builtin_mul_overflow(v.tokens - 1, v.token_stride, &last);
  wraps =
      wraps || __builtin_mul_overflow(static_cast<std::int64_t>(v.heads) - 1, v.head_stride, &x);
  wraps = wraps || __builtin_add_overflow(last, x, &last);
  wraps = wraps || __builtin_add_overflow(last, static_cast<std::int64_t>(v.head_dim), &last);
  wraps = wraps || __builtin_mul_overflow(last, static_cast<std::int64_t>(sizeof(T)), &last);
  require(!wraps, "accepted a view whose byte span overflows 64 bits");
}

// Every workspace size of valid arguments, exactly (128-bit) against what the layout computes.
void check_workspace(reader& in) {
  const attention_arguments args{in.take<std::int32_t>(), in.take<std::int32_t>(),
                                 in.take<std::int32_t>(), 0.0f};
  const std::int64_t n = in.take<std::uint32_t>() & 0x7fffffff;
  const std::int64_t kv = in.take<std::uint32_t>() & 0x7fffffff;
  const std::size_t elem = (in.take<std::uint8_t>() & 1) ? 4 : 2;
  if (!args.validate()) return;
  const ring_workspace w(n, kv, args, elem);
  using wide = unsigned __int128;
  auto align = [](wide x) { return (x + 255) / 256 * 256; };
  const wide kv_el = wide(kv) * args.kv_heads * args.head_dim;
  const wide q_el = wide(n) * args.q_heads * args.head_dim;
  const wide lse = wide(n) * args.q_heads * 4;
  const wide slot = align(2 * kv_el * elem);
  const wide grad_slot = align(2 * kv_el * elem + 2 * kv_el * 4);
  const wide forward = 2 * slot + align(q_el * 4) + lse;
  const wide host_backward = 2 * grad_slot + align(q_el * 4) + lse;
  const wide device_backward = align(host_backward) + align(2 * kv_el * 4);
  require(device_backward < (wide(1) << 63), "a valid layout whose workspace nears 2^64 bytes");
  require(w.forward_bytes() == forward, "the forward workspace size wrapped");
  require(w.host_backward_bytes() == host_backward, "the backward workspace size wrapped");
  require(w.device_backward_bytes() == device_backward, "the device workspace size wrapped");
  require(w.largest_message(true) == 2 * kv_el * elem + 2 * kv_el * 4, "a message size wrapped");
}

// Two small views over the arena: the overlap check against the bytes they cover.
thd_view<const T> small_view(reader& in) {
  const int heads = 1 + in.take<std::uint8_t>() % 4, d = 1 + in.take<std::uint8_t>() % 8;
  const std::int64_t head_stride = d + in.take<std::uint8_t>() % 8;
  const std::int64_t row = (heads - 1) * head_stride + d;
  const std::int64_t token_stride = row + in.take<std::uint8_t>() % 16;
  const std::int64_t tokens = in.take<std::uint8_t>() % 9;
  const std::int64_t base = in.take<std::uint16_t>() % 512;
  return {arena.data() + base, tokens, heads, d, token_stride, head_stride};
}

void check_overlap(reader& in) {
  using checks = detail::ring_checks;
  const thd_view<const T> a = small_view(in), b = small_view(in);
  std::array<unsigned char, sizeof(arena)> covered{};
  auto each_byte = [](const thd_view<const T>& v, auto&& f) {
    for (std::int64_t t = 0; t < v.tokens; ++t)
      for (int h = 0; h < v.heads; ++h)
        for (int e = 0; e < v.head_dim; ++e) {
          const auto at = reinterpret_cast<const unsigned char*>(&v(t, h, e)) -
                          reinterpret_cast<const unsigned char*>(arena.data());
          f(static_cast<std::size_t>(at));
          f(static_cast<std::size_t>(at) + 1);
        }
  };
  each_byte(a, [&](std::size_t i) { covered[i] = 1; });
  bool shared = false;
  each_byte(b, [&](std::size_t i) { shared = shared || covered[i] != 0; });
  const bool found = checks::overlap(checks::region_of(a, "a"), checks::region_of(b, "b"));
  require(!shared || found, "two views share a byte but the overlap check missed it");
  // A single token is compared by its span (a conservative refusal, never a miss).
  const bool dense = a.head_stride == a.head_dim && b.head_stride == b.head_dim;
  if (dense && a.token_stride == b.token_stride && a.tokens > 1 && b.tokens > 1)
    require(shared == found, "the overlap check is not exact for dense views of one stride");
}
} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  reader in{data, size};
  check_raw_view(in);
  check_workspace(in);
  check_overlap(in);
  return 0;
}
