// Attention over a sharded KV cache (sharded_attention) on the host, ranks as threads: a cache
// laid out by each partitioner's prefill (packed odd lengths), new tokens appended to their
// owners (position mod P), three steps of 0-4 new tokens per sequence, P in {1, 2, 3, 4, 8} x
// GQA 1, 4, 8, against the float64 oracle over the whole cache; the result bitwise equal on every
// rank; bytes per rank; bad input refused on every rank, and the next step runs.
#include "../support/decode_case.hpp"
#include "../support/ranks.hpp"
#include "../support/recording_comm.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/sharded_attention.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::message;
using test::on_ranks;
using decoder = sharded_attention<in_process_communicator, host_reference<causal_mask>>;

struct rank_result {
  std::vector<T> out;
  std::vector<float> lse;
  std::uint64_t sent = 0, expected = 0;
};

template <class P>
std::vector<rank_result> run_step(const test::decode_case<P, T>& c,
                                  const typename test::decode_case<P, T>::step& s) {
  const attention_arguments a = c.args;
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim, dv = a.v_dim();
  const std::int64_t n = s.tokens;
  std::vector<rank_result> res(c.ranks);
  in_process_group group(c.ranks);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    decoder dec(comm, a);
    const auto sh = c.rank_shard(r);
    dec.plan(s.cu_new, sh.cu);
    std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
    rank_result& out = res[r];
    out.out.assign(n * qh * dv, test::poison<T>());
    out.lse.assign(n * qh, -7.0f);
    const std::int64_t m = sh.tokens();
    const std::uint64_t before = comm.bytes_sent();
    dec.forward_host(
        thd_view<const T>(s.q.data(), n, qh, d), thd_view<const T>(s.k.data(), n, kvh, d),
        thd_view<const T>(s.v.data(), n, kvh, dv), thd_view<const T>(sh.k.data(), m, kvh, d),
        thd_view<const T>(sh.v.data(), m, kvh, dv), thd_view<T>(out.out.data(), n, qh, dv),
        out.lse.data(), ws);
    out.sent = comm.bytes_sent() - before;
    out.expected = dec.step_bytes<T>();
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  return res;
}

// `head_dim_v` 0: v as wide as q and k (64); else q/k 192 and v that wide.
template <class P>
void check_decode(int head_dim_v = 0) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(head_dim_v);
  for (int group : {1, 4, 8})
    for (int ranks : {1, 2, 3, 4, 8}) {
      CAPTURE(group);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(group * 10 + ranks));
      const attention_arguments a{.q_heads = 8,
                                  .kv_heads = 8 / group,
                                  .head_dim = head_dim_v ? 192 : 64,
                                  .head_dim_v = head_dim_v};
      test::decode_case<P, T> c(test::random_cu_seqlens(3, 1, 61, rng), ranks, a, rng);
      for (int step = 0; step < 3; ++step) {
        CAPTURE(step);
        const auto s = c.draw(rng, step == 2 ? 0 : 1, 4);
        const auto res = run_step(c, s);
        // The ring's host tolerances: bf16 output 4e-3 relative L2, LSE 1e-5.
        const auto [err, lse_err] = c.error(s, res[0].out, res[0].lse);
        CHECK(err < 4e-3);
        CHECK(lse_err < 1e-5);
        for (int r = 0; r < ranks; ++r) {
          CAPTURE(r);
          CHECK(test::same_bits(res[r].out, res[r].lse, res[0].out, res[0].lse));
          CHECK(res[r].sent == res[r].expected);
        }
        CHECK(res[0].expected ==
              static_cast<std::uint64_t>(ranks - 1) *
                  test::finished_partial_bytes(s.tokens * a.q_heads, a.v_dim(), sizeof(T)));
        CHECK(c.append(s) == s.tokens); // every new token kept by exactly one rank
      }
    }
}
} // namespace

TEST_CASE_TEMPLATE("sharded decode equals attention over the whole cache, on every rank", P,
                   contiguous, round_robin, zigzag) {
  check_decode<P>();
  check_decode<P>(128); // multi-head latent attention: q/k 192, v and out 128
}

