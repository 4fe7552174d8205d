// Attention over a sharded KV cache on the device: P virtual ranks on one GPU (threads of an
// in-process group, each with its own stream), the cache of each partitioner's prefill (packed odd
// lengths), three decode steps with appends (0-4 new tokens per sequence), P in {1, 2, 3, 4, 8} x
// GQA 1, 4, 8, against the float64 oracle; every rank's result bitwise equal to rank 0's and from
// call to call; bytes per rank; a warmed-up step allocates nothing; bad input on one rank fails
// on every rank before anything is enqueued, and the next step runs; steps planned back to back
// (no wait between them) reuse their tables and allocate nothing once warm; caches of thousands
// of tokens with up to 16 new tokens per sequence (many splits, every row-tile count); paged
// caches; FP8 caches; one CUDA graph capture replaying the steps of growing caches.
#include "../support/allocation_counter.hpp"
#include "../support/decode_case.hpp"
#include "../support/device_buffer.cuh"
#include "../support/ranks.hpp"
#include "../support/recording_comm.hpp"

#include <ringattn/block/device/kv_quantize.cuh>
#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/sharded_attention.cuh>

#include <doctest/doctest.h>

#include <barrier>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <numeric>
#include <optional>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using decoder = sharded_attention<in_process_communicator, causal>;

template <class E = T>
struct rank_result {
  std::vector<E> out;
  std::vector<float> lse;
  bool repeatable = true;
  std::uint64_t sent = 0, expected = 0, allocations = 0, heap = 0;
};

// Rank r's paged pool of device_step (`page_seed` shuffles its pages).
template <class P, class E>
test::paged_shard<E> pool_of(const test::decode_case<P, E>& c, int r, int page_size,
                             std::uint64_t page_seed) {
  std::mt19937_64 page_rng(page_seed + static_cast<std::uint64_t>(r));
  return test::page_out(c, c.rank_shard(r), page_size, page_rng);
}

// One step on every rank; `repeat`: the forward twice, the second counted (device allocations,
// heap) and compared with the first. `page_size` > 0: each rank's shard in a paged pool
// (`pool_of`). With `fp8` (Scales not no_scales), the cache each rank reads is its `fp8` entry:
// its shard or pool quantised (test::quantize_shard).
template <class P, class E = T, class Scales = no_scales>
std::vector<rank_result<E>> device_step(const test::decode_case<P, E>& c,
                                        const typename test::decode_case<P, E>::step& s,
                                        bool repeat, int page_size = 0, std::uint64_t page_seed = 0,
                                        const std::vector<test::fp8_shard>* fp8 = nullptr) {
  using T = E; // this step's element type
  const attention_arguments a = c.args;
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim, dv = a.v_dim();
  const std::int64_t n = s.tokens;
  std::vector<rank_result<E>> res(c.ranks);
  std::barrier sync(c.ranks);
  in_process_group group(c.ranks, std::chrono::seconds(60));
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    RINGATTN_CUDA_CHECK(cudaSetDevice(0));
    decoder dec(comm, a);
    dec.prepare_device();
    const auto sh = c.rank_shard(r);
    const auto pool = page_size ? pool_of(c, r, page_size, page_seed) : test::paged_shard<T>{};
    std::int64_t m = sh.tokens();
    if (page_size) {
      dec.plan(s.cu_new,
               paged_cache{page_size, pool.pages, pool.cu_pages, pool.table, pool.length});
      m = pool.pages * page_size;
    } else {
      dec.plan(s.cu_new, sh.cu);
    }
    constexpr bool quantized = !std::is_same_v<Scales, no_scales>;
    test::device_buffer<T> q(s.q), k(s.k), v(s.v),
        kc(quantized   ? std::vector<T>{}
           : page_size ? pool.k
                       : sh.k),
        vc(quantized   ? std::vector<T>{}
           : page_size ? pool.v
                       : sh.v);
    const test::fp8_shard none;
    const test::fp8_shard& mine8 = quantized ? (*fp8)[r] : none;
    test::device_buffer<fp8_e4m3> kc8(mine8.k), vc8(mine8.v);
    test::device_buffer<float> ks(mine8.ks), vs(mine8.vs);
    test::device_buffer<T> out(std::vector<T>(n * qh * dv, test::poison<T>()));
    test::device_buffer<float> lse(std::vector<float>(n * qh, -7.0f));
    const std::size_t bytes = dec.device_workspace_bytes<T>();
    test::device_buffer<std::byte> ws(bytes);
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    rank_result<E>& mine = res[r];
    auto once = [&] {
      if constexpr (quantized)
        dec.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                    thd_view<const T>(v.get(), n, kvh, dv),
                    thd_view<const fp8_e4m3>(kc8.get(), m, kvh, d),
                    thd_view<const fp8_e4m3>(vc8.get(), m, kvh, dv), Scales{ks.get(), vs.get()},
                    thd_view<T>(out.get(), n, qh, dv), lse.get(), ws.get(), bytes, stream);
      else
        dec.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                    thd_view<const T>(v.get(), n, kvh, dv), thd_view<const T>(kc.get(), m, kvh, d),
                    thd_view<const T>(vc.get(), m, kvh, dv), thd_view<T>(out.get(), n, qh, dv),
                    lse.get(), ws.get(), bytes, stream);
    };
    const std::uint64_t before = comm.bytes_sent();
    once();
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    mine.sent = comm.bytes_sent() - before;
    mine.expected = dec.step_bytes<T>();
    mine.out = out.download();
    mine.lse = lse.download();
    if (repeat) {
      sync.arrive_and_wait();
      const std::uint64_t allocated = detail::device_allocations.load();
      {
        test::allocation_scope scope;
        once();
        mine.heap = scope.count();
      }
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
      sync.arrive_and_wait();
      mine.allocations = detail::device_allocations.load() - allocated;
      const auto o2 = out.download();
      const auto l2 = lse.download();
      mine.repeatable = test::same_bits(o2, l2, mine.out, mine.lse);
    }
    RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  for (const auto& e : errors)
    REQUIRE(test::message(e) == "");
  return res;
}

