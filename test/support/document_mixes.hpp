#pragma once
// Packed batches of documents, as long-context training packs them: the mixes the partitioner
// tests and bench/plan.cpp compare the partitioners on. Each returns cu_seqlens of exactly
// `tokens` tokens; the random ones draw from a seeded mt19937_64, so a mix is the same everywhere.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace ringattn::test {

struct document_mix {
  std::string name;
  std::vector<std::int32_t> cu_seqlens;
};

// Appends documents of the given lengths until `tokens`, the last one cut to fit.
template <class Draw>
std::vector<std::int32_t> pack_documents(std::int64_t tokens, Draw draw) {
  std::vector<std::int32_t> cu{0};
  while (cu.back() < tokens) {
    const std::int64_t n =
        std::min<std::int64_t>(std::max<std::int64_t>(draw(), 1), tokens - cu.back());
    cu.push_back(static_cast<std::int32_t>(cu.back() + n));
  }
  return cu;
}

// Long tail: Pareto lengths, shape 1.1 from 64 tokens (median ~120; one in ten over 520, one
// in a hundred over 4,200 tokens), seeded.
inline document_mix long_tail_mix(std::int64_t tokens, std::uint64_t seed = 2026) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  return {"long-tail", pack_documents(tokens, [&] {
            const double x = 64.0 / std::pow(1.0 - u(rng), 1.0 / 1.1);
            return static_cast<std::int64_t>(std::min(x, 1e9));
          })};
}

// One document of half the tokens first, then documents of 256 tokens.
inline document_mix one_long_mix(std::int64_t tokens) {
  bool first = true;
  return {"one long + short", pack_documents(tokens, [&]() -> std::int64_t {
            if (!first) return 256;
            first = false;
            return tokens / 2;
          })};
}

// Every document shorter than `ranks`: lengths 1 .. ranks - 1 (1 where ranks <= 2), seeded.
inline document_mix all_short_mix(std::int64_t tokens, int ranks, std::uint64_t seed = 2026) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> len(1, std::max(1, ranks - 1));
  return {"all short", pack_documents(tokens, [&] { return len(rng); })};
}

// Lengths uniform in [256, 4096], seeded.
inline document_mix uniform_mix(std::int64_t tokens, std::uint64_t seed = 2026) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> len(256, 4096);
  return {"uniform", pack_documents(tokens, [&] { return len(rng); })};
}

inline std::vector<document_mix> document_mixes(std::int64_t tokens, int ranks) {
  return {long_tail_mix(tokens), one_long_mix(tokens), all_short_mix(tokens, ranks),
          uniform_mix(tokens)};
}

} // namespace ringattn::test