// The step is the decode program (ring/program.cuh): what each rank sends is its messages, in
// their order (P - 1 finished partials of the new rows, tags 1 .. P - 1).
TEST_CASE("sharded decode: every rank sends its step program's messages, in their order") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  using recorder = test::recording_communicator<in_process_communicator>;
  const attention_arguments a{.q_heads = 8, .kv_heads = 2, .head_dim = 64};
  std::size_t messages = 0;
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    test::decode_case<zigzag, T> c(test::random_cu_seqlens(3, 1, 61, rng), ranks, a, rng);
    const auto s = c.draw(rng, 1, 4);
    const std::int64_t n = s.tokens;
    const std::size_t slot = test::finished_partial_bytes(n * a.q_heads, a.v_dim(), sizeof(T));
    std::vector<std::vector<test::sent>> logs(static_cast<std::size_t>(ranks));
    in_process_group group(ranks);
    const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
      recorder rec(comm);
      sharded_attention<recorder, host_reference<causal_mask>> dec(rec, a);
      const auto sh = c.rank_shard(r);
      dec.plan(s.cu_new, sh.cu);
      std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
      std::vector<T> out(static_cast<std::size_t>(n * a.q_heads * a.v_dim()), test::poison<T>());
      std::vector<float> lse(static_cast<std::size_t>(n * a.q_heads), -7.0f);
      const std::int64_t m = sh.tokens();
      rec.log.clear();
      dec.forward_host(thd_view<const T>(s.q.data(), n, a.q_heads, a.head_dim),
                       thd_view<const T>(s.k.data(), n, a.kv_heads, a.head_dim),
                       thd_view<const T>(s.v.data(), n, a.kv_heads, a.v_dim()),
                       thd_view<const T>(sh.k.data(), m, a.kv_heads, a.head_dim),
                       thd_view<const T>(sh.v.data(), m, a.kv_heads, a.v_dim()),
                       thd_view<T>(out.data(), n, a.q_heads, a.v_dim()), lse.data(), ws);
      logs[static_cast<std::size_t>(r)] = rec.log;
    });
    for (const auto& e : errors)
      REQUIRE(message(e) == "");
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      detail::trace_engine program;
      detail::decode_program::step(program, r, ranks, n, slot);
      CHECK(logs[static_cast<std::size_t>(r)] == test::seen_of(program.messages()));
      CHECK(program.messages().size() == static_cast<std::size_t>(ranks - 1));
      messages += program.messages().size();
    }
  }
  CHECK(messages > 0);
}

TEST_CASE_TEMPLATE("sharded decode over a paged cache equals attention over the whole cache", P,
                   contiguous, zigzag) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int page_size : {16, 32})
    for (int group : {1, 4})
      for (int ranks : {1, 2, 3}) {
        CAPTURE(page_size);
        CAPTURE(group);
        CAPTURE(ranks);
        std::mt19937_64 rng(seed +
                            static_cast<std::uint64_t>(page_size * 100 + group * 10 + ranks));
        const attention_arguments a{.q_heads = 8, .kv_heads = 8 / group, .head_dim = 64};
        test::decode_case<P, T> c(test::random_cu_seqlens(3, 1, 150, rng), ranks, a, rng);
        for (int step = 0; step < 2; ++step) {
          CAPTURE(step);
          const auto s = c.draw(rng, 1, 4);
          const std::int64_t n = s.tokens;
          const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim;
          std::vector<test::paged_shard<T>> shards;
          for (int r = 0; r < ranks; ++r)
            shards.push_back(test::page_out(c, c.rank_shard(r), page_size, rng));
          std::vector<rank_result> res(ranks);
          in_process_group g(ranks);
          const auto errors = on_ranks(g, [&](int r, in_process_communicator& comm) {
            decoder dec(comm, a);
            const test::paged_shard<T>& sh = shards[r];
            dec.plan(s.cu_new, paged_cache{page_size, sh.pages, sh.cu_pages, sh.table, sh.length});
            std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
            res[r].out.assign(n * qh * d, test::poison<T>());
            res[r].lse.assign(n * qh, -7.0f);
            const std::int64_t rows = sh.pages * page_size;
            dec.forward_host(thd_view<const T>(s.q.data(), n, qh, d),
                             thd_view<const T>(s.k.data(), n, kvh, d),
                             thd_view<const T>(s.v.data(), n, kvh, d),
                             thd_view<const T>(sh.k.data(), rows, kvh, d),
                             thd_view<const T>(sh.v.data(), rows, kvh, d),
                             thd_view<T>(res[r].out.data(), n, qh, d), res[r].lse.data(), ws);
          });
          for (const auto& e : errors)
            REQUIRE(message(e) == "");
          // The packed cache's tolerances: bf16 output 4e-3 relative L2, LSE 1e-5.
          const auto [err, lse_err] = c.error(s, res[0].out, res[0].lse);
          CHECK(err < 4e-3);
          CHECK(lse_err < 1e-5);
          for (int r = 1; r < ranks; ++r)
            CHECK(test::same_bits(res[r].out, res[r].lse, res[0].out, res[0].lse));
          CHECK(c.append(s) == s.tokens);
        }
      }
}