// A step's result against the oracle with the device block kernel's bf16 tolerances
// (test_block_forward.cu: 8e-3 relative L2 on the output, 2e-3 absolute on the LSE); every rank
// the same bits, sending what step_bytes says, and a repeated call (if any) the same bits with
// no allocation.
template <class P>
void check_step(const test::decode_case<P, T>& c, const typename test::decode_case<P, T>::step& s,
                const std::vector<rank_result<>>& res) {
  const auto [err, lse_err] = c.error(s, res[0].out, res[0].lse);
  CHECK(err < 8e-3);
  CHECK(lse_err < 2e-3);
  for (std::size_t r = 0; r < res.size(); ++r) {
    CAPTURE(r);
    CHECK(test::same_bits(res[r].out, res[r].lse, res[0].out, res[0].lse));
    CHECK(res[r].sent == res[r].expected);
    CHECK(res[r].repeatable);
    CHECK(res[r].heap == 0);
    CHECK(res[r].allocations == 0);
  }
}

// `head_dim_v` 0: q, k and v 128 wide; else q/k 192 and v that wide (the wgmma kernels).
template <class P>
void check_device_decode(int head_dim_v = 0) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(head_dim_v);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  for (int group : {1, 4, 8})
    for (int ranks : {1, 2, 3, 4, 8}) {
      CAPTURE(group);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(group * 10 + ranks));
      const attention_arguments a{.q_heads = 8,
                                  .kv_heads = 8 / group,
                                  .head_dim = head_dim_v ? 192 : 128,
                                  .head_dim_v = head_dim_v};
      test::decode_case<P, T> c(test::random_cu_seqlens(3, 1, small ? 120 : 400, rng), ranks, a,
                                rng);
      for (int step = 0; step < 3; ++step) {
        CAPTURE(step);
        const auto s = c.draw(rng, step == 2 ? 0 : 1, 4);
        const auto res = device_step(c, s, step == 0);
        check_step(c, s, res);
        CHECK(res[0].expected ==
              static_cast<std::uint64_t>(ranks - 1) *
                  test::finished_partial_bytes(s.tokens * a.q_heads, a.v_dim(), sizeof(T)));
        CHECK(c.append(s) == s.tokens);
      }
    }
}

// NaN in q_new, k_new, v_new or one rank's cache (a key element): every output it reaches is
// NaN on every rank, the same bits everywhere, never the other ranks' answer or "no key".
template <class P>
void check_device_decode_nan() {
  test::for_each_nan_decode<P, T>(
      {8, 2, 128, 0.0f}, 200,
      [](const test::decode_case<P, T>& c, const typename test::decode_case<P, T>::step& s) {
        const auto res = device_step(c, s, false);
        CHECK(c.check_strict(s, res[0].out, res[0].lse, 8e-3, 2e-3) > 0);
        for (int r = 1; r < c.ranks; ++r)
          CHECK(test::same_bits(res[r].out, res[r].lse, res[0].out, res[0].lse));
      });
}
} // namespace

TEST_CASE_TEMPLATE("device sharded decode: NaN in the new tokens or a rank's cache reaches the "
                   "result",
                   P, contiguous, zigzag) {
  check_device_decode_nan<P>();
}

TEST_CASE_TEMPLATE("device sharded decode, virtual ranks on one GPU, equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  check_device_decode<P>();
  if (forward_path_available(forward_path::wgmma, 192, 128))
    check_device_decode<P>(128); // multi-head latent attention: q/k 192, v and out 128
}

// The device step runs the decode program (ring/program.cuh) as the host step does: what each
// rank sends on the device is its program's messages in their order, and what it sends on the
// host path for the same step.
TEST_CASE("device sharded decode: every rank sends its step program's messages, in their order, "
          "as on the host path") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  using recorder = test::recording_communicator<in_process_communicator>;
  const attention_arguments a{.q_heads = 8, .kv_heads = 2, .head_dim = 128};
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim, dv = a.v_dim();
  std::size_t messages = 0;
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    test::decode_case<zigzag, T> c(test::random_cu_seqlens(3, 1, 120, rng), ranks, a, rng);
    const auto s = c.draw(rng, 1, 4);
    const std::int64_t n = s.tokens;
    const std::size_t slot = test::finished_partial_bytes(n * qh, dv, sizeof(T));
    std::vector<std::vector<test::sent>> device(static_cast<std::size_t>(ranks)),
        host(static_cast<std::size_t>(ranks));
    in_process_group group(ranks, std::chrono::seconds(60));
    const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
      RINGATTN_CUDA_CHECK(cudaSetDevice(0));
      recorder rec(comm);
      sharded_attention<recorder, causal> dec(rec, a);
      dec.prepare_device();
      const auto sh = c.rank_shard(r);
      const std::int64_t m = sh.tokens();
      dec.plan(s.cu_new, sh.cu);
      test::device_buffer<T> q(s.q), k(s.k), v(s.v), kc(sh.k), vc(sh.v);
      test::device_buffer<T> out(std::vector<T>(n * qh * dv, test::poison<T>()));
      test::device_buffer<float> lse(std::vector<float>(n * qh, -7.0f));
      const std::size_t bytes = dec.device_workspace_bytes<T>();
      test::device_buffer<std::byte> ws(bytes);
      rec.log.clear();
      dec.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                  thd_view<const T>(v.get(), n, kvh, dv), thd_view<const T>(kc.get(), m, kvh, d),
                  thd_view<const T>(vc.get(), m, kvh, dv), thd_view<T>(out.get(), n, qh, dv),
                  lse.get(), ws.get(), bytes, cudaStreamPerThread);
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
      device[static_cast<std::size_t>(r)] = rec.log;
      std::vector<std::byte> hws(dec.host_workspace_bytes<T>());
      std::vector<T> hout(static_cast<std::size_t>(n * qh * dv), test::poison<T>());
      std::vector<float> hlse(static_cast<std::size_t>(n * qh), -7.0f);
      rec.log.clear();
      dec.forward_host(
          thd_view<const T>(s.q.data(), n, qh, d), thd_view<const T>(s.k.data(), n, kvh, d),
          thd_view<const T>(s.v.data(), n, kvh, dv), thd_view<const T>(sh.k.data(), m, kvh, d),
          thd_view<const T>(sh.v.data(), m, kvh, dv), thd_view<T>(hout.data(), n, qh, dv),
          hlse.data(), hws);
      host[static_cast<std::size_t>(r)] = rec.log;
    });
    for (const auto& e : errors)
      REQUIRE(test::message(e) == "");
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      detail::trace_engine program;
      detail::decode_program::step(program, r, ranks, n, slot);
      const auto expected = test::seen_of(program.messages());
      CHECK(device[static_cast<std::size_t>(r)] == expected);
      CHECK(host[static_cast<std::size_t>(r)] == expected);
      messages += expected.size();
    }
  }
  CHECK(messages > 0);
}

