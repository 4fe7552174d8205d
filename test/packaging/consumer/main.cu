// A consumer's .cu: includes the umbrella header, instantiates device code and runs the host path.
#include <ringattn/ringattn.cuh>

#include <cstdio>
#include <vector>

__global__ void positions(ringattn::device_plan_ref plan, int rank, std::int64_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = ringattn::zigzag::position(plan.cu_seqlens[1], plan.ranks, rank, i);
}

int main() {
  const std::vector<std::int32_t> cu = {0, 10};
  ringattn::partition_plan<ringattn::zigzag> plan(cu, 2);
  std::vector<float> x(10 * 64, 1.0f);
  ringattn::thd_view<const float> v(x.data(), 10, 1, 64);
  auto r = ringattn::reference::attention_forward(v, v, v, cu, {1, 1, 64, 0.0f},
                                                  ringattn::mask_kind::causal);
  if (plan.local_tokens(0) != 5 || r.out(9, 0, 0) != 1.0) {
    std::printf("consumer: wrong result\n");
    return 1;
  }
  std::printf("consumer: ok (ringattn %d.%d.%d)\n", ringattn::version.major,
              ringattn::version.minor, ringattn::version.patch);
  return 0;
}
