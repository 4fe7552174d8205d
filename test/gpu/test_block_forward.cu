// The CUDA block kernel against the float64 oracle (same matrix as the host kernel's test), the
// merge of split K/V ranges, determinism, the plain-output mode, and validation.
#include "../support/block_case.hpp"
#include "../support/device_buffer.cuh"

#include <ringattn/block/device/forward.cuh>
#include <ringattn/block/device/host_forward.cuh>

#include <doctest/doctest.h>

#include <cstring>
#include <limits>
#include <tuple>

using namespace ringattn;

namespace {
template <class T>
struct device_case {
  const test::block_case<T>& c;
  test::device_buffer<T> q, k, v;
  test::device_buffer<float> o, lse, sum;
  attention_state state;
  explicit device_case(const test::block_case<T>& bc)
      : c(bc), q(bc.q), k(bc.k), v(bc.v),
        o(std::vector<float>(out_elements(bc), -7.0f)), // poisoned: reset must write every element
        lse(std::vector<float>(static_cast<std::size_t>(bc.tokens() * bc.args.q_heads), -7.0f)),
        sum(std::vector<float>(static_cast<std::size_t>(bc.tokens() * bc.args.q_heads), -7.0f)),
        state{o.get(), lse.get(), sum.get(), bc.tokens(), bc.args.q_heads, bc.args.v_dim()} {}
  static std::size_t out_elements(const test::block_case<T>& bc) {
    return static_cast<std::size_t>(bc.tokens() * bc.args.q_heads * bc.args.v_dim());
  }
  block_forward_args<T> args() const {
    const auto& a = c.args;
    return {{q.get(), c.tokens(), a.q_heads, a.head_dim},
            {k.get(), c.tokens(), a.kv_heads, a.head_dim},
            {v.get(), c.tokens(), a.kv_heads, a.v_dim()},
            a,
            state};
  }
  //! Runs every call, finalises into a poisoned output; returns on the host the output, the
  //! state's output in fp32 (o / sum, read in the documented layout: o [q_heads, tokens,
  //! head_dim], sum [q_heads, tokens]) and the lse.
  std::tuple<std::vector<T>, std::vector<float>, std::vector<float>>
  run(const std::vector<std::vector<block_group>>& calls,
      forward_path path = forward_path::automatic, merge_path merge = merge_path::automatic) {
    std::vector<device_block_schedule> schedules;
    for (const auto& g : calls)
      schedules.emplace_back(g, c.tokens(), c.tokens(), c.args,
                             schedule_options{.path = path, .merge = merge});
    reset(state, nullptr);
    for (const auto& s : schedules)
      block_forward(args(), s, nullptr);
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> so = o.download();
    const std::vector<float> ss = sum.download();
    const std::size_t d = static_cast<std::size_t>(c.args.v_dim());
    for (std::size_t i = 0; i < so.size(); ++i)
      so[i] = ss[i / d] > 0.0f ? so[i] / ss[i / d] : so[i];
    test::device_buffer<T> out(std::vector<T>(out_elements(c), test::poison<T>()));
    finalize(state, thd_view<T>(out.get(), c.tokens(), c.args.q_heads, c.args.v_dim()), nullptr);
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
    return {out.download(), so, lse.download()};
  }
};

// Tolerances for the kernel's output against the float64 oracle, relative L2 over all elements:
// the kernel rounds P to the input type before P V and the output once more, so the error is a
// few units of that type's rounding: bf16 (8 bits) 8e-3, fp16 (11 bits) 1.5e-3. LSE is computed
// in fp32 from exact products: 2e-3 absolute.
template <class T>
constexpr double out_tolerance = std::is_same_v<T, __nv_bfloat16> ? 8e-3 : 1.5e-3;
constexpr double lse_tolerance = 2e-3;

// RINGATTN_TEST_SMALL=1 (set for compute-sanitizer runs) shortens sequences and skips GQA 8.
inline bool small_run() { return std::getenv("RINGATTN_TEST_SMALL") != nullptr; }

// The kernels that can run here for a head_dim: mma_sync always, wgmma on Hopper builds/devices.
inline std::vector<forward_path> paths_for(int head_dim) {
  std::vector<forward_path> p{forward_path::mma_sync};
  if (forward_path_available(forward_path::wgmma, head_dim)) p.push_back(forward_path::wgmma);
  return p;
}

template <class T>
void check_against_oracle(std::mt19937_64& rng) {
  for (int group : {1, 4, 8})
    for (int d : {64, 128, 256})
      for (const band& b : test::test_bands(rng))
        for (forward_path path : paths_for(d)) {
          CAPTURE(group);
          CAPTURE(d);
          CAPTURE(b.lo);
          CAPTURE(b.hi);
          CAPTURE(std::string(to_string(path)));
          if (small_run() && group == 8) continue;
          const attention_arguments a{8, 8 / group, d, 0.0f};
          // Odd lengths around the tile sizes (64 keys, 128 query rows).
          test::block_case<T> c(test::random_cu_seqlens(3, 1, small_run() ? 140 : 300, rng), a, b,
                                rng);
          const auto ref = c.oracle();
          device_case<T> dc(c);
          auto [out, o, lse] = dc.run(c.calls(1), path);
          thd_view<const T> ov(out.data(), c.tokens(), a.q_heads, d);
          const double eo =
              test::out_error(ref, [&](auto t, int h, int e) { return to_float(ov(t, h, e)); });
          const double el = test::lse_error(ref, [&](auto t, int h) {
            return lse[static_cast<std::size_t>(h * c.tokens() + t)];
          });
          // The fp32 state's own output (o / sum).
          const std::int64_t n = c.tokens();
          const double es = test::out_error(ref, [&](auto t, int h, int e) {
            return o[static_cast<std::size_t>((h * n + t) * d + e)];
          });
          MESSAGE("path " << std::string(to_string(path)) << " d=" << d << " group=" << group
                          << " band=[" << b.lo << "," << b.hi << "] out err " << eo << " state err "
                          << es << " lse err " << el);
          CHECK(eo < out_tolerance<T>);
          CHECK(es < out_tolerance<T>);
          CHECK(el < lse_tolerance);
        }
}
} // namespace