namespace {
// Caches of thousands of tokens per sequence (the split kernel cuts each into many splits, the
// last stage of a split partly past its end), new tokens x GQA group up to the kernel's 64 rows
// (one, two and four row tiles), head_dim 128 and 64; element type E. The block kernel's
// tolerances: 8e-3 relative L2 on the output and 2e-3 absolute on the LSE.
template <class P, class E>
void check_long_caches() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  struct shape {
    int kv_heads, head_dim, most_new;
  };
  for (const shape sh : {shape{8, 128, 16}, shape{2, 128, 16}, shape{1, 128, 8}, shape{2, 64, 16}})
    for (int ranks : {1, 3}) {
      CAPTURE(sh.kv_heads);
      CAPTURE(sh.head_dim);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed +
                          static_cast<std::uint64_t>(sh.kv_heads * 1000 + sh.head_dim + ranks));
      const attention_arguments a{.q_heads = 8, .kv_heads = sh.kv_heads, .head_dim = sh.head_dim};
      test::decode_case<P, E> c(
          test::random_cu_seqlens(3, small ? 300 : 2000, small ? 900 : 9000, rng), ranks, a, rng);
      for (int step = 0; step < 2; ++step) {
        CAPTURE(step);
        const auto s = c.draw(rng, step == 0 ? 1 : 0, sh.most_new);
        const auto res = device_step<P, E>(c, s, false);
        const auto [err, lse_err] = c.error(s, res[0].out, res[0].lse);
        CHECK(err < 8e-3);
        CHECK(lse_err < 2e-3);
        for (int r = 1; r < ranks; ++r)
          CHECK(test::same_bits(res[r].out, res[r].lse, res[0].out, res[0].lse));
        CHECK(c.append(s) == s.tokens);
      }
    }
}
} // namespace

TEST_CASE_TEMPLATE("device sharded decode over long caches: many splits per sequence, 0-16 new "
                   "tokens per sequence, bf16 and fp16",
                   P, contiguous, zigzag) {
  check_long_caches<P, __nv_bfloat16>();
  check_long_caches<P, __half>();
}

namespace {
// A paged cache on the device (test::page_out: each rank's pages shuffled through a pool whose
// rows no sequence owns are NaN): the split kernel reading through the page table (pages of 16,
// 64 and 256 tokens, thousands of tokens per sequence), and where it does not take the block
// (8 x 16 query rows per kv head; q/k 192 wide) the block forward over runs of consecutive
// pages. The block kernel's tolerances: 8e-3 relative L2 on the output, 2e-3 absolute on the LSE.
template <class P>
void check_paged() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  struct shape {
    int kv_heads, head_dim, head_dim_v, most_new, page_size, shortest, longest;
  };
  const shape shapes[] = {{2, 128, 0, 16, 16, 2000, 6000},
                          {8, 128, 0, 4, 64, 2000, 6000},
                          {2, 64, 0, 16, 256, 1000, 5000},
                          {1, 128, 0, 16, 16, 50, 400},
                          {2, 192, 128, 2, 32, 50, 400}};
  for (const shape sh : shapes) {
    if (sh.head_dim_v && !forward_path_available(forward_path::wgmma, sh.head_dim, sh.head_dim_v))
      continue;
    for (int ranks : {1, 3}) {
      CAPTURE(sh.kv_heads);
      CAPTURE(sh.head_dim);
      CAPTURE(sh.page_size);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(sh.page_size * 100 + sh.head_dim +
                                                            sh.kv_heads * 10 + ranks));
      const attention_arguments a{.q_heads = 8,
                                  .kv_heads = sh.kv_heads,
                                  .head_dim = sh.head_dim,
                                  .head_dim_v = sh.head_dim_v};
      test::decode_case<P, T> c(test::random_cu_seqlens(3, small ? sh.shortest / 4 : sh.shortest,
                                                        small ? sh.longest / 4 : sh.longest, rng),
                                ranks, a, rng);
      for (int step = 0; step < 2; ++step) {
        CAPTURE(step);
        const auto s = c.draw(rng, step == 0 ? 1 : 0, sh.most_new);
        check_step(c, s, device_step<P>(c, s, step == 0, sh.page_size, rng()));
        CHECK(c.append(s) == s.tokens);
      }
    }
  }
}
} // namespace

TEST_CASE_TEMPLATE("device sharded decode over a paged cache: pages of 16-256 tokens through the "
                   "split kernel's page table, or runs of pages through the block forward",
                   P, contiguous, zigzag) {
  check_paged<P>();
}

