// Attention over a sharded KV cache (sharded_attention) on the host, ranks as threads: a cache
// laid out by each partitioner's prefill (packed odd lengths), new tokens appended to their
// owners (position mod P), two decode steps of 1-4 new tokens per sequence, P in {1, 2, 3, 4,
// 8} x GQA 1, 4, 8, against the float64 oracle over the whole cache; the result bitwise equal on
// every rank; bytes per rank.
#include "../ranks.hpp"
#include "../sharded_case.hpp"

#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/sharded_attention.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::message;
using test::on_ranks;

// One sequence's tokens on one rank, in cache order, with their positions.
struct shard_seq {
  std::vector<T> k, v;
};

template <class P>
void check_decode() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int group : {1, 4, 8})
    for (int ranks : {1, 2, 3, 4, 8}) {
      CAPTURE(group);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(group * 10 + ranks));
      const attention_arguments a{8, 8 / group, 64, 0.0f};
      const int kvh = a.kv_heads, qh = a.q_heads, d = a.head_dim;
      const auto cu = test::random_cu_seqlens(3, 1, 61, rng); // the prefill's packed batch
      const partition_plan<P> plan(cu, ranks);
      const int batch = plan.batch();
      const std::size_t kv_row = static_cast<std::size_t>(kvh) * d;
      // Whole sequences (prefill tokens, then every step's new ones) for the oracle.
      std::vector<std::vector<T>> whole_k(batch), whole_v(batch), whole_q(batch);
      const auto prefill_k = test::random_buffer<T>(plan.tokens() * kv_row, rng);
      const auto prefill_v = test::random_buffer<T>(plan.tokens() * kv_row, rng);
      for (int b = 0; b < batch; ++b) {
        whole_k[b].assign(prefill_k.begin() + cu[b] * kv_row,
                          prefill_k.begin() + cu[b + 1] * kv_row);
        whole_v[b].assign(prefill_v.begin() + cu[b] * kv_row,
                          prefill_v.begin() + cu[b + 1] * kv_row);
        whole_q[b].resize(whole_k[b].size() / kvh * qh); // prefill queries: not needed
      }
      // Each rank's cache: its prefill shard of each sequence (the partitioner's layout).
      std::vector<std::vector<shard_seq>> cache(ranks, std::vector<shard_seq>(batch));
      for (int r = 0; r < ranks; ++r) {
        const auto local = plan.local_cu_seqlens(r);
        for (int b = 0; b < batch; ++b)
          for (std::int64_t l = local[b]; l < local[b + 1]; ++l) {
            const std::int64_t g = plan.global_token(r, l);
            auto& s = cache[r][b];
            s.k.insert(s.k.end(), prefill_k.begin() + g * kv_row,
                       prefill_k.begin() + (g + 1) * kv_row);
            s.v.insert(s.v.end(), prefill_v.begin() + g * kv_row,
                       prefill_v.begin() + (g + 1) * kv_row);
          }
      }
      for (int step = 0; step < 2; ++step) {
        CAPTURE(step);
        in_process_group grp(ranks);
        // New tokens: 1-4 per sequence, the same on every rank.
        std::vector<std::int32_t> cu_new{0};
        for (int b = 0; b < batch; ++b)
          cu_new.push_back(cu_new.back() + 1 + static_cast<std::int32_t>(rng() % 4));
        const std::int64_t n = cu_new.back();
        const auto q_new = test::random_buffer<T>(n * qh * d, rng);
        const auto k_new = test::random_buffer<T>(n * kv_row, rng);
        const auto v_new = test::random_buffer<T>(n * kv_row, rng);
        // The oracle: each new token against its whole sequence (cache + new, causal).
        std::vector<std::int32_t> cu_whole{0};
        std::vector<T> q_all, k_all, v_all;
        std::vector<std::int64_t> rows;
        for (int b = 0; b < batch; ++b) {
          const std::int64_t cached = static_cast<std::int64_t>(whole_k[b].size() / kv_row);
          const std::int64_t nb = cu_new[b + 1] - cu_new[b];
          q_all.insert(q_all.end(), whole_q[b].begin(), whole_q[b].end());
          q_all.insert(q_all.end(), q_new.begin() + cu_new[b] * qh * d,
                       q_new.begin() + cu_new[b + 1] * qh * d);
          k_all.insert(k_all.end(), whole_k[b].begin(), whole_k[b].end());
          k_all.insert(k_all.end(), k_new.begin() + cu_new[b] * kv_row,
                       k_new.begin() + cu_new[b + 1] * kv_row);
          v_all.insert(v_all.end(), whole_v[b].begin(), whole_v[b].end());
          v_all.insert(v_all.end(), v_new.begin() + cu_new[b] * kv_row,
                       v_new.begin() + cu_new[b + 1] * kv_row);
          for (std::int64_t i = 0; i < nb; ++i)
            rows.push_back(cu_whole.back() + cached + i);
          cu_whole.push_back(cu_whole.back() + static_cast<std::int32_t>(cached + nb));
        }
        const std::int64_t total = cu_whole.back();
        const auto ref = reference::attention_forward_rows(
            reference::to_tensor(thd_view<const T>(q_all.data(), total, qh, d)),
            reference::to_tensor(thd_view<const T>(k_all.data(), total, kvh, d)),
            reference::to_tensor(thd_view<const T>(v_all.data(), total, kvh, d)), cu_whole, a,
            position_window::of(mask_kind::causal), rows);
        std::vector<std::vector<T>> outs(ranks);
        std::vector<std::vector<float>> lses(ranks);
        std::vector<std::uint64_t> sent(ranks), want(ranks);
        const auto errors = on_ranks(grp, [&](int r, in_process_communicator& comm) {
          sharded_attention<in_process_communicator, causal> dec(comm, a);
          std::vector<std::int32_t> cu_cache{0};
          std::vector<T> kc, vc;
          for (int b = 0; b < batch; ++b) {
            kc.insert(kc.end(), cache[r][b].k.begin(), cache[r][b].k.end());
            vc.insert(vc.end(), cache[r][b].v.begin(), cache[r][b].v.end());
            cu_cache.push_back(static_cast<std::int32_t>(kc.size() / kv_row));
          }
          dec.plan(cu_new, cu_cache);
          std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
          std::vector<T> out(n * qh * d, test::poison<T>());
          std::vector<float> lse(n * qh, -7.0f);
          const std::int64_t m = cu_cache.back();
          const std::uint64_t before = comm.bytes_sent();
          dec.forward_host(
              thd_view<const T>(q_new.data(), n, qh, d), thd_view<const T>(k_new.data(), n, kvh, d),
              thd_view<const T>(v_new.data(), n, kvh, d), thd_view<const T>(kc.data(), m, kvh, d),
              thd_view<const T>(vc.data(), m, kvh, d), thd_view<T>(out.data(), n, qh, d),
              lse.data(), ws);
          sent[r] = comm.bytes_sent() - before;
          want[r] = dec.step_bytes();
          outs[r] = std::move(out);
          lses[r] = std::move(lse);
        });
        for (const auto& e : errors)
          REQUIRE(message(e) == "");
        // Rank 0's result against the oracle; every rank's equal to rank 0's bit for bit.
        double num = 0.0, den = 0.0, lse_err = 0.0;
        for (std::int64_t i = 0; i < n; ++i)
          for (int h = 0; h < qh; ++h) {
            lse_err = std::max(lse_err, std::abs(double(lses[0][h * n + i]) - ref.lse_at(h, i)));
            for (int e = 0; e < d; ++e) {
              const double got = to_float(outs[0][(i * qh + h) * d + e]), w = ref.out(i, h, e);
              num += (got - w) * (got - w), den += w * w;
            }
          }
        // The ring's tolerances: bf16 output 4e-3 relative L2, LSE 1e-5.
        CHECK(std::sqrt(num / den) < 4e-3);
        CHECK(lse_err < 1e-5);
        for (int r = 1; r < ranks; ++r) {
          CAPTURE(r);
          CHECK(std::memcmp(outs[r].data(), outs[0].data(), outs[0].size() * sizeof(T)) == 0);
          CHECK(std::memcmp(lses[r].data(), lses[0].data(), lses[0].size() * sizeof(float)) == 0);
        }
        for (int r = 0; r < ranks; ++r)
          CHECK(sent[r] == want[r]);
        CHECK(want[0] == static_cast<std::uint64_t>(ranks - 1) * n * qh * (d + 1) * sizeof(float));
        // Append: each new token's K/V to its owner (owned_new_rows: position mod P), and to
        // the whole sequences of the oracle.
        std::vector<std::int64_t> lengths;
        for (int b = 0; b < batch; ++b)
          lengths.push_back(static_cast<std::int64_t>(whole_k[b].size() / kv_row));
        std::int64_t kept = 0;
        for (int r = 0; r < ranks; ++r)
          for (const std::int64_t t : owned_new_rows(r, ranks, cu_new, lengths)) {
            const auto b = static_cast<int>(
                std::upper_bound(cu_new.begin(), cu_new.end(), static_cast<std::int32_t>(t)) -
                cu_new.begin() - 1);
            CHECK(owner_of(lengths[b] + t - cu_new[b], ranks) == r);
            auto& s = cache[r][b];
            s.k.insert(s.k.end(), k_new.begin() + t * kv_row, k_new.begin() + (t + 1) * kv_row);
            s.v.insert(s.v.end(), v_new.begin() + t * kv_row, v_new.begin() + (t + 1) * kv_row);
            ++kept;
          }
        CHECK(kept == n); // every new token kept by exactly one rank
        for (int b = 0; b < batch; ++b) {
          whole_k[b].insert(whole_k[b].end(), k_new.begin() + cu_new[b] * kv_row,
                            k_new.begin() + cu_new[b + 1] * kv_row);
          whole_v[b].insert(whole_v[b].end(), v_new.begin() + cu_new[b] * kv_row,
                            v_new.begin() + cu_new[b + 1] * kv_row);
          whole_q[b].insert(whole_q[b].end(), q_new.begin() + cu_new[b] * qh * d,
                            q_new.begin() + cu_new[b + 1] * qh * d);
        }
      }
    }
}
} // namespace

TEST_CASE_TEMPLATE("sharded decode equals attention over the whole cache, on every rank", P,
                   contiguous, round_robin, zigzag) {
  check_decode<P>();
}