namespace {
// One step of case `c` over each rank's cache quantised to FP8 with `Scales` (`page_size` 0: a
// packed shard, else a paged pool of such pages), on the host; the oracle re-solved over the
// dequantised values.
template <class Scales, class P>
std::vector<rank_result> run_fp8_step(test::decode_case<P, T>& c,
                                      typename test::decode_case<P, T>::step& s, int page_size,
                                      std::mt19937_64& rng) {
  const attention_arguments a = c.args;
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim;
  const std::int64_t n = s.tokens;
  std::vector<typename test::decode_case<P, T>::shard> packed;
  std::vector<test::paged_shard<T>> paged;
  std::vector<test::fp8_shard> fp8;
  for (int r = 0; r < c.ranks; ++r) {
    packed.push_back(c.rank_shard(r));
    if (page_size == 0) {
      fp8.push_back(test::quantize_shard<Scales>(c, r, packed[r].k, packed[r].v, packed[r].tokens(),
                                                 0, test::packed_owner(packed[r].cu)));
    } else {
      paged.push_back(test::page_out(c, packed[r], page_size, rng));
      const int shift = std::countr_zero(static_cast<unsigned>(page_size));
      fp8.push_back(test::quantize_shard<Scales>(c, r, paged[r].k, paged[r].v,
                                                 paged[r].pages * page_size, shift,
                                                 test::paged_owner(paged[r], page_size)));
    }
  }
  c.solve(s);
  std::vector<rank_result> res(c.ranks);
  in_process_group g(c.ranks);
  const auto errors = on_ranks(g, [&](int r, in_process_communicator& comm) {
    decoder dec(comm, a);
    std::int64_t rows = 0;
    if (page_size == 0) {
      dec.plan(s.cu_new, packed[r].cu);
      rows = packed[r].tokens();
    } else {
      const test::paged_shard<T>& sh = paged[r];
      dec.plan(s.cu_new, paged_cache{page_size, sh.pages, sh.cu_pages, sh.table, sh.length});
      rows = sh.pages * page_size;
    }
    std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
    res[r].out.assign(n * qh * d, test::poison<T>());
    res[r].lse.assign(n * qh, -7.0f);
    dec.forward_host(thd_view<const T>(s.q.data(), n, qh, d),
                     thd_view<const T>(s.k.data(), n, kvh, d),
                     thd_view<const T>(s.v.data(), n, kvh, d),
                     thd_view<const fp8_e4m3>(fp8[r].k.data(), rows, kvh, d),
                     thd_view<const fp8_e4m3>(fp8[r].v.data(), rows, kvh, d),
                     Scales{fp8[r].ks.data(), fp8[r].vs.data()},
                     thd_view<T>(res[r].out.data(), n, qh, d), res[r].lse.data(), ws);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  return res;
}
} // namespace

TEST_CASE_TEMPLATE("sharded decode over an FP8 cache equals attention over its dequantised values",
                   P, contiguous, zigzag) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  struct layout {
    int page_size;
    bool per_page;
  };
  for (const layout l : {layout{0, false}, layout{16, false}, layout{16, true}, layout{32, true}})
    for (int group : {1, 4})
      for (int ranks : {1, 2, 3}) {
        CAPTURE(l.page_size);
        CAPTURE(l.per_page);
        CAPTURE(group);
        CAPTURE(ranks);
        std::mt19937_64 rng(seed + static_cast<std::uint64_t>(l.page_size * 100 + l.per_page * 50 +
                                                              group * 10 + ranks));
        const attention_arguments a{.q_heads = 8, .kv_heads = 8 / group, .head_dim = 64};
        test::decode_case<P, T> c(test::random_cu_seqlens(3, 1, 150, rng), ranks, a, rng);
        for (int step = 0; step < 2; ++step) {
          CAPTURE(step);
          auto s = c.draw(rng, 1, 4);
          const auto res = l.per_page ? run_fp8_step<page_scales>(c, s, l.page_size, rng)
                                      : run_fp8_step<head_scales>(c, s, l.page_size, rng);
          // The oracle reads the dequantised cache: the bf16 cache's tolerances hold (output
          // 4e-3 relative L2, LSE 1e-5).
          const auto [err, lse_err] = c.error(s, res[0].out, res[0].lse);
          CHECK(err < 4e-3);
          CHECK(lse_err < 1e-5);
          for (int r = 1; r < ranks; ++r)
            CHECK(test::same_bits(res[r].out, res[r].lse, res[0].out, res[0].lse));
          CHECK(c.append(s) == s.tokens);
        }
      }
}

TEST_CASE("sharded decode over an FP8 cache: NaN in a cached element reaches its sequence's rows") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const attention_arguments a{.q_heads = 8, .kv_heads = 2, .head_dim = 64};
  test::decode_case<contiguous, T> c(test::random_cu_seqlens(3, 8, 60, rng), 2, a, rng);
  c.plant_cache(1, 0, 0, /*key=*/false, 5, std::numeric_limits<float>::quiet_NaN());
  auto s = c.draw(rng, 1, 3);
  const auto res = run_fp8_step<head_scales>(c, s, 0, rng);
  // Sequence 0's rows of kv head 0's query heads are NaN, every other row within tolerance.
  CHECK(c.check_strict(s, res[0].out, res[0].lse, 4e-3, 1e-5) > 0);
  CHECK(test::same_bits(res[1].out, res[1].lse, res[0].out, res[0].lse));
}

