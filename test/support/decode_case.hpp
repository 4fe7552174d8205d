#pragma once
// A KV cache sharded across ranks, and decode steps over it: the cache starts as each rank's
// shard of a packed prefill (a partitioner's layout), every step draws new tokens (the same on
// every rank), the float64 oracle attends each new token to its whole sequence (the prefill, the
// earlier steps' tokens, the new tokens up to its own), and after the step each new token's K/V
// goes to its owner (owned_new_rows). Shared by the host and the device decode tests.
#include "common.hpp"
#include "strict_check.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/reference/attention.cuh>
#include <ringattn/sharded_attention.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace ringattn::test {

//! Whether two ranks' step results (output and lse) are the same bits.
template <class T>
bool same_bits(const std::vector<T>& out_a, const std::vector<float>& lse_a,
               const std::vector<T>& out_b, const std::vector<float>& lse_b) {
  return out_a.size() == out_b.size() && lse_a.size() == lse_b.size() &&
         (out_a.empty() ||
          std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(T)) == 0) &&
         (lse_a.empty() ||
          std::memcmp(lse_a.data(), lse_b.data(), lse_a.size() * sizeof(float)) == 0);
}

// Bytes of one rank's finished partial of a decode step (sharded_attention::step_bytes): the
// normalised output of `rows` rows x `dv` elements of `element` bytes and an fp32 lse per row,
// each 16-byte aligned.
inline std::uint64_t finished_partial_bytes(std::int64_t rows, int dv, std::size_t element) {
  auto align16 = [](std::uint64_t n) { return (n + 15) / 16 * 16; };
  return align16(static_cast<std::uint64_t>(rows) * dv * element) +
         align16(static_cast<std::uint64_t>(rows) * sizeof(float));
}

template <class P, class T>
struct decode_case {
  // One step's new tokens and the oracle's answer for them.
  struct step {
    std::vector<std::int32_t> cu_new{0};
    std::vector<T> q, k, v;
    std::int64_t tokens = 0;
    reference::forward_result oracle;
  };
  // A rank's cache shard, its sequences packed in order.
  struct shard {
    std::vector<std::int32_t> cu{0};
    std::vector<T> k, v;
    std::int64_t tokens() const { return cu.back(); }
  };

  attention_arguments args;
  int ranks;
  int batch;
  std::vector<std::vector<T>> whole_q, whole_k, whole_v; // per sequence, every position so far
  // The oracle's keys and values: those of whole_k and whole_v, or the values a quantised cache
  // reads (`set_cached`).
  std::vector<std::vector<double>> exact_k, exact_v;
  std::vector<std::vector<std::vector<T>>> cache_k, cache_v;    // [rank][sequence]
  std::vector<std::vector<std::vector<std::int64_t>>> cache_at; // [rank][sequence]: positions

