// 04_training_step: forward and backward of zigzag causal ring attention, gradients checked.
//
// One training step's attention on P simulated ranks (threads of an in-process group): every
// rank holds its zigzag shard of Q, K, V; the forward gives O and LSE; a loss
// L = 1/2 |O - target|^2 gives dO = O - target on each rank's own rows; the backward gives dQ,
// dK, dV for the rank's shard (K/V blocks travel the ring again with their fp32 dK/dV, which
// return to their owners at the end). Where there is a GPU (and nvcc compiled the example) the
// ranks run the device path, all on one GPU or spread over several; --device cpu forces the host
// path. The gathered gradients are checked against the float64 oracle's backward, and one entry
// of dQ against a central finite difference of the float64 loss.
//
//   training_step [--ranks P] [--tokens N] [--device auto|cpu|gpu]
#include <ringattn/comm/in_process.cuh>
#include <ringattn/ring_attention.cuh>
#include <ringattn/ringattn.cuh>

#if defined(RINGATTN_EXAMPLE_CUDNN)
#include <ringattn/cudnn.cuh>
#endif

#include "../common/example.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {
using T = __nv_bfloat16;
using partitioner = ringattn::zigzag;
using mask = ringattn::causal;
template <class Kernel>
using ring_of = ringattn::ring_attention<partitioner, ringattn::in_process_communicator, Kernel>;
constexpr ringattn::attention_arguments args{8, 2, 64, 0.0f};

struct batch {
  std::vector<std::int32_t> cu;
  std::vector<T> q, k, v, target;
  std::int64_t tokens() const { return cu.back(); }
  ringattn::thd_view<const T> view(const std::vector<T>& x, int heads) const {
    return {x.data(), tokens(), heads, args.head_dim};
  }
};

// The float64 loss 1/2 |O - target|^2 of the whole batch, for the finite differences.
double loss(const batch& b, const std::vector<T>& q, const ringattn::reference::tensor& k,
            const ringattn::reference::tensor& v) {
  const auto o = ringattn::reference::attention_forward(
      ringattn::reference::to_tensor(b.view(q, args.q_heads)), k, v, b.cu, args, mask::mask);
  double s = 0.0;
  for (std::size_t i = 0; i < o.out.data.size(); ++i) {
    const double e = o.out.data[i] - ringattn::to_float(b.target[i]);
    s += 0.5 * e * e;
  }
  return s;
}

// dL/dO = O - target, rounded to T.
std::vector<T> loss_gradient(const std::vector<T>& out, const std::vector<T>& target) {
  std::vector<T> dout(out.size());
  for (std::size_t i = 0; i < out.size(); ++i)
    dout[i] = ringattn::from_float<T>(ringattn::to_float(out[i]) - ringattn::to_float(target[i]));
  return dout;
}

// One rank's step on the host: forward, dO, backward into gq, gk, gv.
template <class Ring>
void step_on_host(Ring& attn, const std::vector<T>& q, const std::vector<T>& k,
                  const std::vector<T>& v, const std::vector<T>& target, std::vector<T>& gq,
                  std::vector<T>& gk, std::vector<T>& gv) {
  const std::int64_t n = attn.local_tokens();
  const int d = args.head_dim, qh = args.q_heads, kvh = args.kv_heads;
  auto view = [&](auto& x, int heads) {
    using E = std::remove_reference_t<decltype(x[0])>;
    return ringattn::thd_view<E>(x.data(), n, heads, d);
  };
  auto aligned = [](std::vector<std::byte>& w, std::size_t bytes) {
    const std::size_t pad = (16 - reinterpret_cast<std::uintptr_t>(w.data()) % 16) % 16;
    return std::span<std::byte>(w).subspan(pad, bytes);
  };
  std::vector<T> out(q.size());
  std::vector<float> lse(static_cast<std::size_t>(n * qh));
  std::vector<std::byte> ws(attn.template host_workspace_bytes<T>() + 16);
  attn.forward_host(view(q, qh), view(k, kvh), view(v, kvh), view(out, qh), lse.data(),
                    aligned(ws, attn.template host_workspace_bytes<T>()));
  const std::vector<T> dout = loss_gradient(out, target);
  const std::vector<T>& cout = out;
  std::vector<std::byte> wb(attn.template host_backward_workspace_bytes<T>() + 16);
  attn.backward_host(view(q, qh), view(k, kvh), view(v, kvh), view(cout, qh), lse.data(),
                     view(dout, qh), view(gq, qh), view(gk, kvh), view(gv, kvh),
                     aligned(wb, attn.template host_backward_workspace_bytes<T>()));
}