TEST_CASE_TEMPLATE(
    "CUDA block forward equals the oracle: bands x GQA x head_dim x packed odd lengths", T,
    __nv_bfloat16, __half) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  check_against_oracle<T>(rng);
}

TEST_CASE(
    "CUDA block forward: split K/V ranges merge to the single-block result; bitwise repeatable") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  // Short sequences (a piece is 1-3 K/V tiles of 128 keys), and long ones: in two or three
  // pieces each spans 4 or more tiles at head_dim 128, 6 or more at 64, so that the merge's old
  // state is staged while K/V tiles are still in flight (at head_dim 128 in two halves, one per
  // consumer warpgroup). The long sequences end in a row tile of fewer than 64 rows and one of
  // more, so both halves meet missing rows.
  struct shape {
    int head_dim;
    int tiles; // the long sequences' whole row tiles; 0: short sequences
  };
  const bool small = small_run();
  for (const shape sh : {shape{128, 0}, shape{128, small ? 8 : 12}, shape{64, small ? 8 : 20}}) {
    CAPTURE(sh.head_dim);
    CAPTURE(sh.tiles);
    std::vector<std::int32_t> cu = test::random_cu_seqlens(2, 200, 700, rng);
    if (sh.tiles > 0) {
      std::uniform_int_distribution<int> few(1, 63), many(65, 127), extra(0, 3);
      cu = {0, 128 * (sh.tiles + extra(rng)) + few(rng)};
      cu.push_back(cu.back() + 128 * (sh.tiles + extra(rng)) + many(rng));
    }
    CAPTURE(cu[1]);
    CAPTURE(cu[2]);
    const attention_arguments a{8, 2, sh.head_dim, 0.0f};
    test::block_case<__nv_bfloat16> c(cu, a, band{-unbounded, 0}, rng);
    device_case<__nv_bfloat16> dc(c);
    auto [out1, o1, lse1] = dc.run(c.calls(1));
    auto [out1b, o1b, lse1b] = dc.run(c.calls(1));
    CHECK(std::memcmp(o1.data(), o1b.data(), o1.size() * sizeof(float)) == 0); // deterministic
    CHECK(std::memcmp(lse1.data(), lse1b.data(), lse1.size() * sizeof(float)) == 0);
    for (int pieces : {2, 3, 8})
      for (bool together : {false, true}) {
        CAPTURE(pieces);
        CAPTURE(together);
        auto [out, o, lse] = dc.run(c.calls(pieces, together));
        // Each block's softmax is computed with bf16 P, so splitting changes the rounding of P:
        // within the kernel's own error, not fp32 rounding.
        CHECK(reference::relative_error(std::vector<double>(o.begin(), o.end()),
                                        std::vector<double>(o1.begin(), o1.end())) < 5e-3);
        double worst = 0.0;
        for (std::size_t i = 0; i < lse.size(); ++i)
          worst = std::max(worst, double(std::abs(lse[i] - lse1[i])));
        CHECK(worst < 1e-4);
      }
  }
}