  decode_case(const std::vector<std::int32_t>& prefill, int ranks_, attention_arguments a,
              std::mt19937_64& rng)
      : args(a), ranks(ranks_), batch(static_cast<int>(prefill.size()) - 1) {
    const partition_plan<P> plan(prefill, ranks);
    const std::size_t row = kv_row(), vrow = v_row();
    const auto k = random_buffer<T>(plan.tokens() * row, rng);
    const auto v = random_buffer<T>(plan.tokens() * vrow, rng);
    whole_q.resize(batch), whole_k.resize(batch), whole_v.resize(batch);
    for (int b = 0; b < batch; ++b) {
      whole_k[b].assign(k.begin() + prefill[b] * row, k.begin() + prefill[b + 1] * row);
      whole_v[b].assign(v.begin() + prefill[b] * vrow, v.begin() + prefill[b + 1] * vrow);
      whole_q[b].resize(whole_k[b].size() / a.kv_heads * a.q_heads); // prefill queries: unused
    }
    auto exact = [](const std::vector<T>& x) {
      std::vector<double> r;
      for (const T& e : x)
        r.push_back(to_float(e));
      return r;
    };
    for (int b = 0; b < batch; ++b) {
      exact_k.push_back(exact(whole_k[b]));
      exact_v.push_back(exact(whole_v[b]));
    }
    cache_k.assign(ranks, std::vector<std::vector<T>>(batch));
    cache_v = cache_k;
    cache_at.assign(ranks, std::vector<std::vector<std::int64_t>>(batch));
    for (int r = 0; r < ranks; ++r) {
      const auto local = plan.local_cu_seqlens(r);
      for (int b = 0; b < batch; ++b)
        for (std::int64_t l = local[b]; l < local[b + 1]; ++l) {
          const std::int64_t g = plan.global_token(r, l);
          cache_at[r][b].push_back(g - prefill[b]);
          cache_k[r][b].insert(cache_k[r][b].end(), k.begin() + g * row, k.begin() + (g + 1) * row);
          cache_v[r][b].insert(cache_v[r][b].end(), v.begin() + g * vrow,
                               v.begin() + (g + 1) * vrow);
        }
    }
  }

  std::size_t kv_row() const { return static_cast<std::size_t>(args.kv_heads) * args.head_dim; }
  std::size_t v_row() const { return static_cast<std::size_t>(args.kv_heads) * args.v_dim(); }
  std::size_t q_row() const { return static_cast<std::size_t>(args.q_heads) * args.head_dim; }
  std::int64_t length(int b) const {
    return static_cast<std::int64_t>(whole_k[b].size() / kv_row());
  }

  shard rank_shard(int r) const {
    shard s;
    for (int b = 0; b < batch; ++b) {
      s.k.insert(s.k.end(), cache_k[r][b].begin(), cache_k[r][b].end());
      s.v.insert(s.v.end(), cache_v[r][b].begin(), cache_v[r][b].end());
      s.cu.push_back(static_cast<std::int32_t>(s.k.size() / kv_row()));
    }
    return s;
  }

  // New tokens: `lo`..`hi` per sequence (0 allowed), and the oracle over the whole sequences.
  step draw(std::mt19937_64& rng, int lo, int hi) const {
    std::vector<std::int32_t> cu_new{0};
    for (int b = 0; b < batch; ++b)
      cu_new.push_back(cu_new.back() + lo + static_cast<std::int32_t>(rng() % (hi - lo + 1)));
    return draw(rng, cu_new);
  }
  // New tokens packed as `cu_new` (batch + 1 offsets).
  step draw(std::mt19937_64& rng, const std::vector<std::int32_t>& cu_new) const {
    step s;
    s.cu_new = cu_new;
    s.tokens = s.cu_new.back();
    s.q = random_buffer<T>(s.tokens * q_row(), rng);
    s.k = random_buffer<T>(s.tokens * kv_row(), rng);
    s.v = random_buffer<T>(s.tokens * v_row(), rng);
    solve(s);
    return s;
  }

  // The oracle of step `s` (again, after its inputs were changed).
  void solve(step& s) const {
    std::vector<std::int32_t> cu_whole{0};
    std::vector<T> q_all;
    std::vector<double> k_all, v_all;
    std::vector<std::int64_t> rows;
    for (int b = 0; b < batch; ++b) {
      const std::int64_t cached = length(b), nb = s.cu_new[b + 1] - s.cu_new[b];
      auto append = [&](auto& to, const auto& old, const std::vector<T>& now, std::size_t row) {
        to.insert(to.end(), old.begin(), old.end());
        for (auto x = now.begin() + s.cu_new[b] * row; x != now.begin() + s.cu_new[b + 1] * row;
             ++x)
          if constexpr (std::is_same_v<typename std::decay_t<decltype(to)>::value_type, T>)
            to.push_back(*x);
          else
            to.push_back(to_float(*x));
      };
      append(q_all, whole_q[b], s.q, q_row());
      append(k_all, exact_k[b], s.k, kv_row());
      append(v_all, exact_v[b], s.v, v_row());
      for (std::int64_t i = 0; i < nb; ++i)
        rows.push_back(cu_whole.back() + cached + i);
      cu_whole.push_back(cu_whole.back() + static_cast<std::int32_t>(cached + nb));
    }
    const std::int64_t total = cu_whole.back();
    const int qh = args.q_heads, kvh = args.kv_heads, d = args.head_dim;
    reference::tensor k_t(total, kvh, d), v_t(total, kvh, args.v_dim());
    k_t.data = std::move(k_all);
    v_t.data = std::move(v_all);
    s.oracle = reference::attention_forward_rows(
        reference::to_tensor(thd_view<const T>(q_all.data(), total, qh, d)), k_t, v_t, cu_whole,
        args, position_window::of(mask_kind::causal), rows);
  }