TEST_CASE("sharded decode over an FP8 cache: scales a step cannot read are refused on every rank, "
          "and the next step runs") {
  const attention_arguments a{4, 2, 64, 0.0f};
  const int ranks = 2, qh = 4, kvh = 2, d = 64;
  const std::vector<std::int32_t> cu_new{0, 1, 2}, cu_cache{0, 3, 5};
  std::vector<T> q(2 * qh * d, from_float<T>(0.5f)), k(2 * kvh * d, from_float<T>(0.25f));
  std::vector<fp8_e4m3> kc(5 * kvh * d, quantize_e4m3(0.5f, 1.0f));
  const std::vector<float> scales(kvh, 0.25f); // every cached value reads 0.125
  struct variant {
    const char* says;
    bool per_page;
    bool null_v;
  };
  for (const variant x :
       {variant{"page_scales need a step planned over a paged cache", true, false},
        variant{"the head_scales' k or v is a null pointer (an FP8 cache of 5 rows reads 2 "
                "scales each)",
                false, true}}) {
    CAPTURE(x.says);
    std::vector<std::string> seen(ranks);
    std::vector<double> after(ranks, 1.0);
    in_process_group g(ranks);
    const auto errors = on_ranks(g, [&](int r, in_process_communicator& comm) {
      decoder dec(comm, a);
      dec.plan(cu_new, cu_cache);
      std::vector<T> out(2 * qh * d, test::poison<T>());
      std::vector<float> lse(2 * qh);
      std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
      auto run = [&](auto scales) {
        dec.forward_host(
            thd_view<const T>(q.data(), 2, qh, d), thd_view<const T>(k.data(), 2, kvh, d),
            thd_view<const T>(k.data(), 2, kvh, d), thd_view<const fp8_e4m3>(kc.data(), 5, kvh, d),
            thd_view<const fp8_e4m3>(kc.data(), 5, kvh, d), scales,
            thd_view<T>(out.data(), 2, qh, d), lse.data(), ws);
      };
      try { // rank 1 alone passes the bad scales
        if (r == 1 && x.per_page)
          run(page_scales{scales.data(), scales.data()});
        else
          run(head_scales{scales.data(), r == 1 && x.null_v ? nullptr : scales.data()});
      } catch (const invalid_argument& e) {
        seen[r] = e.what();
      }
      run(head_scales{scales.data(), scales.data()});
      after[r] = to_float(out[0]);
    });
    for (const auto& e : errors)
      REQUIRE(message(e) == "");
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(seen[r].find(r == 1 ? x.says : "rank 1 rejected call") != std::string::npos);
      // Token 0 of sequence 0 sees its 3 cached values (0.125) and its own (0.25).
      CHECK(after[r] > 0.125);
      CHECK(after[r] < 0.25);
    }
  }
}