namespace {
// One step over each rank's cache quantised to FP8 with `Scales` (`page_size` 0: its packed
// shard, else its paged pool), the oracle re-solved over the dequantised values.
template <class Scales, class P, class E>
std::vector<rank_result<E>> fp8_step(test::decode_case<P, E>& c,
                                     typename test::decode_case<P, E>::step& s, bool repeat,
                                     int page_size, std::uint64_t page_seed) {
  std::vector<test::fp8_shard> fp8;
  for (int r = 0; r < c.ranks; ++r) {
    if (page_size == 0) {
      const auto sh = c.rank_shard(r);
      fp8.push_back(test::quantize_shard<Scales>(c, r, sh.k, sh.v, sh.tokens(), 0,
                                                 test::packed_owner(sh.cu)));
    } else {
      const auto pool = pool_of(c, r, page_size, page_seed);
      fp8.push_back(test::quantize_shard<Scales>(c, r, pool.k, pool.v, pool.pages * page_size,
                                                 std::countr_zero(static_cast<unsigned>(page_size)),
                                                 test::paged_owner(pool, page_size)));
    }
  }
  c.solve(s);
  return device_step<P, E, Scales>(c, s, repeat, page_size, page_seed, &fp8);
}

// An FP8 cache (e4m3 with per-head or per-(page, head) scales) on the device, slab and paged
// (pages of 16 and 64 tokens, rows no sequence owns NaN), 1..16 new tokens x GQA 1..8 (every
// row-tile count), head_dim 128 and 64, bf16 and fp16: against the float64 oracle over the
// dequantised cache with the bf16 cache's tolerances (8e-3 relative L2 on the output, 2e-3
// absolute on the LSE); every rank the same bits; a repeated step the same bits with no
// allocation.
template <class P, class E>
void check_fp8() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  struct shape {
    int kv_heads, head_dim, most_new, page_size;
    bool per_page;
  };
  const shape shapes[] = {{2, 128, 16, 0, false},
                          {8, 128, 4, 16, false},
                          {2, 128, 16, 16, true},
                          {1, 64, 8, 64, true},
                          {4, 64, 2, 0, false}};
  for (const shape sh : shapes)
    for (int ranks : {1, 3}) {
      CAPTURE(sh.kv_heads);
      CAPTURE(sh.head_dim);
      CAPTURE(sh.page_size);
      CAPTURE(sh.per_page);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(sh.page_size * 100 + sh.head_dim +
                                                            sh.kv_heads * 10 + ranks));
      const attention_arguments a{.q_heads = 8, .kv_heads = sh.kv_heads, .head_dim = sh.head_dim};
      test::decode_case<P, E> c(
          test::random_cu_seqlens(3, small ? 200 : 1000, small ? 900 : 5000, rng), ranks, a, rng);
      for (int step = 0; step < 2; ++step) {
        CAPTURE(step);
        auto s = c.draw(rng, step == 0 ? 1 : 0, sh.most_new);
        const auto res = sh.per_page ? fp8_step<page_scales>(c, s, step == 0, sh.page_size, rng())
                                     : fp8_step<head_scales>(c, s, step == 0, sh.page_size, rng());
        const auto [err, lse_err] = c.error(s, res[0].out, res[0].lse);
        CHECK(err < 8e-3);
        CHECK(lse_err < 2e-3);
        for (int r = 0; r < ranks; ++r) {
          CAPTURE(r);
          CHECK(test::same_bits(res[r].out, res[r].lse, res[0].out, res[0].lse));
          CHECK(res[r].repeatable);
          CHECK(res[r].heap == 0);
          CHECK(res[r].allocations == 0);
        }
        CHECK(c.append(s) == s.tokens);
      }
    }
}
} // namespace

TEST_CASE_TEMPLATE("device sharded decode over an FP8 cache: per-head and per-page scales, slab "
                   "and paged, bf16 and fp16",
                   P, contiguous, zigzag) {
  check_fp8<P, __nv_bfloat16>();
  check_fp8<P, __half>();
}

TEST_CASE_TEMPLATE("device sharded decode over an FP8 cache: queries of 1e-5 against keys of 1e5, "
                   "values whose magnitude changes 10^4-fold from page to page",
                   E, __nv_bfloat16, __half) {
  // The fp16 products take bf16 queries far below fp16's normal range (each row scaled by a power
  // of two), and per-page value scales 10^4 apart within a split (the weights meet them relative
  // to the split's first key's). Tolerances as above.
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (const bool per_page : {false, true}) {
    CAPTURE(per_page);
    std::mt19937_64 rng(seed + per_page);
    const attention_arguments a{.q_heads = 8, .kv_heads = 2, .head_dim = 128};
    test::decode_case<contiguous, E> c(test::random_cu_seqlens(3, 500, 2000, rng), 2, a, rng);
    const bool tiny_queries = std::is_same_v<E, __nv_bfloat16>; // fp16 has no such queries
    if (tiny_queries) c.rescale(true, [](std::int64_t) { return 1e5; });
    c.rescale(false, [](std::int64_t pos) { return (pos / 64) % 2 ? 1e-2 : 1e2; });
    auto s = c.draw(rng, 1, 4);
    if (tiny_queries) {
      for (auto& x : s.q)
        x = from_float<E>(to_float(x) * 1e-5f);
      for (auto& x : s.k)
        x = from_float<E>(to_float(x) * 1e5f);
    }
    c.solve(s);
    const auto res = per_page ? fp8_step<page_scales>(c, s, false, 16, rng())
                              : fp8_step<head_scales>(c, s, false, 16, rng());
    const auto [err, lse_err] = c.error(s, res[0].out, res[0].lse);
    CHECK(err < 8e-3);
    CHECK(lse_err < 2e-3);
    CHECK(test::same_bits(res[1].out, res[1].lse, res[0].out, res[0].lse));
  }
}

TEST_CASE("device sharded decode over an FP8 cache: NaN in a cached element or a scale reaches "
          "the result") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int page_size : {0, 16}) {
    CAPTURE(page_size);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(page_size));
    const attention_arguments a{.q_heads = 8, .kv_heads = 2, .head_dim = 128};
    test::decode_case<contiguous, T> c(test::random_cu_seqlens(3, 100, 400, rng), 2, a, rng);
    c.plant_cache(1, 0, 0, /*key=*/true, 5, std::numeric_limits<float>::quiet_NaN());
    auto s = c.draw(rng, 1, 3);
    const auto res = page_size ? fp8_step<page_scales>(c, s, false, page_size, rng())
                               : fp8_step<head_scales>(c, s, false, 0, 0);
    CHECK(c.check_strict(s, res[0].out, res[0].lse, 8e-3, 2e-3) > 0);
    CHECK(test::same_bits(res[1].out, res[1].lse, res[0].out, res[0].lse));
  }
}