  // Sets element `elem` of row `i` of rank r's cached K (`key`) or V of sequence b to `value`,
  // there and in the whole sequence; `solve` the steps drawn before it again.
  void plant_cache(int r, int b, std::int64_t i, bool key, int elem, float value) {
    const std::size_t row = key ? kv_row() : v_row();
    const std::int64_t pos = cache_at[r][b][static_cast<std::size_t>(i)];
    (key ? cache_k : cache_v)[r][b][i * row + elem] = from_float<T>(value);
    (key ? whole_k : whole_v)[b][pos * row + elem] = from_float<T>(value);
    (key ? exact_k : exact_v)[b][pos * row + elem] = to_float(from_float<T>(value));
  }

  // Every element of the K (`key`) or V held so far times `factor(position)`, rounded to T (the
  // cache, the whole sequences and the oracle's values).
  template <class Factor>
  void rescale(bool key, Factor factor) {
    const std::size_t row = key ? kv_row() : v_row();
    auto times = [&](T& x, std::int64_t pos) {
      x = from_float<T>(static_cast<float>(to_float(x) * factor(pos)));
    };
    for (int r = 0; r < ranks; ++r)
      for (int b = 0; b < batch; ++b)
        for (std::size_t i = 0; i < cache_at[r][b].size(); ++i)
          for (std::size_t e = 0; e < row; ++e)
            times((key ? cache_k : cache_v)[r][b][i * row + e], cache_at[r][b][i]);
    for (int b = 0; b < batch; ++b) {
      auto& whole = (key ? whole_k : whole_v)[b];
      auto& exact = (key ? exact_k : exact_v)[b];
      for (std::size_t i = 0; i < whole.size(); ++i) {
        times(whole[i], static_cast<std::int64_t>(i / row));
        exact[i] = to_float(whole[i]);
      }
    }
  }

  // The oracle reads `value` for element `elem` of row `i` of rank r's cached K (`key`) or V of
  // sequence b (what a quantised copy of the cache holds there); the cache itself is unchanged.
  void set_cached(int r, int b, std::int64_t i, bool key, std::size_t elem, double value) {
    const std::size_t row = key ? kv_row() : v_row();
    const std::int64_t pos = cache_at[r][b][static_cast<std::size_t>(i)];
    (key ? exact_k : exact_v)[b][pos * row + elem] = value;
  }

  // Relative L2 error of `out` and the largest absolute error of `lse` against the oracle.
  std::pair<double, double> error(const step& s, const std::vector<T>& out,
                                  const std::vector<float>& lse) const {
    const int qh = args.q_heads, d = args.v_dim();
    const std::int64_t n = s.tokens;
    double num = 0.0, den = 0.0, lse_err = 0.0;
    for (std::int64_t i = 0; i < n; ++i)
      for (int h = 0; h < qh; ++h) {
        lse_err = std::max(lse_err, std::abs(double(lse[h * n + i]) - s.oracle.lse_at(h, i)));
        for (int e = 0; e < d; ++e) {
          const double got = to_float(out[(i * qh + h) * d + e]), want = s.oracle.out(i, h, e);
          num += (got - want) * (got - want), den += want * want;
        }
      }
    return {den > 0.0 ? std::sqrt(num / den) : std::sqrt(num), lse_err};
  }

