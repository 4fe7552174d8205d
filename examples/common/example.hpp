// What the numbered examples share: "--name value" flags, a synthetic packed batch, random
// inputs, and the sample of rows they check against the float64 oracle. Not part of the library.
#pragma once

#include <ringattn/error.cuh>
#include <ringattn/tensor.cuh>

#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace example {

//! Flags of the form `--name value`, bound to variables; `parse` throws on anything else.
class flags {
public:
  flags& add(const char* name, int& value) { return bind(name, &value); }
  flags& add(const char* name, std::string& value) { return bind(name, &value); }
  void parse(int argc, char** argv) const {
    for (int i = 1; i < argc; i += 2) {
      const std::string a = argv[i];
      const auto* f = find(a);
      if (f == nullptr || i + 1 >= argc)
        throw ringattn::invalid_argument("unknown option or missing value: " + a + "\n" + usage());
      if (auto* x = std::get_if<int*>(&f->second))
        **x = std::atoi(argv[i + 1]);
      else
        *std::get<std::string*>(f->second) = argv[i + 1];
    }
  }
  std::string usage() const {
    std::string u = "options:";
    for (const auto& [name, _] : flags_)
      u += " [" + name + " value]";
    return u;
  }

private:
  using target = std::variant<int*, std::string*>;
  flags& bind(const char* name, target t) {
    flags_.emplace_back(std::string("--") + name, t);
    return *this;
  }
  const std::pair<std::string, target>* find(const std::string& a) const {
    for (const auto& f : flags_)
      if (f.first == a) return &f;
    return nullptr;
  }
  std::vector<std::pair<std::string, target>> flags_;
};

//! Offsets of `sequences` packed sequences of uneven, odd lengths summing to `tokens`.
inline std::vector<std::int32_t> packed_batch(std::int32_t tokens, int sequences) {
  if (sequences < 1 || tokens < sequences)
    throw ringattn::invalid_argument("need at least one token per sequence");
  std::vector<std::int32_t> cu{0};
  for (int b = 0; b < sequences; ++b) {
    const std::int32_t left = tokens - cu.back(), parts = sequences - b;
    cu.push_back(cu.back() + (b + 1 == sequences ? left : (left / parts) | 1));
  }
  return cu;
}

//! `n` values uniform in [-1, 1) in the storage type T.
template <class T>
std::vector<T> random_values(std::size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> x(n);
  for (auto& e : x)
    e = ringattn::from_float<T>(u(rng));
  return x;
}

//! Rows to check: the first and last of every sequence, and `extra` random ones.
inline std::vector<std::int64_t> sample_rows(const std::vector<std::int32_t>& cu, int extra,
                                             std::mt19937_64& rng) {
  std::vector<std::int64_t> rows;
  for (std::size_t b = 0; b + 1 < cu.size(); ++b)
    if (cu[b + 1] > cu[b]) rows.push_back(cu[b]), rows.push_back(cu[b + 1] - 1);
  std::uniform_int_distribution<std::int64_t> any(0, cu.back() - 1);
  for (int i = 0; i < extra; ++i)
    rows.push_back(any(rng));
  return rows;
}

} // namespace example
