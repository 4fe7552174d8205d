#pragma once
// What the libFuzzer targets share: reading typed values from the input, and failing an
// invariant loudly (libFuzzer reports the abort as a crash with the input).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ringattn::fuzz {

inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "invariant broken: %s\n", what);
  std::abort();
}

//! Reads little-endian values from the input; past its end, zeros.
struct reader {
  const std::uint8_t* data;
  std::size_t size, at = 0;
  template <class V>
  V take() {
    unsigned char bytes[sizeof(V)] = {};
    for (std::size_t i = 0; i < sizeof(V) && at < size; ++i)
      bytes[i] = data[at++];
    V v;
    std::memcpy(&v, bytes, sizeof(V));
    return v;
  }
};

} // namespace ringattn::fuzz