  // Element by element against the step's oracle (strict_check.hpp): non-finite exactly where the
  // oracle is, finite elsewhere within `out_bound` (relative L2) and `lse_bound` (absolute);
  // returns how many elements are non-finite.
  std::int64_t check_strict(const step& s, const std::vector<T>& out, const std::vector<float>& lse,
                            double out_bound, double lse_bound) const {
    strict_tally t;
    const int qh = args.q_heads, d = args.v_dim();
    std::int64_t lse_mismatched = 0;
    for (std::int64_t i = 0; i < s.tokens; ++i)
      for (int h = 0; h < qh; ++h) {
        const double got = lse[h * s.tokens + i], want = s.oracle.lse_at(h, i);
        if (std::isfinite(got) != std::isfinite(want)) ++lse_mismatched;
        if (std::isfinite(want) && std::isfinite(got))
          t.lse = std::max(t.lse, std::abs(got - want));
        for (int e = 0; e < d; ++e)
          t.add(to_float(out[(i * qh + h) * d + e]), s.oracle.out(i, h, e));
      }
    CHECK(lse_mismatched == 0);
    CHECK(t.mismatched == 0);
    CHECK(t.rel() < out_bound);
    CHECK(t.lse < lse_bound);
    return t.non_finite;
  }

  // After the step: every new token's K/V to its owner's shard and to the whole sequences.
  // Returns how many tokens the ranks kept (every new token exactly once).
  std::int64_t append(const step& s) {
    std::vector<std::int64_t> lengths;
    for (int b = 0; b < batch; ++b)
      lengths.push_back(length(b));
    std::int64_t kept = 0;
    const std::size_t row = kv_row();
    for (int r = 0; r < ranks; ++r)
      for (const std::int64_t t : owned_new_rows(r, ranks, s.cu_new, lengths)) {
        const auto b = static_cast<int>(
            std::upper_bound(s.cu_new.begin(), s.cu_new.end(), static_cast<std::int32_t>(t)) -
            s.cu_new.begin() - 1);
        if (owner_of(lengths[b] + t - s.cu_new[b], ranks) != r) return -1;
        cache_k[r][b].insert(cache_k[r][b].end(), s.k.begin() + t * row,
                             s.k.begin() + (t + 1) * row);
        cache_v[r][b].insert(cache_v[r][b].end(), s.v.begin() + t * v_row(),
                             s.v.begin() + (t + 1) * v_row());
        cache_at[r][b].push_back(lengths[b] + t - s.cu_new[b]);
        ++kept;
      }
    for (int b = 0; b < batch; ++b) {
      auto grow = [&](std::vector<T>& to, const std::vector<T>& now, std::size_t w) {
        to.insert(to.end(), now.begin() + s.cu_new[b] * w, now.begin() + s.cu_new[b + 1] * w);
      };
      grow(whole_k[b], s.k, row);
      grow(whole_v[b], s.v, v_row());
      grow(whole_q[b], s.q, q_row());
      for (auto x = s.k.begin() + s.cu_new[b] * row; x != s.k.begin() + s.cu_new[b + 1] * row; ++x)
        exact_k[b].push_back(to_float(*x));
      for (auto x = s.v.begin() + s.cu_new[b] * v_row();
           x != s.v.begin() + s.cu_new[b + 1] * v_row(); ++x)
        exact_v[b].push_back(to_float(*x));
    }
    return kept;
  }
};