TEST_CASE("CUDA block forward, plain output: the same values as the merged path") {
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{4, 4, 64, 0.0f};
  test::block_case<__half> c(test::random_cu_seqlens(2, 100, 300, rng), a, band{-unbounded, 0},
                             rng);
  device_case<__half> dc(c);
  auto [out, o, lse] = dc.run(c.calls(1));
  device_block_schedule s(c.calls(1)[0], c.tokens(), c.tokens(), a.head_dim);
  test::device_buffer<__half> plain(std::vector<__half>(c.q.size(), test::poison<__half>()));
  test::device_buffer<float> plse(std::vector<float>(lse.size(), -7.0f));
  block_forward_plain(dc.args(), s, thd_view<__half>(plain.get(), c.tokens(), 4, 64), plse.get(),
                      nullptr);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto p = plain.download();
  const auto pl = plse.download();
  // Merging one block into an empty state takes it as it is (o * 0 + o_b, sum 1): identical
  // values.
  CHECK(std::memcmp(p.data(), out.data(), p.size() * sizeof(__half)) == 0);
  CHECK(std::memcmp(pl.data(), lse.data(), pl.size() * sizeof(float)) == 0);
}

// The ring's first and last steps (block_forward_first: no reset, the state is never read;
// block_forward_last: the merged output in T, no finalise) give the same bits as reset, merges and
// finalise, on every kernel, for K/V split into 2 and 3 calls; the state before the first call is
// NaN, so a read of it would show.
template <class T>
void check_first_and_last(std::mt19937_64& rng) {
  for (int d : {64, 128})
    for (const band& b : {band{}, band{-unbounded, 0}, band{-37, 5}})
      for (forward_path path : paths_for(d))
        for (int pieces : {2, 3}) {
          CAPTURE(d);
          CAPTURE(b.lo);
          CAPTURE(b.hi);
          CAPTURE(std::string(to_string(path)));
          CAPTURE(pieces);
          const attention_arguments a{8, 2, d, 0.0f};
          test::block_case<T> c(test::random_cu_seqlens(3, 1, small_run() ? 140 : 300, rng), a, b,
                                rng);
          device_case<T> dc(c);
          const auto calls = c.calls(pieces);
          auto [want, o, want_lse] = dc.run(calls, path);
          std::vector<device_block_schedule> sched;
          for (const auto& g : calls) {
            REQUIRE(rows_of(g) == c.tokens()); // what makes the first and last calls valid
            sched.emplace_back(g, c.tokens(), c.tokens(), d, schedule_options{path});
          }
          const float nan = std::numeric_limits<float>::quiet_NaN();
          dc.o.upload(std::vector<float>(dc.o.size(), nan));
          dc.lse.upload(std::vector<float>(dc.lse.size(), nan));
          dc.sum.upload(std::vector<float>(dc.sum.size(), nan));
          test::device_buffer<T> out(std::vector<T>(c.q.size(), test::poison<T>()));
          block_forward_first(dc.args(), sched.front(), nullptr);
          for (std::size_t i = 1; i + 1 < sched.size(); ++i)
            block_forward(dc.args(), sched[i], nullptr);
          block_forward_last(dc.args(), sched.back(),
                             thd_view<T>(out.get(), c.tokens(), a.q_heads, d), nullptr);
          RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
          const auto got = out.download();
          const auto got_lse = dc.lse.download();
          CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0);
          CHECK(std::memcmp(got_lse.data(), want_lse.data(), got_lse.size() * sizeof(float)) == 0);
        }
}

