#pragma once
// Shared helpers for ringattn's tests: fresh random inputs (seed printed on failure), poisoning.
#include <ringattn/tensor.cuh>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace ringattn::test {

//! A fresh seed per call (std::random_device), reported through doctest on failure. Set
//! RINGATTN_TEST_SEED to replay one.
inline std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("RINGATTN_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

//! Host buffer of random values in [-1, 1) rounded to T.
template <class T>
std::vector<T> random_buffer(std::size_t n, std::mt19937_64& rng, float scale = 1.0f) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<T> v(n);
  for (auto& x : v)
    x = from_float<T>(u(rng));
  return v;
}

//! A value no computation produces, to find unwritten outputs.
template <class T>
T poison() {
  return from_float<T>(-12345.0f);
}

//! Random packed batch: `batch` sequences of lengths in [min_len, max_len].
inline std::vector<std::int32_t> random_cu_seqlens(int batch, int min_len, int max_len,
                                                   std::mt19937_64& rng) {
  std::uniform_int_distribution<int> len(min_len, max_len);
  std::vector<std::int32_t> cu{0};
  for (int b = 0; b < batch; ++b)
    cu.push_back(cu.back() + len(rng));
  return cu;
}

//! The bad-input tables (test_bad_input.cpp, .cu): each case is {input, error substring, breaks};
//! `run(breaks, clean)` makes the call with one input spoilt and returns what it threw, setting
//! `clean` when nothing was launched, sent or written. Every case must throw its error cleanly.
template <class Cases, class Run>
void check_bad_cases(const Cases& cases, Run run) {
  for (const auto& c : cases) {
    const std::string input = c.input;
    CAPTURE(input);
    bool clean = false;
    const std::string what = run(c.breaks, clean);
    CHECK_MESSAGE(what.find(c.error) != std::string::npos, "got: ", what);
    CHECK(clean);
  }
}

} // namespace ringattn::test