TEST_CASE("sharded decode over a paged cache: a bad page table is refused on every rank") {
  const attention_arguments a{4, 2, 64, 0.0f};
  const int ranks = 2;
  const std::vector<std::int32_t> cu_new{0, 1, 2};
  // Two sequences of 20 and 5 cached tokens in pages of 16 of a pool of 4 pages.
  static const std::vector<std::int32_t> cu_pages{0, 2, 3}, table{3, 0, 1}, length{20, 5},
      short_cu_pages{0, 1, 3}, far_table{3, 0, 4};
  struct variant {
    paged_cache cache;
    const char* says;
  };
  const variant variants[] = {
      {{24, 4, cu_pages, table, length},
       "page_size must be a power of two from 16 to 256 (got 24)"},
      {{16, 4, cu_pages, table, length}, ""},
      {{16, 4, short_cu_pages, table, length},
       "sequence 0's 20 cached tokens need 2 pages of 16; its page table lists 1"},
      {{16, 4, cu_pages, far_table, length},
       "sequence 1's page 0 is 4, outside the pool of 4 pages"},
      {{16, 4, cu_pages, table, std::span(length).first(1)},
       "the paged cache must describe the 2 sequences of cu_new (got 3 page offsets and 1 "
       "lengths)"},
      {{16, std::int64_t{1} << 40, cu_pages, table, length}, "exceeds the int32 limit"}};
  for (const variant& x : variants) {
    CAPTURE(x.says);
    std::vector<std::string> seen(ranks);
    in_process_group g(ranks);
    const auto errors = on_ranks(g, [&](int r, in_process_communicator& comm) {
      decoder dec(comm, a);
      // Rank 1 alone passes the variant; rank 0 a good table.
      const paged_cache good{16, 4, cu_pages, table, length};
      try {
        dec.plan(cu_new, r == 1 ? x.cache : good);
      } catch (const invalid_argument& e) {
        seen[r] = e.what();
      }
    });
    for (const auto& e : errors)
      REQUIRE(message(e) == "");
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      if (*x.says == '\0')
        CHECK(seen[r] == "");
      else // rank 1 says why; rank 0 that rank 1 refused
        CHECK(seen[r].find(r == 1 ? x.says : "rank 1 rejected its step") != std::string::npos);
    }
  }
}

TEST_CASE("sharded decode: bad input fails on every rank, and the next step runs") {
  const attention_arguments a{4, 2, 64, 0.0f};
  const int ranks = 3, qh = 4, kvh = 2, d = 64;
  in_process_group group(ranks);
  std::vector<std::string> plan_errors(ranks), call_errors(ranks), skew_errors(ranks);
  std::vector<double> after(ranks, 1.0);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    decoder dec(comm, a);
    // Rank 2 plans other new tokens: every rank hears of it.
    const std::vector<std::int32_t> cu_new{0, 2, 3}, other{0, 1, 3}, cu_cache{0, 5, 9};
    try {
      dec.plan(r == 2 ? std::span<const std::int32_t>(other) : cu_new, cu_cache);
    } catch (const invalid_argument& e) {
      plan_errors[r] = e.what();
    }
    // A forward before a successful plan.
    std::vector<T> q(3 * qh * d, from_float<T>(0.5f)), k(3 * kvh * d, from_float<T>(0.25f));
    std::vector<T> kc(9 * kvh * d, from_float<T>(0.125f)), out(3 * qh * d);
    std::vector<float> lse(3 * qh);
    auto run = [&](std::size_t ws_bytes, std::int64_t out_tokens) {
      std::vector<std::byte> ws(ws_bytes);
      dec.forward_host(
          thd_view<const T>(q.data(), 3, qh, d), thd_view<const T>(k.data(), 3, kvh, d),
          thd_view<const T>(kc.data(), 3, kvh, d), thd_view<const T>(kc.data(), 4 + r, kvh, d),
          thd_view<const T>(kc.data(), 4 + r, kvh, d), thd_view<T>(out.data(), out_tokens, qh, d),
          lse.data(), ws);
    };
    try {
      run(1 << 20, 3);
    } catch (const invalid_argument& e) {
      skew_errors[r] = e.what();
    }
    const std::vector<std::int32_t> cache_r{0, 2, 4 + r};
    dec.plan(cu_new, cache_r);
    // Rank 1's output has the wrong shape: every rank throws, naming rank 1.
    try {
      run(dec.host_workspace_bytes<T>(), r == 1 ? 2 : 3);
    } catch (const invalid_argument& e) {
      call_errors[r] = e.what();
    }
    // The next call runs.
    std::fill(out.begin(), out.end(), test::poison<T>());
    run(dec.host_workspace_bytes<T>(), 3);
    after[r] = to_float(out[0]);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(plan_errors[r].find("rank 2 plans other new tokens than rank 0") != std::string::npos);
    CHECK(skew_errors[r].find("call plan(cu_new, cu_cache) before the forward") !=
          std::string::npos);
    CHECK(call_errors[r].find("out is [2, 4, 64] but the plan wants [3, 4, 64]") !=
          std::string::npos);
    CHECK(after[r] == doctest::Approx(0.125)); // every value of the cache and new V
  }
}