TEST_CASE_TEMPLATE("CUDA block forward: the first call overwrites, the last writes the output", T,
                   __nv_bfloat16, __half) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  check_first_and_last<T>(rng);
}

TEST_CASE("CUDA block forward: which kernel a schedule picks") {
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{4, 2, 128, 0.0f};
  test::block_case<__nv_bfloat16> c({0, 130}, a, band{}, rng);
  const auto groups = c.calls(1)[0];
  int device = 0, major = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  device_block_schedule aut(groups, 130, 130, 128);
  CHECK(aut.path() != forward_path::automatic);
#if defined(RINGATTN_TEST_BUILT_FOR_SM90A)
  if (major == 9) CHECK(aut.path() == forward_path::wgmma);
#endif
  CHECK(device_block_schedule(groups, 130, 130, 128, {forward_path::mma_sync}).path() ==
        forward_path::mma_sync);
  // head_dim 256 has no wgmma kernel: automatic falls back, an explicit request is refused.
  CHECK(device_block_schedule(groups, 130, 130, 256).path() == forward_path::mma_sync);
  CHECK_THROWS_WITH_AS(device_block_schedule(groups, 130, 130, 256, {forward_path::wgmma}),
                       "ringattn: the wgmma block kernel takes head_dim 64 or 128, or 192 with "
                       "head_dim_v 128 (got head_dim 256)",
                       invalid_argument);
  // Q/K 192 with V 128 runs on the wgmma kernel only; 192 with v as wide on no native kernel.
  const attention_arguments mla{.q_heads = 4, .kv_heads = 2, .head_dim = 192, .head_dim_v = 128};
  CHECK_THROWS_WITH_AS(device_block_schedule(groups, 130, 130, mla, {forward_path::mma_sync}),
                       "ringattn: the mma_sync block kernel takes head_dim 64, 128 or 256 with v "
                       "as wide (got head_dim 192 with head_dim_v 128)",
                       invalid_argument);
  if (forward_path_available(forward_path::wgmma, 192, 128))
    CHECK(device_block_schedule(groups, 130, 130, mla).path() == forward_path::wgmma);
  else
    CHECK_THROWS_AS(device_block_schedule(groups, 130, 130, mla), invalid_argument);
  CHECK_THROWS_WITH_AS(device_block_schedule(groups, 130, 130, 192),
                       "ringattn: head_dim 192 has no native CUDA block kernel; the host kernels "
                       "take any widths and the cuDNN model those cuDNN supports",
                       invalid_argument);
  if (!forward_path_available(forward_path::wgmma, 128))
    CHECK_THROWS_AS(device_block_schedule(groups, 130, 130, 128, {forward_path::wgmma}),
                    invalid_argument);
  // How merges add to the state: through the L2 for banded blocks at head_dim 128 on wgmma,
  // else by rewriting; the mma_sync kernel always rewrites.
  test::block_case<__nv_bfloat16> causal({0, 130}, a, band{-unbounded, 0}, rng);
  const auto banded = causal.calls(1)[0];
  const bool hopper = forward_path_available(forward_path::wgmma, 128);
  CHECK(device_block_schedule(banded, 130, 130, 128).merge() ==
        (hopper ? merge_path::reduce : merge_path::rewrite));
  CHECK(device_block_schedule(groups, 130, 130, 128).merge() == merge_path::rewrite);
  CHECK(device_block_schedule(banded, 130, 130, 128, {forward_path::mma_sync}).merge() ==
        merge_path::rewrite);
  if (hopper) {
    CHECK(device_block_schedule(banded, 130, 130, 64).merge() == merge_path::rewrite);
    CHECK(device_block_schedule(groups, 130, 130, 128,
                                {.path = forward_path::wgmma, .merge = merge_path::reduce})
              .merge() == merge_path::reduce);
    CHECK(device_block_schedule(banded, 130, 130, 128,
                                {.path = forward_path::wgmma, .merge = merge_path::rewrite})
              .merge() == merge_path::rewrite);
  }
}