TEST_CASE("device sharded decode over an FP8 cache: a step the split kernel does not take, or "
          "host scales, fail on every rank; the next step runs") {
  // 9 new tokens x 8 query heads of one kv head (72 rows) go to the block forward, which reads
  // no FP8 cache.
  for (const bool wide : {true, false}) {
    CAPTURE(wide);
    const int ranks = 2, qh = 8, kvh = wide ? 1 : 2, d = 128, per = wide ? 9 : 1, n = 2 * per,
              m = 40;
    const attention_arguments a{qh, kvh, d, 0.0f};
    std::vector<std::string> why(ranks);
    std::vector<float> after(ranks, 0.0f);
    in_process_group group(ranks, std::chrono::seconds(60));
    const std::vector<float> host_scales(kvh, 0.25f);
    const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
      RINGATTN_CUDA_CHECK(cudaSetDevice(0));
      decoder dec(comm, a);
      dec.prepare_device();
      const std::vector<std::int32_t> cu_new{0, per, n}, cu_cache{0, 25, m};
      dec.plan(cu_new, cu_cache);
      test::device_buffer<T> q(std::vector<T>(n * qh * d, from_float<T>(0.5f)));
      test::device_buffer<T> k(std::vector<T>(n * kvh * d, from_float<T>(0.25f)));
      test::device_buffer<fp8_e4m3> kc(std::vector<fp8_e4m3>(m * kvh * d, quantize_e4m3(0.5f, 1)));
      test::device_buffer<float> scales(host_scales);
      test::device_buffer<T> out(std::vector<T>(n * qh * d, test::poison<T>()));
      test::device_buffer<float> lse(std::vector<float>(n * qh, -7.0f));
      const std::size_t bytes = dec.device_workspace_bytes<T>();
      test::device_buffer<std::byte> ws(bytes);
      auto run = [&](const float* ks) {
        dec.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                    thd_view<const T>(k.get(), n, kvh, d),
                    thd_view<const fp8_e4m3>(kc.get(), m, kvh, d),
                    thd_view<const fp8_e4m3>(kc.get(), m, kvh, d), head_scales{ks, scales.get()},
                    thd_view<T>(out.get(), n, qh, d), lse.get(), ws.get(), bytes, nullptr);
      };
      try { // rank 1 alone passes host scales (where the shapes would run)
        run(r == 1 && !wide ? host_scales.data() : scales.get());
      } catch (const invalid_argument& e) {
        why[r] = e.what();
      }
      if (!wide) {
        run(scales.get());
        RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
        after[r] = to_float(out.download()[0]);
      }
    });
    for (const auto& e : errors)
      REQUIRE(test::message(e) == "");
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      if (wide) {
        CHECK(why[r].find("an FP8 cache is read by the split-K/V kernel, which takes head_dim 64 "
                          "or 128") != std::string::npos);
      } else {
        CHECK(why[r].find(r == 1 ? "scales.k is host memory" : "rank 1 rejected call") !=
              std::string::npos);
        // Token 0 sees its 25 cached values (0.125) and its own (0.25).
        CHECK(after[r] > 0.125f);
        CHECK(after[r] < 0.25f);
      }
    }
  }
}

TEST_CASE("device sharded decode: host memory on one rank fails on every rank; the next step "
          "runs") {
  const attention_arguments a{8, 2, 128, 0.0f};
  const int ranks = 3, qh = 8, kvh = 2, d = 128, n = 2;
  std::vector<std::string> why(ranks);
  std::vector<float> after(ranks, 0.0f);
  std::uint64_t launched = 0;
  std::barrier sync(ranks);
  in_process_group group(ranks, std::chrono::seconds(60));
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    RINGATTN_CUDA_CHECK(cudaSetDevice(0));
    decoder dec(comm, a);
    dec.prepare_device();
    const std::vector<std::int32_t> cu_new{0, 1, 2}, cu_cache{0, 3, 3 + r};
    dec.plan(cu_new, cu_cache);
    const std::int64_t m = 3 + r;
    test::device_buffer<T> q(std::vector<T>(n * qh * d, from_float<T>(0.5f)));
    test::device_buffer<T> kv(std::vector<T>(m * kvh * d, from_float<T>(0.25f)));
    test::device_buffer<T> out(std::vector<T>(n * qh * d, test::poison<T>()));
    test::device_buffer<float> lse(n * qh);
    std::vector<T> host_out(n * qh * d);
    const std::size_t bytes = dec.device_workspace_bytes<T>();
    test::device_buffer<std::byte> ws(bytes);
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto run = [&](T* o) {
      dec.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(kv.get(), n, kvh, d),
                  thd_view<const T>(kv.get(), n, kvh, d), thd_view<const T>(kv.get(), m, kvh, d),
                  thd_view<const T>(kv.get(), m, kvh, d), thd_view<T>(o, n, qh, d), lse.get(),
                  ws.get(), bytes, stream);
    };
    sync.arrive_and_wait();
    if (r == 0) launched = detail::kernel_launches.load();
    sync.arrive_and_wait();
    try {
      run(r == 1 ? host_out.data() : out.get());
    } catch (const invalid_argument& e) {
      why[r] = e.what();
    }
    sync.arrive_and_wait();
    if (r == 0) launched = detail::kernel_launches.load() - launched;
    run(out.get());
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    after[r] = to_float(out.download()[0]);
    RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  for (const auto& e : errors)
    REQUIRE(test::message(e) == "");
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(why[r].find("out is host memory; the device forward takes device memory") !=
          std::string::npos);
    CHECK(after[r] == doctest::Approx(0.25)); // every value is 0.25
  }
  CHECK(launched == 0); // the refused call enqueued nothing on any rank
}

