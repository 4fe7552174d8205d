// What the numbered examples share: "--name value" flags, a synthetic packed batch, random
// inputs, the sample of rows they check against the float64 oracle, and the GPUs to run on.
// Not part of the library.
#pragma once

#include <ringattn/error.cuh>
#include <ringattn/tensor.cuh>

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>

namespace example {

//! `--help` was asked for: the text to print (on standard output; exit code 0).
struct help_requested {
  std::string text;
};

//! Flags of the form `--name value`, bound to variables. `parse` checks each value strictly: an
//! integer must be a whole decimal number (in [min, max]), a word one of its allowed values; an
//! unknown flag, a missing or a bad value throws `invalid_argument` naming it. `--help` or `-h`
//! throws `help_requested` with the usage.
class flags {
public:
  explicit flags(std::string program, std::string about = "")
      : program_(std::move(program)), about_(std::move(about)) {}
  flags& add(const char* name, int& value, const char* help, int min = 1,
             int max = std::numeric_limits<int>::max()) {
    flags_.push_back({std::string("--") + name, &value, {}, help, min, max});
    return *this;
  }
  flags& add(const char* name, std::string& value, std::initializer_list<const char*> allowed,
             const char* help) {
    flags_.push_back(
        {std::string("--") + name, &value, {allowed.begin(), allowed.end()}, help, 0, 0});
    return *this;
  }
  void parse(int argc, char** argv) const {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") throw help_requested{usage()};
      const flag* f = find(a);
      if (f == nullptr)
        throw ringattn::invalid_argument(program_ + ": unknown option '" + a +
                                         "' (--help lists them)");
      if (i + 1 >= argc) throw ringattn::invalid_argument(program_ + ": " + a + " needs a value");
      const std::string v = argv[++i];
      if (auto* x = std::get_if<int*>(&f->target)) {
        int parsed = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), parsed);
        if (ec != std::errc() || end != v.data() + v.size() || parsed < f->min || parsed > f->max)
          throw ringattn::invalid_argument(program_ + ": " + a + " takes a whole number from " +
                                           std::to_string(f->min) + " to " +
                                           std::to_string(f->max) + " (got '" + v + "')");
        **x = parsed;
      } else {
        bool ok = f->allowed.empty();
        for (const std::string& w : f->allowed)
          ok = ok || w == v;
        if (!ok)
          throw ringattn::invalid_argument(program_ + ": " + a + " takes " + choices(*f) +
                                           " (got '" + v + "')");
        *std::get<std::string*>(f->target) = v;
      }
    }
  }
  std::string usage() const {
    std::string u = "usage: " + program_ + " [options]\n";
    if (!about_.empty()) u += about_ + "\n";
    u += "options (defaults in brackets):\n";
    for (const flag& f : flags_) {
      std::string value;
      if (auto* x = std::get_if<int*>(&f.target))
        value = "N [" + std::to_string(**x) + "]";
      else
        value = choices(f) + " [" + *std::get<std::string*>(f.target) + "]";
      u += "  " + f.name + " " + value + "\n      " + f.help + "\n";
    }
    return u;
  }

private:
  struct flag {
    std::string name;
    std::variant<int*, std::string*> target;
    std::vector<std::string> allowed;
    std::string help;
    int min, max;
  };
  static std::string choices(const flag& f) {
    std::string c;
    for (const std::string& w : f.allowed)
      c += (c.empty() ? "" : "|") + w;
    return c;
  }
  const flag* find(const std::string& a) const {
    for (const flag& f : flags_)
      if (f.name == a) return &f;
    return nullptr;
  }
  std::string program_, about_;
  std::vector<flag> flags_;
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

//! GPUs an example runs on for `--device auto|cpu|gpu`: 0 for the host path (no GPU, `cpu`, or a
//! build without CUDA); `gpu` where there is none throws.
inline int gpu_count(const std::string& device) {
#if defined(__CUDACC__)
  int n = 0;
  if (device == "cpu" || cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  if (device == "gpu" && n == 0) throw ringattn::error("--device gpu: no CUDA device");
  return n;
#else
  if (device == "gpu") throw ringattn::error("--device gpu: this build has no CUDA");
  return 0;
#endif
}

} // namespace example