// The Hopper kernel's two ways of merging (merge_path): reading and rewriting the rows, or adding
// them through the L2. Both round every element as o + (o_b * weight), so they agree to the last
// bit but for subnormal values (the L2's addition flushes them); checked to 1e-6 here, the
// differing elements counted. Split K/V (the first call, into a reset state, moves every row's
// reference: the reduce kernel rewrites those) and both head_dims.
TEST_CASE("CUDA block forward: merging through the L2 equals reading and rewriting") {
  if (!forward_path_available(forward_path::wgmma, 128)) {
    MESSAGE("no wgmma kernel here: nothing to compare");
    return;
  }
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int d : {64, 128, 192})
    for (const band& b : {band{}, band{-unbounded, 0}, band{-37, 5}})
      for (int pieces : {1, 2, 3}) {
        CAPTURE(d);
        CAPTURE(b.lo);
        CAPTURE(b.hi);
        CAPTURE(pieces);
        // 192: Q/K 192 wide, V and the output 128 (multi-head latent attention).
        const attention_arguments a{
            .q_heads = 8, .kv_heads = 2, .head_dim = d, .head_dim_v = d == 192 ? 128 : 0};
        test::block_case<__nv_bfloat16> c(
            test::random_cu_seqlens(3, 1, small_run() ? 200 : 500, rng), a, b, rng);
        device_case<__nv_bfloat16> dc(c);
        auto [out_w, o_w, lse_w] =
            dc.run(c.calls(pieces), forward_path::wgmma, merge_path::rewrite);
        auto [out_r, o_r, lse_r] = dc.run(c.calls(pieces), forward_path::wgmma, merge_path::reduce);
        std::size_t differ = 0;
        for (std::size_t i = 0; i < o_w.size(); ++i)
          differ += std::memcmp(&o_w[i], &o_r[i], sizeof(float)) != 0;
        MESSAGE("d=" << d << " band=[" << b.lo << "," << b.hi << "] pieces=" << pieces << ": "
                     << differ << " of " << o_w.size() << " fp32 elements differ");
        CHECK(reference::relative_error(std::vector<double>(o_r.begin(), o_r.end()),
                                        std::vector<double>(o_w.begin(), o_w.end())) < 1e-6);
        double worst = 0.0;
        for (std::size_t i = 0; i < lse_w.size(); ++i)
          worst = std::max(worst, std::isinf(lse_w[i]) && lse_w[i] == lse_r[i]
                                      ? 0.0
                                      : double(std::abs(lse_w[i] - lse_r[i])));
        CHECK(worst < 1e-5);
        const auto ref = c.oracle();
        thd_view<const __nv_bfloat16> ov(out_r.data(), c.tokens(), a.q_heads, a.v_dim());
        CHECK(test::out_error(ref, [&](auto t, int h, int e) { return to_float(ov(t, h, e)); }) <
              out_tolerance<__nv_bfloat16>);
      }
}

// Blocks whose lse differ by far more than `rescale_above` (a softmax scale of 20: scores in the
// hundreds), so that rows move their reference, up and down, in every call: against the oracle,
// on every kernel and both merge paths.
TEST_CASE("CUDA block forward: rows whose reference moves equal the oracle") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int d : {64, 128})
    for (forward_path path : paths_for(d))
      for (merge_path how : {merge_path::rewrite, merge_path::reduce}) {
        if (path == forward_path::mma_sync && how == merge_path::reduce) continue;
        CAPTURE(d);
        CAPTURE(std::string(to_string(path)));
        CAPTURE(std::string(to_string(how)));
        const attention_arguments a{4, 2, d, 20.0f};
        test::block_case<__nv_bfloat16> c(test::random_cu_seqlens(2, 100, 400, rng), a,
                                          band{-unbounded, 0}, rng);
        device_case<__nv_bfloat16> dc(c);
        auto [out, o, lse] = dc.run(c.calls(4), path, how);
        const auto ref = c.oracle();
        thd_view<const __nv_bfloat16> ov(out.data(), c.tokens(), a.q_heads, d);
        const double eo =
            test::out_error(ref, [&](auto t, int h, int e) { return to_float(ov(t, h, e)); });
        const double el = test::lse_error(
            ref, [&](auto t, int h) { return lse[static_cast<std::size_t>(h * c.tokens() + t)]; });
        MESSAGE("path " << std::string(to_string(path)) << ", merge " << std::string(to_string(how))
                        << ", d=" << d << ": out err " << eo << " lse err " << el);
        CHECK(eo < out_tolerance<__nv_bfloat16>);
        CHECK(el < lse_tolerance);
      }
}