TEST_CASE("device sharded decode: steps planned back to back reuse their tables and allocate "
          "nothing once warm") {
  // Eight steps of 1-2 new tokens per sequence over 3 ranks, each planned while the step before
  // may still run (no wait between steps): every step against the oracle, the same bits on every
  // rank, and no device or pinned allocation from the third plan on.
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const int ranks = 3, steps = 8, warm = 2;
  const attention_arguments a{8, 2, 128, 0.0f};
  test::decode_case<zigzag, T> c(test::random_cu_seqlens(3, 1, 300, rng), ranks, a, rng);
  std::vector<test::decode_case<zigzag, T>::step> s;
  std::vector<std::vector<test::decode_case<zigzag, T>::shard>> shards;
  for (int k = 0; k < steps; ++k) {
    s.push_back(c.draw(rng, 1, 2));
    shards.emplace_back();
    for (int r = 0; r < ranks; ++r)
      shards.back().push_back(c.rank_shard(r));
    c.append(s.back());
  }
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim;
  std::vector<std::vector<rank_result<>>> res(steps, std::vector<rank_result<>>(ranks));
  std::uint64_t allocated = 0;
  std::vector<std::size_t> needed(ranks, 0);
  std::barrier sync(ranks);
  in_process_group group(ranks, std::chrono::seconds(60));
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    RINGATTN_CUDA_CHECK(cudaSetDevice(0));
    decoder dec(comm, a);
    dec.prepare_device();
    std::deque<test::device_buffer<T>> q, k, v, kc, vc, out; // no moves: deques
    std::deque<test::device_buffer<float>> lse;
    for (int i = 0; i < steps; ++i) {
      const std::int64_t n = s[i].tokens;
      q.emplace_back(s[i].q), k.emplace_back(s[i].k), v.emplace_back(s[i].v);
      kc.emplace_back(shards[i][r].k), vc.emplace_back(shards[i][r].v);
      out.emplace_back(std::vector<T>(n * qh * d, test::poison<T>()));
      lse.emplace_back(std::vector<float>(n * qh, -7.0f));
    }
    const std::size_t bytes = std::size_t{8} << 20;
    test::device_buffer<std::byte> ws(bytes);
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int i = 0; i < steps; ++i) {
      if (i == warm) {
        sync.arrive_and_wait();
        if (r == 0) allocated = detail::device_allocations.load();
        sync.arrive_and_wait();
      }
      const std::int64_t n = s[i].tokens, m = shards[i][r].tokens();
      dec.plan(s[i].cu_new, shards[i][r].cu);
      needed[r] = std::max(needed[r], dec.device_workspace_bytes<T>());
      dec.forward(thd_view<const T>(q[i].get(), n, qh, d), thd_view<const T>(k[i].get(), n, kvh, d),
                  thd_view<const T>(v[i].get(), n, kvh, d),
                  thd_view<const T>(kc[i].get(), m, kvh, d),
                  thd_view<const T>(vc[i].get(), m, kvh, d), thd_view<T>(out[i].get(), n, qh, d),
                  lse[i].get(), ws.get(), bytes, stream);
    }
    sync.arrive_and_wait();
    if (r == 0) allocated = detail::device_allocations.load() - allocated;
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    for (int i = 0; i < steps; ++i)
      res[i][r].out = out[i].download(), res[i][r].lse = lse[i].download();
    RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  for (const auto& e : errors)
    REQUIRE(test::message(e) == "");
  CHECK(allocated == 0);
  for (int i = 0; i < steps; ++i) {
    CAPTURE(i);
    // bf16 tolerances of the device block kernel (as above)
    const auto [err, lse_err] = c.error(s[i], res[i][0].out, res[i][0].lse);
    CHECK(err < 8e-3);
    CHECK(lse_err < 2e-3);
    for (int r = 1; r < ranks; ++r)
      CHECK(test::same_bits(res[i][r].out, res[i][r].lse, res[i][0].out, res[i][0].lse));
  }
  for (int r = 0; r < ranks; ++r)
    CHECK(needed[r] <= std::size_t{8} << 20);
}

TEST_CASE("device sharded decode: a step captured in a CUDA graph replays with the bits of the "
          "step run directly") {
  // One rank (the in-process exchange between virtual ranks is not capturable; NCCL's is): each
  // of three steps (up to 8 new tokens per sequence, caches of 500-3000 tokens) run directly,
  // then captured on the stream and the graph replayed twice, the outputs poisoned before each
  // replay; the direct step against the oracle (the device block kernel's bf16 tolerances).
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const attention_arguments a{8, 2, 128, 0.0f};
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim, steps = 3;
  test::decode_case<contiguous, T> c(test::random_cu_seqlens(3, 500, 3000, rng), 1, a, rng);
  std::vector<test::decode_case<contiguous, T>::step> s;
  std::vector<rank_result<>> direct(steps), replayed(2 * steps);
  in_process_group group(1, std::chrono::seconds(60));
  const auto errors = test::on_ranks(group, [&](int, in_process_communicator& comm) {
    RINGATTN_CUDA_CHECK(cudaSetDevice(0));
    decoder dec(comm, a);
    dec.prepare_device();
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int i = 0; i < steps; ++i) {
      s.push_back(c.draw(rng, 1, 8));
      const auto sh = c.rank_shard(0);
      dec.plan(s[i].cu_new, sh.cu);
      const std::int64_t n = s[i].tokens, m = sh.tokens();
      test::device_buffer<T> q(s[i].q), k(s[i].k), v(s[i].v), kc(sh.k), vc(sh.v);
      test::device_buffer<T> out(static_cast<std::size_t>(n * qh * d));
      test::device_buffer<float> lse(static_cast<std::size_t>(n * qh));
      const std::size_t bytes = dec.device_workspace_bytes<T>();
      test::device_buffer<std::byte> ws(bytes);
      auto poison = [&] {
        out.upload(std::vector<T>(n * qh * d, test::poison<T>()));
        lse.upload(std::vector<float>(n * qh, -7.0f));
      };
      auto step = [&] {
        dec.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                    thd_view<const T>(v.get(), n, kvh, d), thd_view<const T>(kc.get(), m, kvh, d),
                    thd_view<const T>(vc.get(), m, kvh, d), thd_view<T>(out.get(), n, qh, d),
                    lse.get(), ws.get(), bytes, stream);
      };
      poison();
      step();
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
      direct[i].out = out.download(), direct[i].lse = lse.download();
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      RINGATTN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      step();
      RINGATTN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
      RINGATTN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 2; ++replay) {
        poison();
        RINGATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
        replayed[2 * i + replay].out = out.download(),
                         replayed[2 * i + replay].lse = lse.download();
      }
      RINGATTN_CUDA_CHECK(cudaGraphExecDestroy(exec));
      RINGATTN_CUDA_CHECK(cudaGraphDestroy(graph));
      c.append(s[i]);
    }
    RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  for (const auto& e : errors)
    REQUIRE(test::message(e) == "");
  for (int i = 0; i < steps; ++i) {
    CAPTURE(i);
    const auto [err, lse_err] = c.error(s[i], direct[i].out, direct[i].lse);
    CHECK(err < 8e-3);
    CHECK(lse_err < 2e-3);
    for (int replay = 0; replay < 2; ++replay)
      CHECK(test::same_bits(replayed[2 * i + replay].out, replayed[2 * i + replay].lse,
                            direct[i].out, direct[i].lse));
  }
}

