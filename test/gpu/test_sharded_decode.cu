// Attention over a sharded KV cache on the device: P virtual ranks on one GPU (threads of an
// in-process group, each with its own stream), the cache of each partitioner's prefill (packed odd
// lengths), three decode steps with appends (0-4 new tokens per sequence), P in {1, 2, 3, 4, 8} x
// GQA 1, 4, 8, against the float64 oracle; every rank's result bitwise equal to rank 0's and from
// call to call; bytes per rank; a warmed-up step allocates nothing; bad input on one rank fails
// on every rank before anything is enqueued, and the next step runs; steps planned back to back
// (no wait between them) reuse their tables and allocate nothing once warm; caches of thousands
// of tokens with up to 16 new tokens per sequence (many splits, every row-tile count); paged
// caches.
#include "../support/allocation_counter.hpp"
#include "../support/decode_case.hpp"
#include "../support/device_buffer.cuh"
#include "../support/ranks.hpp"

#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/sharded_attention.cuh>

#include <doctest/doctest.h>

#include <barrier>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>

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

// One step on every rank; `repeat`: the forward twice, the second counted (device allocations,
// heap) and compared with the first. `page_size` > 0: each rank's shard in a paged pool
// (test::page_out, pages shuffled by `page_seed`).
template <class P, class E = T>
std::vector<rank_result<E>>
device_step(const test::decode_case<P, E>& c, const typename test::decode_case<P, E>::step& s,
            bool repeat, int page_size = 0, std::uint64_t page_seed = 0) {
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
    std::mt19937_64 page_rng(page_seed + static_cast<std::uint64_t>(r));
    const auto pool =
        page_size ? test::page_out(c, sh, page_size, page_rng) : test::paged_shard<T>{};
    std::int64_t m = sh.tokens();
    if (page_size) {
      dec.plan(s.cu_new,
               paged_cache{page_size, pool.pages, pool.cu_pages, pool.table, pool.length});
      m = pool.pages * page_size;
    } else {
      dec.plan(s.cu_new, sh.cu);
    }
    test::device_buffer<T> q(s.q), k(s.k), v(s.v), kc(page_size ? pool.k : sh.k),
        vc(page_size ? pool.v : sh.v);
    test::device_buffer<T> out(std::vector<T>(n * qh * dv, test::poison<T>()));
    test::device_buffer<float> lse(std::vector<float>(n * qh, -7.0f));
    const std::size_t bytes = dec.device_workspace_bytes<T>();
    test::device_buffer<std::byte> ws(bytes);
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    rank_result<E>& mine = res[r];
    auto once = [&] {
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
