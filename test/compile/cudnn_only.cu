// A program that runs the ring facade with the cuDNN BlockKernel only: every schedule's device
// forward and backward, and the host path. It includes no native-kernel header (the test
// compile.cudnn_only_includes checks its include list) and compiles as it stands.
#include <ringattn/comm/in_process.cuh>
#include <ringattn/cudnn.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <cuda_bf16.h>

#include <cstddef>
#include <span>

namespace ra = ringattn;
using T = __nv_bfloat16;

template <class Schedule>
void run(ra::ring_attention<ra::zigzag, ra::in_process_communicator, ra::cudnn_causal, Schedule>& a,
         ra::thd_view<const T> q, ra::thd_view<const T> k, ra::thd_view<const T> v,
         ra::thd_view<T> out, float* lse, ra::thd_view<T> dq, ra::thd_view<T> dk,
         ra::thd_view<T> dv, void* ws, std::size_t bytes, std::span<std::byte> host_ws,
         cudaStream_t stream) {
  a.prepare_device();
  a.template forward<T>(q, k, v, out, lse, ws, bytes, stream);
  a.template backward<T>(q, k, v, out, lse, q, dq, dk, dv, ws, bytes, stream);
  a.template forward_host<T>(q, k, v, out, lse, host_ws);
}

template void
run(ra::ring_attention<ra::zigzag, ra::in_process_communicator, ra::cudnn_causal, ra::ring_pass>&,
    ra::thd_view<const T>, ra::thd_view<const T>, ra::thd_view<const T>, ra::thd_view<T>, float*,
    ra::thd_view<T>, ra::thd_view<T>, ra::thd_view<T>, void*, std::size_t, std::span<std::byte>,
    cudaStream_t);
template void run(ra::ring_attention<ra::zigzag, ra::in_process_communicator, ra::cudnn_causal,
                                     ra::all_gather_kv>&,
                  ra::thd_view<const T>, ra::thd_view<const T>, ra::thd_view<const T>,
                  ra::thd_view<T>, float*, ra::thd_view<T>, ra::thd_view<T>, ra::thd_view<T>, void*,
                  std::size_t, std::span<std::byte>, cudaStream_t);
template void run(ra::ring_attention<ra::zigzag, ra::in_process_communicator, ra::cudnn_causal,
                                     ra::all_to_all_heads>&,
                  ra::thd_view<const T>, ra::thd_view<const T>, ra::thd_view<const T>,
                  ra::thd_view<T>, float*, ra::thd_view<T>, ra::thd_view<T>, ra::thd_view<T>, void*,
                  std::size_t, std::span<std::byte>, cudaStream_t);

int main() { return 0; }