TEST_CASE("device sharded decode fixed for CUDA graphs: one capture replays the steps of "
          "growing slab and paged caches, allocating nothing after the first plan") {
  // One rank (the in-process exchange is not capturable), 3 sequences (one with no cached token
  // at first) of 2, 1 and 3 new tokens each step, over a slab of fixed capacity and over a paged
  // pool with a fixed-width page table (pages of 16, shuffled): the first plan's step captured
  // once, then 6 steps each planned with their new lengths and replayed from the graph (outputs
  // poisoned before each), against the oracle (the device block kernel's bf16 tolerances) and
  // bitwise against the same plan's step run directly. Then plans that change the launch are
  // refused with a sentence, as is a forward on another stream, and the next step replays.
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (const int page_size : {0, 16}) {
    CAPTURE(page_size);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(page_size));
    const attention_arguments a{8, 2, 128, 0.0f};
    const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim, steps = 6, batch = 3;
    const auto l1 = static_cast<std::int32_t>(300 + rng() % 1500),
               l2 = static_cast<std::int32_t>(1000 + rng() % 2000);
    test::decode_case<contiguous, T> c({0, 0, l1, l1 + l2}, 1, a, rng);
    const std::vector<std::int32_t> cu_new{0, 2, 3, 6};
    const std::int32_t capacity = 3200, width = capacity / 16; // rows / pages per sequence
    const std::size_t row = c.kv_row();
    // The fixed layout of the current cache: the rows (NaN where no token is) and its plan.
    std::vector<std::int32_t> perm(static_cast<std::size_t>(batch * width));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const std::vector<std::int32_t> cu_pages{0, width, 2 * width, 3 * width};
    const std::vector<std::int32_t> begin{0, capacity, 2 * capacity};
    auto layout = [&](std::vector<T>& k, std::vector<T>& v, std::vector<std::int32_t>& length) {
      const auto sh = c.rank_shard(0);
      k.assign(batch * capacity * row, from_float<T>(std::numeric_limits<float>::quiet_NaN()));
      v = k;
      length.clear();
      for (int b = 0; b < batch; ++b) {
        length.push_back(sh.cu[b + 1] - sh.cu[b]);
        REQUIRE(length.back() <= capacity);
        for (std::int32_t j = 0; j < length.back(); ++j) {
          const std::int64_t at =
              page_size ? std::int64_t{perm[b * width + j / 16]} * 16 + j % 16 : begin[b] + j;
          std::copy_n(sh.k.begin() + (sh.cu[b] + j) * row, row, k.begin() + at * row);
          std::copy_n(sh.v.begin() + (sh.cu[b] + j) * row, row, v.begin() + at * row);
        }
      }
    };
    std::vector<rank_result<>> replayed(steps), direct(steps);
    std::vector<test::decode_case<contiguous, T>::step> s;
    std::uint64_t allocated = 0;
    std::vector<std::string> refusals;
    in_process_group group(1, std::chrono::seconds(60));
    const auto errors = test::on_ranks(group, [&](int, in_process_communicator& comm) {
      RINGATTN_CUDA_CHECK(cudaSetDevice(0));
      cudaStream_t stream, other;
      RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
      decoder dec(comm, a);
      dec.prepare_device(graph_steps{stream});
      const std::int64_t n = cu_new.back(), m = std::int64_t{batch} * capacity;
      auto sized = [](std::int64_t x) { return static_cast<std::size_t>(x); };
      test::device_buffer<T> q(sized(n * qh * d)), k(sized(n * kvh * d)), v(sized(n * kvh * d)),
          kc(sized(m * kvh * d)), vc(sized(m * kvh * d)), out(sized(n * qh * d));
      test::device_buffer<float> lse(sized(n * qh));
      std::size_t ws_bytes = 0;
      std::optional<test::device_buffer<std::byte>> ws;
      std::vector<T> hk, hv;
      std::vector<std::int32_t> length;
      auto plan = [&] {
        if (page_size)
          dec.plan(cu_new, paged_cache{16, batch * width, cu_pages, perm, length});
        else
          dec.plan(cu_new, begin, length, m);
      };
      auto forward = [&](cudaStream_t on) {
        dec.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                    thd_view<const T>(v.get(), n, kvh, d), thd_view<const T>(kc.get(), m, kvh, d),
                    thd_view<const T>(vc.get(), m, kvh, d), thd_view<T>(out.get(), n, qh, d),
                    lse.get(), ws->get(), ws_bytes, on);
      };
      auto poison = [&] {
        out.upload(std::vector<T>(n * qh * d, test::poison<T>()));
        lse.upload(std::vector<float>(n * qh, -7.0f));
      };
      cudaGraphExec_t exec = nullptr;
      for (int i = 0; i < steps; ++i) {
        s.push_back(c.draw(rng, cu_new));
        layout(hk, hv, length);
        q.upload(s[i].q), k.upload(s[i].k), v.upload(s[i].v), kc.upload(hk), vc.upload(hv);
        plan();
        if (i == 0) { // the workspace of the fixed launch, then the capture
          ws_bytes = dec.device_workspace_bytes<T>();
          ws.emplace(ws_bytes);
          cudaGraph_t graph;
          RINGATTN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          forward(stream);
          RINGATTN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
          RINGATTN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
          RINGATTN_CUDA_CHECK(cudaGraphDestroy(graph));
          allocated = detail::device_allocations.load();
        }
        CHECK(dec.device_workspace_bytes<T>() == ws_bytes);
        poison();
        RINGATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
        RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
        replayed[i].out = out.download(), replayed[i].lse = lse.download();
        poison();
        forward(stream);
        RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
        direct[i].out = out.download(), direct[i].lse = lse.download();
        c.append(s[i]);
      }
      allocated = detail::device_allocations.load() - allocated;
      // Plans that change the launch, and a forward on another stream: refused, then a step.
      auto refused = [&](auto&& call) {
        try {
          call();
          refusals.push_back("");
        } catch (const invalid_argument& e) {
          refusals.push_back(e.what());
        }
      };
      layout(hk, hv, length);
      kc.upload(hk), vc.upload(hv);
      const std::vector<std::int32_t> other_new{0, 1, 3, 6};
      refused([&] { dec.plan(other_new, begin, length, m); });
      refused([&] { dec.plan(cu_new, begin, length, m - 1); });
      refused([&] { dec.plan(cu_new, c.rank_shard(0).cu); });
      plan();
      refused([&] { forward(other); });
      s.push_back(c.draw(rng, cu_new));
      q.upload(s.back().q), k.upload(s.back().k), v.upload(s.back().v);
      plan();
      poison();
      RINGATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
      replayed.push_back({out.download(), lse.download()});
      RINGATTN_CUDA_CHECK(cudaGraphExecDestroy(exec));
      RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
      RINGATTN_CUDA_CHECK(cudaStreamDestroy(other));
    });
    for (const auto& e : errors)
      REQUIRE(test::message(e) == "");
    CHECK(allocated == 0);
    for (int i = 0; i <= steps; ++i) {
      CAPTURE(i);
      const auto [err, lse_err] = c.error(s[i], replayed[i].out, replayed[i].lse);
      CHECK(err < 8e-3);
      CHECK(lse_err < 2e-3);
      if (i < steps)
        CHECK(test::same_bits(replayed[i].out, replayed[i].lse, direct[i].out, direct[i].lse));
    }
    REQUIRE(refusals.size() == 4);
    CHECK(refusals[0].find("keeps the first plan's cu_new") != std::string::npos);
    CHECK(refusals[1].find("keeps the first plan's cache of") != std::string::npos);
    CHECK(refusals[2].find("keeps the first plan's cache of") != std::string::npos);
    CHECK(refusals[3].find("the steps run on the stream given to prepare_device(graph_steps)") !=
          std::string::npos);
  }
}