//! For P in {2, 3} and a NaN planted in each of q_new, k_new, v_new and the cache of rank 0, 1
//! and the last (an element of a key): a decode case and its drawn step (the oracle solved with
//! the NaN), passed to `check(c, s)`.
template <class P, class T, class Check>
void for_each_nan_decode(const attention_arguments& a, int longest, Check check) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int ranks : {2, 3}) {
    CAPTURE(ranks);
    for (int where = 0; where < 6; ++where) { // q_new, k_new, v_new, cache of rank 0, 1, last
      CAPTURE(where);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks * 10 + where));
      decode_case<P, T> c(random_cu_seqlens(2, 8, longest, rng), ranks, a, rng);
      if (where >= 3) {
        const int r = where == 3 ? 0 : where == 4 ? 1 : ranks - 1;
        REQUIRE(!c.cache_k[r][0].empty());
        c.plant_cache(r, 0, 0, /*key=*/true, 3, nan);
      }
      auto s = c.draw(rng, 1, 3);
      if (where < 3) {
        std::vector<T>& x = where == 0 ? s.q : where == 1 ? s.k : s.v;
        x[2] = from_float<T>(nan); // token 0, head 0, element 2
        c.solve(s);
      }
      check(c, s);
    }
  }
}

//! A rank's shard laid out in a paged pool: each sequence's tokens in pages of `page_size` drawn
//! from a shuffled pool (sequence 0's pages in order, so runs of pages join), a spare page after
//! some sequences' last, and every row no sequence owns poisoned with NaN (read, it would reach
//! the output).
template <class T>
struct paged_shard {
  std::vector<T> k, v;
  std::vector<std::int32_t> cu_pages{0}, table, length;
  std::int64_t pages = 0;
};
template <class P, class T>
paged_shard<T> page_out(const decode_case<P, T>& c, const typename decode_case<P, T>::shard& sh,
                        int page_size, std::mt19937_64& rng) {
  const attention_arguments& a = c.args;
  const std::size_t row = static_cast<std::size_t>(a.kv_heads) * a.head_dim,
                    vrow = static_cast<std::size_t>(a.kv_heads) * a.v_dim();
  paged_shard<T> out;
  std::vector<std::int64_t> count;
  for (int b = 0; b < c.batch; ++b) {
    const std::int64_t len = sh.cu[b + 1] - sh.cu[b];
    count.push_back((len + page_size - 1) / page_size + (rng() % 2));
    out.pages += count.back();
    out.length.push_back(static_cast<std::int32_t>(len));
  }
  out.pages += 2; // pages no sequence holds
  std::vector<std::int32_t> order(static_cast<std::size_t>(out.pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin() + count[0], order.end(), rng);
  std::size_t next = 0;
  out.k.assign(static_cast<std::size_t>(out.pages * page_size) * row,
               from_float<T>(std::numeric_limits<float>::quiet_NaN()));
  out.v.assign(static_cast<std::size_t>(out.pages * page_size) * vrow, out.k.front());
  for (int b = 0; b < c.batch; ++b) {
    for (std::int64_t i = 0; i < count[b]; ++i)
      out.table.push_back(order[next++]);
    out.cu_pages.push_back(static_cast<std::int32_t>(out.table.size()));
    const std::int32_t* pages = out.table.data() + out.cu_pages[b];
    for (std::int64_t j = 0; j < out.length[b]; ++j) {
      const std::int64_t at = std::int64_t{pages[j / page_size]} * page_size + j % page_size;
      const std::int64_t from = sh.cu[b] + j;
      std::copy_n(sh.k.begin() + from * row, row, out.k.begin() + at * row);
      std::copy_n(sh.v.begin() + from * vrow, vrow, out.v.begin() + at * vrow);
    }
  }
  return out;
}

//! A rank's cache rows in FP8: e4m3 K and V, and their scales of layout `Scales`.
struct fp8_shard {
  std::vector<fp8_e4m3> k, v;
  std::vector<float> ks, vs;
};

//! Rank r's cache rows `k`, `v` (`rows` rows of case `c`'s widths: a packed shard, or a paged
//! pool of pages of 2^page_shift rows) quantised to e4m3 with `Scales` (`head_scales`: one per kv
//! head; `page_scales`: one per (page, kv head)), each scale the largest finite magnitude of the
//! elements it scales / 448 (1 where none is above 0), as a serving system quantises on append.
//! Elements that are not finite (rows no sequence holds) become NaN. The case's oracle reads the
//! dequantised values (fp32 products) of the rows `owner(row)` names (sequence b, row i of it on
//! this rank; b < 0: no sequence).
template <kv_scales Scales, class P, class T, class Owner>
fp8_shard quantize_shard(decode_case<P, T>& c, int r, const std::vector<T>& k,
                         const std::vector<T>& v, std::int64_t rows, int page_shift, Owner owner) {
  const int kvh = c.args.kv_heads, d = c.args.head_dim, dv = c.args.v_dim();
  const std::int64_t entries = Scales::entries(rows >> page_shift, kvh);
  fp8_shard out;
  auto one = [&](const std::vector<T>& x, int width, std::vector<fp8_e4m3>& q,
                 std::vector<float>& scale, bool key) {
    std::vector<float> amax(static_cast<std::size_t>(entries), 0.0f);
    for (std::int64_t row = 0; row < rows; ++row)
      for (int h = 0; h < kvh; ++h)
        for (int e = 0; e < width; ++e) {
          const float a = std::abs(to_float(x[(row * kvh + h) * width + e]));
          float& m = amax[static_cast<std::size_t>(Scales::index(row, page_shift, h, kvh))];
          if (std::isfinite(a)) m = std::max(m, a);
        }
    for (const float a : amax)
      scale.push_back(a > 0.0f ? a / 448.0f : 1.0f);
    q.resize(x.size());
    for (std::int64_t row = 0; row < rows; ++row) {
      const auto [b, i] = owner(row);
      for (int h = 0; h < kvh; ++h) {
        const float sc = scale[static_cast<std::size_t>(Scales::index(row, page_shift, h, kvh))];
        for (int e = 0; e < width; ++e) {
          const std::size_t at = static_cast<std::size_t>((row * kvh + h) * width + e);
          q[at] = quantize_e4m3(to_float(x[at]), sc);
          if (b >= 0)
            c.set_cached(r, b, i, key, static_cast<std::size_t>(h * width + e),
                         static_cast<double>(to_float(q[at]) * sc));
        }
      }
    }
  };
  one(k, d, out.k, out.ks, true);
  one(v, dv, out.v, out.vs, false);
  return out;
}

//! `owner` of `quantize_shard` for a packed shard (`cu`: its sequences' offsets).
inline auto packed_owner(const std::vector<std::int32_t>& cu) {
  return [&cu](std::int64_t row) {
    const auto b = static_cast<int>(
        std::upper_bound(cu.begin(), cu.end(), static_cast<std::int32_t>(row)) - cu.begin() - 1);
    return std::pair<int, std::int64_t>{b, row - cu[b]};
  };
}

//! `owner` of `quantize_shard` for a paged pool (`page_out`'s), rows no sequence holds b = -1.
template <class T>
auto paged_owner(const paged_shard<T>& sh, int page_size) {
  std::vector<std::pair<int, std::int64_t>> of(static_cast<std::size_t>(sh.pages * page_size),
                                               {-1, 0});
  for (std::size_t b = 0; b + 1 < sh.cu_pages.size(); ++b)
    for (std::int64_t j = 0; j < sh.length[b]; ++j)
      of[static_cast<std::size_t>(
          std::int64_t{sh.table[sh.cu_pages[b] + j / page_size]} * page_size + j % page_size)] = {
          static_cast<int>(b), j};
  return [of = std::move(of)](std::int64_t row) { return of[static_cast<std::size_t>(row)]; };
}

} // namespace ringattn::test