TEST_CASE("sharded decode: a plan or a step its caller refused fails on every rank, and the next "
          "step runs") {
  const attention_arguments a{4, 2, 64, 0.0f};
  const int ranks = 3, qh = 4, kvh = 2, d = 64;
  in_process_group group(ranks);
  std::vector<std::string> plan_errors(ranks), step_errors(ranks);
  std::vector<double> after(ranks, 1.0);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    decoder dec(comm, a);
    const std::vector<std::int32_t> cu_new{0, 2, 3}, cu_cache{0, 2, 4 + r};
    std::vector<T> q(3 * qh * d, from_float<T>(0.5f)), k(3 * kvh * d, from_float<T>(0.25f));
    std::vector<T> kc(9 * kvh * d, from_float<T>(0.125f)), out(3 * qh * d);
    std::vector<float> lse(3 * qh);
    auto run = [&] {
      std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
      dec.forward_host(
          thd_view<const T>(q.data(), 3, qh, d), thd_view<const T>(k.data(), 3, kvh, d),
          thd_view<const T>(kc.data(), 3, kvh, d), thd_view<const T>(kc.data(), 4 + r, kvh, d),
          thd_view<const T>(kc.data(), 4 + r, kvh, d), thd_view<T>(out.data(), 3, qh, d),
          lse.data(), ws);
    };
    // Rank 1's caller refuses its plan (say, a page table it could not read).
    try {
      if (r == 1) dec.refuse<T>(false, false, "the caller could not read its page table");
      dec.plan(cu_new, cu_cache);
    } catch (const invalid_argument& e) {
      plan_errors[r] = e.what();
    }
    dec.plan(cu_new, cu_cache);
    // Rank 2's caller refuses the step (say, an output it could not allocate).
    try {
      if (r == 2) dec.refuse<T>(true, false, "the caller could not allocate out");
      run();
    } catch (const invalid_argument& e) {
      step_errors[r] = e.what();
    }
    std::fill(out.begin(), out.end(), test::poison<T>());
    run();
    after[r] = to_float(out[0]);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(plan_errors[r].find(r == 1 ? "ringattn: the caller could not read its page table"
                                     : "rank 1 rejected its step") != std::string::npos);
    CHECK(step_errors[r].find("the caller could not allocate out") != std::string::npos);
    if (r != 2) CHECK(step_errors[r].find("rank 2 rejected call") != std::string::npos);
    CHECK(after[r] == doctest::Approx(0.125));
  }
}

TEST_CASE("sharded decode: a window is refused at construction, on every rank") {
  // The decode attends causally to the whole cache; a window would be ignored, so it is an error.
  attention_arguments a{4, 2, 64, 0.0f};
  a.window_left = 127;
  in_process_group group(2);
  const auto errors =
      on_ranks(group, [&](int, in_process_communicator& comm) { decoder dec(comm, a); });
  for (const auto& e : errors)
    CHECK(message(e).find("takes no window") != std::string::npos);
}