TEST_CASE("quantize_into_cache: the device writes the host's bits, through a row list and page "
          "scales; NaN and inf become NaN, large values saturate") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const int kvh = 2, d = 64, n = 37, rows = 64, page_size = 16;
  auto src = test::random_buffer<T>(static_cast<std::size_t>(n) * kvh * d, rng);
  src[3] = from_float<T>(std::numeric_limits<float>::quiet_NaN());
  src[4] = from_float<T>(std::numeric_limits<float>::infinity());
  src[5] = from_float<T>(1e6f);
  std::vector<std::int64_t> to(rows);
  std::iota(to.begin(), to.end(), 0);
  std::shuffle(to.begin(), to.end(), rng);
  to.resize(n);
  std::vector<float> scales(rows / page_size * kvh);
  for (float& s : scales)
    s = 0.001f + static_cast<float>(rng() % 1000) / 100000.0f;
  for (const bool per_page : {false, true}) {
    CAPTURE(per_page);
    std::vector<fp8_e4m3> host(static_cast<std::size_t>(rows) * kvh * d, quantize_e4m3(0, 1));
    const thd_view<const T> sv(src.data(), n, kvh, d);
    test::device_buffer<T> dsrc(src);
    test::device_buffer<std::int64_t> drows(to);
    test::device_buffer<float> dscales(scales);
    test::device_buffer<fp8_e4m3> dev(host);
    const thd_view<fp8_e4m3> hv(host.data(), rows, kvh, d), dv(dev.get(), rows, kvh, d);
    const thd_view<const T> dsv(dsrc.get(), n, kvh, d);
    if (per_page) {
      quantize_into_cache_host(sv, to, hv, page_scales{nullptr, scales.data()}, false, page_size);
      quantize_into_cache(dsv, drows.get(), dv, page_scales{nullptr, dscales.get()}, false,
                          page_size, nullptr);
    } else {
      quantize_into_cache_host(sv, to, hv, head_scales{scales.data(), nullptr}, true);
      quantize_into_cache(dsv, drows.get(), dv, head_scales{dscales.get(), nullptr}, true, 1,
                          nullptr);
    }
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
    const auto got = dev.download();
    CHECK(std::memcmp(got.data(), host.data(), host.size()) == 0);
    const std::int64_t row = to[0];
    CHECK(std::isnan(to_float(host[(row * kvh) * d + 3])));
    CHECK(std::isnan(to_float(host[(row * kvh) * d + 4])));
    CHECK(std::abs(to_float(host[(row * kvh) * d + 5])) == 448.0f);
  }
  // A row outside the cache is refused on the host, writing nothing.
  std::vector<fp8_e4m3> small(static_cast<std::size_t>(8) * kvh * d);
  CHECK_THROWS_WITH_AS(quantize_into_cache_host(thd_view<const T>(src.data(), n, kvh, d), to,
                                                thd_view<fp8_e4m3>(small.data(), 8, kvh, d),
                                                head_scales{scales.data(), scales.data()}, true),
                       doctest::Contains("outside the cache's 8"), invalid_argument);
}