#if defined(__CUDACC__)
// One rank's step on the current GPU: shards to device memory, the device forward, dO on the
// host (a training framework computes its loss gradient on the device), the device backward,
// gradients back to the host. Everything is asynchronous on one stream.
template <class Ring>
void step_on_gpu(Ring& attn, const std::vector<T>& q, const std::vector<T>& k,
                 const std::vector<T>& v, const std::vector<T>& target, std::vector<T>& gq,
                 std::vector<T>& gk, std::vector<T>& gv) {
  const std::int64_t n = attn.local_tokens();
  const int d = args.head_dim, qh = args.q_heads, kvh = args.kv_heads;
  attn.prepare_device();
  std::vector<std::unique_ptr<void, decltype(&cudaFree)>> owned;
  auto alloc = [&](std::size_t bytes) {
    void* p = nullptr;
    RINGATTN_CUDA_CHECK(cudaMalloc(&p, bytes + 16));
    owned.emplace_back(p, &cudaFree);
    return p;
  };
  auto upload = [&](const std::vector<T>& h) {
    T* p = static_cast<T*>(alloc(sizeof(T) * h.size()));
    RINGATTN_CUDA_CHECK(cudaMemcpy(p, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
    return p;
  };
  auto download = [](std::vector<T>& h, const T* p) {
    RINGATTN_CUDA_CHECK(cudaMemcpy(h.data(), p, sizeof(T) * h.size(), cudaMemcpyDeviceToHost));
  };
  auto view = [&](T* p, int heads) { return ringattn::thd_view<T>(p, n, heads, d); };
  auto in = [&](const T* p, int heads) { return ringattn::thd_view<const T>(p, n, heads, d); };
  T *q_d = upload(q), *k_d = upload(k), *v_d = upload(v);
  T* out_d = static_cast<T*>(alloc(sizeof(T) * q.size()));
  float* lse = static_cast<float*>(alloc(sizeof(float) * static_cast<std::size_t>(n * qh)));
  // One workspace serves both calls.
  const std::size_t ws_bytes = std::max(attn.template device_workspace_bytes<T>(),
                                        attn.template device_backward_workspace_bytes<T>());
  void* ws = alloc(ws_bytes);
  cudaStream_t stream = nullptr;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::unique_ptr<CUstream_st, decltype(&cudaStreamDestroy)> stream_owner(stream,
                                                                          &cudaStreamDestroy);
  attn.forward(in(q_d, qh), in(k_d, kvh), in(v_d, kvh), view(out_d, qh), lse, ws, ws_bytes, stream);
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<T> o(q.size());
  download(o, out_d);
  T* dout_d = upload(loss_gradient(o, target));
  T *dq_d = static_cast<T*>(alloc(sizeof(T) * q.size())),
    *dk_d = static_cast<T*>(alloc(sizeof(T) * k.size())),
    *dv_d = static_cast<T*>(alloc(sizeof(T) * v.size()));
  attn.backward(in(q_d, qh), in(k_d, kvh), in(v_d, kvh), in(out_d, qh), lse, in(dout_d, qh),
                view(dq_d, qh), view(dk_d, kvh), view(dv_d, kvh), ws, ws_bytes, stream);
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  download(gq, dq_d);
  download(gk, dk_d);
  download(gv, dv_d);
}
#endif

} // namespace

int main(int argc, char** argv) try {
  int ranks = 4, tokens = 2000;
  std::string device = "auto", kernel = "native";
  example::flags("training_step",
                 "One training step over the ring: forward, a loss, backward; the gradients "
                 "against the float64 reference.")
      .add("ranks", ranks, "ranks (threads of this process)")
      .add("tokens", tokens, "tokens of the packed batch (two sequences)", 2)
      .add("device", device, {"auto", "cpu", "gpu"}, "auto: the GPU where there is one")
      .add("kernel", kernel, {"native", "cudnn"},
           "the block kernel of the device path: the native kernels or cuDNN's fused attention")
      .parse(argc, argv);
  const int gpus = example::gpu_count(device);
#if !defined(RINGATTN_EXAMPLE_CUDNN)
  if (kernel == "cudnn")
    throw ringattn::error("--kernel cudnn: this build has no ringattn::cudnn (cuDNN 9 and "
                          "cudnn-frontend)");
#endif
  // Two packed sequences of odd lengths.
  batch b;
  b.cu = {0, static_cast<std::int32_t>(tokens * 2 / 3 + 1), static_cast<std::int32_t>(tokens)};
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto random = [&](std::int64_t n) {
    std::vector<T> x(static_cast<std::size_t>(n));
    for (auto& e : x)
      e = ringattn::from_float<T>(u(rng));
    return x;
  };
  const int d = args.head_dim, qh = args.q_heads, kvh = args.kv_heads;
  b.q = random(tokens * qh * d);
  b.k = random(tokens * kvh * d);
  b.v = random(tokens * kvh * d);
  b.target = random(tokens * qh * d);
  const ringattn::partition_plan<partitioner> plan(b.cu, ranks);

  // Gathered gradients, poisoned: a row no rank writes fails the check.
  std::vector<T> dq(b.q.size(), ringattn::from_float<T>(-12345.0f)), dk(b.k.size(), dq[0]),
      dv(b.v.size(), dq[0]);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  ringattn::in_process_group group(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = group.communicator(r);
        const std::int64_t n = plan.local_tokens(r);
        auto shard = [&](const std::vector<T>& full, int heads) {
          std::vector<T> s(static_cast<std::size_t>(n * heads * d));
          ringattn::scatter(plan, r, b.view(full, heads),
                            ringattn::thd_view<T>(s.data(), n, heads, d));
          return s;
        };
        const auto qs = shard(b.q, qh), ks = shard(b.k, kvh), vs = shard(b.v, kvh),
                   target = shard(b.target, qh);
        std::vector<T> gq(qs.size()), gk(ks.size()), gv(vs.size());
        auto step = [&](auto kernel_type) {
          ring_of<typename decltype(kernel_type)::type> attn(comm, args, b.cu);
          if (gpus > 0) {
#if defined(__CUDACC__)
            RINGATTN_CUDA_CHECK(cudaSetDevice(r % gpus)); // P virtual ranks per GPU
            step_on_gpu(attn, qs, ks, vs, target, gq, gk, gv);
#endif
          } else {
            step_on_host(attn, qs, ks, vs, target, gq, gk, gv);
          }
        };
#if defined(RINGATTN_EXAMPLE_CUDNN)
        if (kernel == "cudnn")
          step(std::type_identity<ringattn::cudnn_kernel<ringattn::causal_mask, T>>{});
        else
#endif
          step(std::type_identity<mask>{});
        // Gather: each rank writes its rows back to their places in the batch.
        for (std::int64_t l = 0; l < n; ++l) {
          const std::int64_t g = plan.global_token(r, l);
          std::copy_n(gq.begin() + l * qh * d, qh * d, dq.begin() + g * qh * d);
          std::copy_n(gk.begin() + l * kvh * d, kvh * d, dk.begin() + g * kvh * d);
          std::copy_n(gv.begin() + l * kvh * d, kvh * d, dv.begin() + g * kvh * d);
        }
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads)
    t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);

  // The oracle: its own forward's output gives dO (unrounded), then its backward.
  const auto kt = ringattn::reference::to_tensor(b.view(b.k, kvh)),
             vt = ringattn::reference::to_tensor(b.view(b.v, kvh)),
             qt = ringattn::reference::to_tensor(b.view(b.q, qh));
  const auto fwd = ringattn::reference::attention_forward(qt, kt, vt, b.cu, args, mask::mask);
  ringattn::reference::tensor dout(tokens, qh, d);
  for (std::size_t i = 0; i < dout.data.size(); ++i)
    dout.data[i] = fwd.out.data[i] - ringattn::to_float(b.target[i]);
  const auto ref =
      ringattn::reference::attention_backward(qt, kt, vt, dout, b.cu, args, mask::mask);
  auto error = [](const std::vector<T>& got, const ringattn::reference::tensor& want) {
    std::vector<double> g(got.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      g[i] = ringattn::to_float(got[i]);
    return ringattn::reference::relative_error(g, want.data);
  };
  const double eq = error(dq, ref.dq), ek = error(dk, ref.dk), ev = error(dv, ref.dv);

  // One entry of dQ against a central difference of the float64 loss in that entry of Q.
  const std::size_t at = static_cast<std::size_t>((tokens / 2 * qh + 1) * d + 3);
  const double h = 1.0 / 64; // exact in bf16 around values in [-1, 1]
  std::vector<T> qp = b.q, qm = b.q;
  qp[at] = ringattn::from_float<T>(ringattn::to_float(b.q[at]) + static_cast<float>(h));
  qm[at] = ringattn::from_float<T>(ringattn::to_float(b.q[at]) - static_cast<float>(h));
  const double step = ringattn::to_float(qp[at]) - ringattn::to_float(qm[at]);
  const double fd = (loss(b, qp, kt, vt) - loss(b, qm, kt, vt)) / step;

  std::printf("training step: %s, %s mask, %s kernel, %d ranks (%s), %lld tokens in 2 "
              "sequences, %d:%d heads x %d\n",
              partitioner::name, mask::name, gpus > 0 ? kernel.c_str() : "host", ranks,
              gpus > 0 ? (gpus == 1 ? "on 1 GPU" : "over the GPUs") : "host path",
              static_cast<long long>(tokens), qh, kvh, d);
  std::printf("  gradients against the float64 oracle's backward (relative L2): dq %.2e, dk %.2e, "
              "dv %.2e\n",
              eq, ek, ev);
  std::printf("  dL/dq at one entry: ring %.6f, finite difference of the float64 loss %.6f\n",
              ringattn::to_float(dq[at]), fd);
  // bf16 gradients (the ring's dO is rounded to bf16 too): 1e-2 relative L2; the finite
  // difference (a step of 1/32, second-order error) within 2% of |fd| + 1e-3.
  const bool ok = eq < 1e-2 && ek < 1e-2 && ev < 1e-2 &&
                  std::abs(ringattn::to_float(dq[at]) - fd) < 0.02 * std::abs(fd) + 1e-3;
  std::printf("gradients: %s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
} catch (const example::help_requested& h) {
  std::printf("%s", h.text.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
