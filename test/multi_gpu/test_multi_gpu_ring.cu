// The device ring with ranks on several GPUs of one process, forward and backward, every
// partitioner x {full, causal} against the float64 oracle, bytes per rank against the plan,
// bitwise repeatability:
// - in-process groups whose ranks spread over the GPUs (rank r on device r % GPUs; peer copies),
//   P = 2, the GPU count and twice it;
// - NCCL with one process driving every GPU (a thread and a communicator per GPU, P = GPU count).
// (One process per GPU under mpirun: test/mpi/test_mpi_nccl.cu, the mpi_nccl CTest tests.)
// With ringattn::cudnn the NCCL cases run on the cuDNN block kernel too.
#include "../support/device_ring.cuh"
#include "per_gpu.cuh"

#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#if defined(RINGATTN_TEST_CUDNN)
#include <ringattn/cudnn.cuh>
#endif

#include <doctest/doctest.h>

#include <cstdlib>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

template <class P>
test::sharded_case<P, T> make_case(int ranks, mask_kind m, std::uint64_t seed) {
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks));
  return test::sharded_case<P, T>(test::random_cu_seqlens(3, 1, small ? 200 : 900, rng), ranks,
                                  {8, 2, 128, 0.0f}, m, rng);
}

template <class P, class Mask>
void check_in_process() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const int devices = test::gpu_count();
  for (int ranks : {2, devices, 2 * devices}) {
    CAPTURE(ranks);
    const auto c = make_case<P>(ranks, Mask::mask, seed);
    test::check_device_ring(c, test::device_ring_in_process<Mask>(c, devices, /*repeat=*/true));
  }
}

template <class P, class Mask>
void check_backward_in_process() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  const int devices = test::gpu_count();
  for (int ranks : {2, devices, 2 * devices}) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks));
    test::sharded_backward_case<P, T> c(test::random_cu_seqlens(3, 1, small ? 120 : 500, rng),
                                        ranks, {8, 2, 128, 0.0f}, Mask::mask, rng);
    test::check_device_backward(
        c, test::device_backward_in_process<Mask>(c, devices, /*repeat=*/true));
  }
}

template <class P, class Mask>
void check_nccl(test::nccl_per_gpu& comms) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const auto c = make_case<P>(comms.size(), Mask::mask, seed);
  std::vector<test::device_rank_run<P, T>> runs(static_cast<std::size_t>(comms.size()));
  for (const auto& e : test::on_gpus(comms.size(), [&](int r) {
         runs[static_cast<std::size_t>(r)] =
             test::device_ring_rank<Mask>(c, r, comms[r], /*repeat=*/true);
       }))
    REQUIRE(test::message(e) == "");
  test::check_device_ring(c, runs);
}

template <class P, class Mask>
void check_nccl_backward(test::nccl_per_gpu& comms) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  std::mt19937_64 rng(seed);
  test::sharded_backward_case<P, T> c(test::random_cu_seqlens(3, 1, small ? 120 : 500, rng),
                                      comms.size(), {8, 2, 128, 0.0f}, Mask::mask, rng);
  std::vector<test::device_backward_run<P, T>> runs(static_cast<std::size_t>(comms.size()));
  for (const auto& e : test::on_gpus(comms.size(), [&](int r) {
         runs[static_cast<std::size_t>(r)] =
             test::device_backward_rank<Mask>(c, r, comms[r], /*repeat=*/true);
       }))
    REQUIRE(test::message(e) == "");
  test::check_device_backward(c, runs);
}
} // namespace

TEST_CASE_TEMPLATE("device ring, in-process ranks spread over the GPUs, equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  check_in_process<P, full>();
  check_in_process<P, causal>();
}

TEST_CASE("device ring over NCCL, one process and one thread per GPU, equals the oracle") {
  test::nccl_per_gpu comms(test::gpu_count());
  check_nccl<contiguous, full>(comms);
  check_nccl<contiguous, causal>(comms);
  check_nccl<round_robin, full>(comms);
  check_nccl<round_robin, causal>(comms);
  check_nccl<zigzag, full>(comms);
  check_nccl<zigzag, causal>(comms);
}

TEST_CASE_TEMPLATE("device ring backward, in-process ranks spread over the GPUs, equals the oracle",
                   P, contiguous, round_robin, zigzag) {
  check_backward_in_process<P, full>();
  check_backward_in_process<P, causal>();
}

TEST_CASE("device ring backward over NCCL, one process and one thread per GPU, equals the oracle") {
  test::nccl_per_gpu comms(test::gpu_count());
  check_nccl_backward<contiguous, full>(comms);
  check_nccl_backward<contiguous, causal>(comms);
  check_nccl_backward<round_robin, full>(comms);
  check_nccl_backward<round_robin, causal>(comms);
  check_nccl_backward<zigzag, full>(comms);
  check_nccl_backward<zigzag, causal>(comms);
}

#if defined(RINGATTN_TEST_CUDNN)
TEST_CASE("cuDNN block kernel over NCCL, one process and one thread per GPU, equals the oracle") {
  test::nccl_per_gpu comms(test::gpu_count());
  check_nccl<contiguous, cudnn_full>(comms);
  check_nccl<round_robin, cudnn_causal>(comms);
  check_nccl<zigzag, cudnn_causal>(comms);
  check_nccl_backward<contiguous, cudnn_full>(comms);
  check_nccl_backward<round_robin, cudnn_causal>(comms);
  check_nccl_backward<zigzag, cudnn_causal>(comms);
}
#endif