// A cache shard beyond the int32 rows of the offsets, on one rank only: every rank refuses the
// plan before the step's all-gather, and every rank's next plan and step run (the ranks still
// count plans alike).
TEST_CASE("sharded decode: a cache beyond int32 rows on one rank is refused on every rank; the "
          "next step runs") {
  const attention_arguments a{4, 2, 64, 0.0f};
  const int ranks = 3, qh = 4, kvh = 2, d = 64;
  in_process_group group(ranks);
  std::vector<std::string> refused(ranks);
  std::vector<double> after(ranks, 1.0);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    decoder dec(comm, a);
    const std::vector<std::int32_t> cu_new{0, 1}, begin{0}, length{4};
    const std::int64_t huge = std::int64_t{1} << 31;
    try {
      dec.plan(cu_new, begin, length, r == 1 ? huge : 4);
    } catch (const invalid_argument& e) {
      refused[r] = e.what();
    }
    dec.plan(cu_new, begin, length, 4);
    std::vector<T> q(qh * d, from_float<T>(0.5f)), k(kvh * d, from_float<T>(0.25f));
    std::vector<T> kc(4 * kvh * d, from_float<T>(0.125f)), out(qh * d, test::poison<T>());
    std::vector<float> lse(qh);
    std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
    dec.forward_host(
        thd_view<const T>(q.data(), 1, qh, d), thd_view<const T>(k.data(), 1, kvh, d),
        thd_view<const T>(kc.data(), 1, kvh, d), thd_view<const T>(kc.data(), 4, kvh, d),
        thd_view<const T>(kc.data(), 4, kvh, d), thd_view<T>(out.data(), 1, qh, d), lse.data(), ws);
    after[r] = to_float(out[0]);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  CHECK(refused[1].find("the cache shard of 2147483648 rows exceeds the int32 limit") !=
        std::string::npos);
  for (int r : {0, 2})
    CHECK(refused[r].find("rank 1 rejected its step") != std::string::npos);
  for (int r = 0; r < ranks; ++r)
    CHECK(after[r] == doctest::Approx(0.125)); // the new token's V, the cache's V
}

// Offsets are checked before any arithmetic on them: a cu_cache that decreases by more than
// int32 holds is refused (no signed overflow: UndefinedBehaviorSanitizer runs this suite), and
// negative lengths, a rank count of 0 or a negative position are refused, not kept by no rank.
TEST_CASE("sharded decode: offsets that overflow, negative lengths and no ranks are refused") {
  const attention_arguments a{4, 2, 64, 0.0f};
  in_process_group group(2);
  std::vector<std::string> refused(2);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    decoder dec(comm, a);
    const std::vector<std::int32_t> cu_new{0, 1, 2};
    const std::vector<std::int32_t> wraps{0, INT32_MAX, INT32_MIN}, fine{0, 3, 5};
    try {
      dec.plan(cu_new, r == 0 ? std::span<const std::int32_t>(wraps) : fine);
    } catch (const invalid_argument& e) {
      refused[r] = e.what();
    }
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  CHECK(refused[0].find("cu_cache must not decrease (sequence 1") != std::string::npos);
  CHECK(refused[1].find("rank 0 rejected its step") != std::string::npos);

  const std::vector<std::int32_t> cu_new{0, 2};
  const std::vector<std::int64_t> negative{-1};
  CHECK_THROWS_WITH_AS(owned_new_rows(0, 2, cu_new, negative),
                       "ringattn: sequence 0 has a negative length (-1)", invalid_argument);
  const std::vector<std::int32_t> decreasing{0, 3, 1};
  const std::vector<std::int64_t> two{0, 0};
  CHECK_THROWS_AS(owned_new_rows(0, 2, decreasing, two), invalid_argument);
  CHECK_THROWS_AS((void)owner_of(5, 0), invalid_argument);
  CHECK_THROWS_AS((void)owner_of(-1, 2), invalid_argument);
  CHECK(owner_of(5, 2) == 1);
  // Every new token is kept by exactly one rank.
  const std::vector<std::int64_t> lengths{7};
  std::size_t kept = 0;
  for (int r = 0; r < 3; ++r)
    kept += owned_new_rows(r, 3, cu_new, lengths).size();
  CHECK(kept == 2);
}