// Numerics (docs/reliability.md): rows that see no key finish as O = 0, LSE = -inf; huge logits
// (inputs scaled to |x| <= 256 and a softmax scale of 1000: scores near 1e10) stay finite through
// the running maximum, and O stays a convex combination of V rows (|O| <= max |V|). Both kernels.
TEST_CASE(
    "CUDA block forward: rows with no key, huge logits: finite, O = 0 / LSE = -inf, never NaN") {
  std::mt19937_64 rng(test::fresh_seed());
  for (forward_path path : paths_for(128)) {
    CAPTURE(std::string(to_string(path)));
    // Keys strictly after the query (1 <= j - i <= 7): the last row of each sequence sees nothing.
    test::block_case<__nv_bfloat16> c({0, 5, 140}, {4, 2, 128, 0.0f}, band{1, 7}, rng);
    device_case<__nv_bfloat16> dc(c);
    auto [out, o, lse] = dc.run(c.calls(2), path);
    for (int h = 0; h < 4; ++h)
      for (std::int64_t t : {4, 139}) {
        const float l = lse[static_cast<std::size_t>(h * c.tokens() + t)];
        CHECK((std::isinf(l) && l < 0));
        for (int e = 0; e < 128; ++e)
          CHECK(to_float(out[static_cast<std::size_t>((t * 4 + h) * 128 + e)]) == 0.0f);
      }
    for (const auto& x : out)
      CHECK(std::isfinite(to_float(x)));

    test::block_case<__nv_bfloat16> big({0, 77, 300}, {4, 2, 128, 1000.0f}, band{}, rng);
    for (auto* buf : {&big.q, &big.k})
      for (auto& x : *buf)
        x = __nv_bfloat16(to_float(x) * 256.0f);
    float vmax = 0.0f;
    for (const auto& x : big.v)
      vmax = std::max(vmax, std::abs(to_float(x)));
    device_case<__nv_bfloat16> db(big);
    auto [bout, bo, blse] = db.run(big.calls(3), path);
    bool finite = true, bounded = true;
    for (const auto& x : bout) {
      finite = finite && std::isfinite(to_float(x));
      bounded = bounded && std::abs(to_float(x)) <= vmax * (1.0f + 1.0f / 128);
    }
    for (float x : blse)
      finite = finite && std::isfinite(x);
    CHECK(finite);
    CHECK(bounded);
  }
}

TEST_CASE("CUDA block forward rejects bad input before launching anything") {
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{4, 2, 64, 0.0f};
  test::block_case<__nv_bfloat16> c({0, 130}, a, band{}, rng);
  device_case<__nv_bfloat16> dc(c);
  device_block_schedule s(c.calls(1)[0], c.tokens(), c.tokens(), a.head_dim);
  reset(dc.state, nullptr);
  auto args = dc.args();
  args.q.data = args.q.data + 1; // misaligned
  CHECK_THROWS_WITH_AS(block_forward(args, s, nullptr),
                       "ringattn: q, k and v must be 16-byte aligned with token and head strides "
                       "that are multiples of 8 elements",
                       invalid_argument);
  args = dc.args();
  args.k.data = nullptr;
  CHECK_THROWS_WITH_AS(block_forward(args, s, nullptr),
                       "ringattn: k is a null pointer with 130 tokens", invalid_argument);
  args = dc.args();
  args.args.head_dim = 128;
  CHECK_THROWS_AS(block_forward(args, s, nullptr), invalid_argument);
  device_block_schedule other(c.calls(1)[0], c.tokens(), c.tokens(), 128);
  CHECK_THROWS_WITH_AS(block_forward(dc.args(), other, nullptr),
                       "ringattn: the schedule was made for 130 query and 130 key tokens, head_dim "
                       "128, head_dim_v 128; the call has 130, 130, 64, 64",
                       invalid_argument);
  auto bad = c.calls(1)[0];
  bad[0].q_count = 131;
  CHECK_THROWS_AS(device_block_schedule(bad, 130, 130, 64), invalid_argument);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto lse = dc.lse.download();
  CHECK(std::all_of(lse.begin(), lse.end(), [](float x) { return std::isinf(x) && x < 0; }));
}

#include "../support/sharded_case.hpp"

#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

// Partitioner -> plan blocks -> schedules -> CUDA kernel over every source rank in ring order,
// finalised and compared with the oracle on the gathered batch (tolerances as above).
TEST_CASE_TEMPLATE("CUDA: every rank's shard against every rank's K/V equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int ranks : {1, 3, 8})
    for (mask_kind m : {mask_kind::full, mask_kind::causal}) {
      CAPTURE(ranks);
      CAPTURE(std::string(to_string(m)));
      const attention_arguments a{8, 2, 128, 0.0f};
      test::sharded_case<P, __nv_bfloat16> c(
          test::random_cu_seqlens(3, 1, small_run() ? 200 : 900, rng), ranks, a, m, rng);
      const auto ref = c.oracle();
      std::vector<double> got(ref.out.data.size(), 0.0), want(ref.out.data.size(), 0.0);
      double worst_l = 0.0;
      for (int r = 0; r < ranks; ++r) {
        const std::int64_t n = c.plan.local_tokens(r);
        test::device_buffer<__nv_bfloat16> q(c.qs[r]);
        test::device_buffer<float> o(static_cast<std::size_t>(n * a.q_heads * a.head_dim));
        test::device_buffer<float> lse(static_cast<std::size_t>(n * a.q_heads));
        test::device_buffer<float> sum(static_cast<std::size_t>(n * a.q_heads));
        const attention_state st{o.get(), lse.get(), sum.get(), n, a.q_heads, a.head_dim};
        reset(st, nullptr);
        for (int step = 0; step < ranks; ++step) {
          const int src = (r - step + ranks) % ranks;
          const std::int64_t nk = c.plan.local_tokens(src);
          test::device_buffer<__nv_bfloat16> k(c.ks[src]), v(c.vs[src]);
          device_block_schedule sched(c.groups(r, src), n, nk, a.head_dim);
          block_forward<__nv_bfloat16>({{q.get(), n, a.q_heads, a.head_dim},
                                        {k.get(), nk, a.kv_heads, a.head_dim},
                                        {v.get(), nk, a.kv_heads, a.head_dim},
                                        a,
                                        st},
                                       sched, nullptr);
          RINGATTN_CUDA_CHECK(cudaDeviceSynchronize()); // k, v die at the end of the step
        }
        test::device_buffer<__nv_bfloat16> out(
            std::vector<__nv_bfloat16>(c.qs[r].size(), test::poison<__nv_bfloat16>()));
        finalize(st, thd_view<__nv_bfloat16>(out.get(), n, a.q_heads, a.head_dim), nullptr);
        const auto ho = out.download();
        const auto hl = lse.download();
        for (std::int64_t l = 0; l < n; ++l) {
          const std::int64_t g = c.plan.global_token(r, l);
          for (int h = 0; h < a.q_heads; ++h) {
            worst_l = std::max(worst_l, std::abs(double(hl[static_cast<std::size_t>(h * n + l)]) -
                                                 ref.lse_at(h, g)));
            for (int e = 0; e < a.head_dim; ++e) {
              const auto i = static_cast<std::size_t>((g * a.q_heads + h) * a.head_dim + e);
              got[i] = to_float(ho[static_cast<std::size_t>((l * a.q_heads + h) * a.head_dim + e)]);
              want[i] = ref.out.data[i];
            }
          }
        }
      }
      CHECK(reference::relative_error(got, want) < out_tolerance<__nv_bfloat16>);
      CHECK(worst_l < lse_tolerance);
    }
}
