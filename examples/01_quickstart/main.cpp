// 01_quickstart: the README's main command.
//
// Ring attention forward over a synthetic packed batch, P ranks, checked against the float64
// oracle on a sample of rows. The ranks are threads of this process (the in-process
// communicator). Where there is a GPU (and the example was compiled by nvcc) they run the device
// path: rank r on GPU r % (visible GPUs), so one GPU hosts P virtual ranks and several GPUs get
// one rank each (copies between them peer to peer); otherwise the host path on the CPU.
// --device cpu forces the CPU. One rank per GPU over NCCL and MPI: examples/02_mpi_nccl.
//
//   quickstart [--ranks P] [--tokens N] [--sequences B] [--heads H] [--kv-heads K]
//              [--head-dim 64|128] [--mask causal|full] [--window W] [--partitioner
//              zigzag|round_robin|contiguous|balanced] [--device auto|cpu|gpu]
#include <ringattn/comm/in_process.cuh>
#include <ringattn/ring_attention.cuh>
#include <ringattn/ringattn.cuh>

#include "../common/example.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {
struct options {
  int ranks = 4;
  int tokens = 8192;
  int sequences = 3;
  int heads = 8, kv_heads = 2, head_dim = 64;
  int window = 0; // keys a query sees behind it (its own included); 0: no window
  std::string mask = "causal", partitioner = "zigzag", device = "auto";
};

options parse(int argc, char** argv) {
  options o;
  example::flags("quickstart",
                 "Ring attention forward over a synthetic packed batch, checked against the "
                 "float64 oracle.")
      .add("ranks", o.ranks, "ranks (threads of this process; on GPUs, rank r on GPU r % GPUs)")
      .add("tokens", o.tokens, "tokens of the packed batch")
      .add("sequences", o.sequences, "sequences packed in it (uneven, odd lengths)")
      .add("heads", o.heads, "query heads")
      .add("kv-heads", o.kv_heads, "key/value heads (a divisor of --heads)")
      .add("head-dim", o.head_dim, "head dimension: 64, 128 or 256", 64, 256)
      .add("mask", o.mask, {"causal", "full"}, "which keys a query sees")
      .add("window", o.window,
           "a window of W keys: with causal the W keys up to the query's own "
           "(ringattn::causal_window), with full also W - 1 ahead (ringattn::sliding_window); "
           "0: none",
           0)
      .add("partitioner", o.partitioner, {"zigzag", "round_robin", "contiguous", "balanced"},
           "how the tokens are split over the ranks (docs/guides.md)")
      .add("device", o.device, {"auto", "cpu", "gpu"}, "auto: the GPU(s) where there are any")
      .parse(argc, argv);
  return o;
}

using T = __nv_bfloat16;

#if defined(__CUDACC__)
//! One rank's forward on the GPU: shards to device memory, a warm-up and a timed forward on its
//! own stream, the output shard back to the host.
template <class Ring>
void forward_on_gpu(Ring& attn, const std::vector<T>& qs, const std::vector<T>& ks,
                    const std::vector<T>& vs, std::vector<T>& os, std::vector<float>& ls, int heads,
                    int kv_heads, int head_dim, ringattn::in_process_communicator& comm,
                    double& seconds) {
  attn.prepare_device();
  const std::int64_t m = attn.local_tokens();
  auto upload = [](const std::vector<T>& h) {
    T* d = nullptr;
    RINGATTN_CUDA_CHECK(cudaMalloc(&d, sizeof(T) * h.size() + 16));
    RINGATTN_CUDA_CHECK(cudaMemcpy(d, h.data(), sizeof(T) * h.size(), cudaMemcpyHostToDevice));
    return d;
  };
  T *q = upload(qs), *k = upload(ks), *v = upload(vs), *out = upload(os);
  float* lse = nullptr;
  void* ws = nullptr;
  const std::size_t ws_bytes = attn.template device_workspace_bytes<T>();
  RINGATTN_CUDA_CHECK(cudaMalloc(&lse, sizeof(float) * ls.size() + 16));
  RINGATTN_CUDA_CHECK(cudaMalloc(&ws, ws_bytes + 16));
  cudaStream_t stream;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int i = 0; i < 2; ++i) { // a warm-up, then the timed forward whose output is checked
    const auto start = std::chrono::steady_clock::now();
    attn.forward(ringattn::thd_view<const T>(q, m, heads, head_dim),
                 ringattn::thd_view<const T>(k, m, kv_heads, head_dim),
                 ringattn::thd_view<const T>(v, m, kv_heads, head_dim),
                 ringattn::thd_view<T>(out, m, heads, head_dim), lse, ws, ws_bytes, stream);
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    comm.barrier(); // the timed pass starts together
  }
  RINGATTN_CUDA_CHECK(cudaMemcpy(os.data(), out, sizeof(T) * os.size(), cudaMemcpyDeviceToHost));
  RINGATTN_CUDA_CHECK(
      cudaMemcpy(ls.data(), lse, sizeof(float) * ls.size(), cudaMemcpyDeviceToHost));
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  for (void* p : {static_cast<void*>(q), static_cast<void*>(k), static_cast<void*>(v),
                  static_cast<void*>(out), static_cast<void*>(lse), ws})
    cudaFree(p);
}
#endif

template <class P, class Mask>
int run(const options& o) {
  const int gpus = example::gpu_count(o.device);
  std::mt19937_64 rng(std::random_device{}());
  const std::vector<std::int32_t> cu = example::packed_batch(o.tokens, o.sequences);
  ringattn::attention_arguments args{o.heads, o.kv_heads, o.head_dim, 0.0f};
  if (o.window > 0) {
    args.window_left = o.window - 1;
    args.window_right = o.mask == "full" ? o.window - 1 : 0;
  }
  args.validate(Mask::mask).throw_if_invalid();
  auto random = [&](std::size_t n) { return example::random_values<T>(n, rng); };
  const std::size_t n = static_cast<std::size_t>(o.tokens);
  const auto q = random(n * o.heads * o.head_dim), k = random(n * o.kv_heads * o.head_dim),
             v = random(n * o.kv_heads * o.head_dim);
  std::vector<T> out(q.size(), ringattn::from_float<T>(-12345.0f)); // poisoned: gathered shards
  std::vector<float> lse(n * o.heads, -12345.0f);

  ringattn::in_process_group group(o.ranks);
  ringattn::partition_plan<P> plan(cu, o.ranks);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(o.ranks));
  std::atomic<int> finished{0};
  std::vector<double> gpu_seconds(static_cast<std::size_t>(o.ranks), 0.0); // timed device forward
  std::vector<std::uint64_t> sent(static_cast<std::size_t>(o.ranks), 0);   // bytes, every call
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < o.ranks; ++r)
    threads.emplace_back([&, r] {
      try {
#if defined(__CUDACC__)
        if (gpus > 0) RINGATTN_CUDA_CHECK(cudaSetDevice(r % gpus)); // P virtual ranks per GPU
#endif
        auto comm = group.communicator(r);
        ringattn::ring_attention<P, ringattn::in_process_communicator, Mask> attn(comm, args, cu);
        const std::int64_t m = attn.local_tokens();
        auto shard = [&](const std::vector<T>& full, int heads) {
          std::vector<T> s(static_cast<std::size_t>(m) * heads * o.head_dim);
          ringattn::scatter(plan, r,
                            ringattn::thd_view<const T>(full.data(), o.tokens, heads, o.head_dim),
                            ringattn::thd_view<T>(s.data(), m, heads, o.head_dim));
          return s;
        };
        const auto qs = shard(q, o.heads), ks = shard(k, o.kv_heads), vs = shard(v, o.kv_heads);
        std::vector<T> os(qs.size());
        std::vector<float> ls(static_cast<std::size_t>(m) * o.heads);
        if (gpus > 0) {
#if defined(__CUDACC__)
          forward_on_gpu(attn, qs, ks, vs, os, ls, o.heads, o.kv_heads, o.head_dim, comm,
                         gpu_seconds[static_cast<std::size_t>(r)]);
#endif
        } else {
          std::vector<std::byte> ws(attn.template host_workspace_bytes<T>() + 16);
          const std::size_t pad = (16 - reinterpret_cast<std::uintptr_t>(ws.data()) % 16) % 16;
          attn.forward_host(
              ringattn::thd_view<const T>(qs.data(), m, o.heads, o.head_dim),
              ringattn::thd_view<const T>(ks.data(), m, o.kv_heads, o.head_dim),
              ringattn::thd_view<const T>(vs.data(), m, o.kv_heads, o.head_dim),
              ringattn::thd_view<T>(os.data(), m, o.heads, o.head_dim), ls.data(),
              std::span<std::byte>(ws).subspan(pad, attn.template host_workspace_bytes<T>()));
        }
        // This rank's rows back to their places in the full batch (each row is owned once).
        for (std::int64_t l = 0; l < m; ++l) {
          const std::int64_t g = plan.global_token(r, l);
          std::memcpy(&out[static_cast<std::size_t>(g * o.heads * o.head_dim)],
                      &os[static_cast<std::size_t>(l * o.heads * o.head_dim)],
                      sizeof(T) * o.heads * o.head_dim);
          for (int h = 0; h < o.heads; ++h)
            lse[static_cast<std::size_t>(h) * n + g] = ls[static_cast<std::size_t>(h * m + l)];
        }
        sent[static_cast<std::size_t>(r)] = comm.bytes_sent();
        std::printf("  rank %d done: %lld tokens (%d of %d ranks finished)\n", r,
                    static_cast<long long>(m), ++finished, o.ranks);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  // Progress on long runs: a line every two seconds until every rank is done.
  std::mutex progress_mutex;
  std::condition_variable progress_cv;
  bool done = false;
  std::thread progress([&] {
    std::unique_lock lock(progress_mutex);
    while (!progress_cv.wait_for(lock, std::chrono::seconds(2), [&] { return done; }))
      std::printf("  ... %.0f s, %d of %d ranks finished\n",
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                  finished.load(), o.ranks);
  });
  for (auto& t : threads)
    t.join();
  // CPU: the whole run; GPU: the slowest rank's timed forward (after a warm-up).
  const double seconds =
      gpus > 0 ? *std::max_element(gpu_seconds.begin(), gpu_seconds.end())
               : std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard lock(progress_mutex);
    done = true;
  }
  progress_cv.notify_all();
  progress.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);

  const std::vector<std::int64_t> rows = example::sample_rows(cu, 24, rng);
  std::printf("  checking %zu sample rows against the float64 oracle\n", rows.size());
  const auto w = args.window(Mask::mask);
  auto ref = ringattn::reference::attention_forward_rows(
      ringattn::reference::to_tensor(
          ringattn::thd_view<const T>(q.data(), o.tokens, o.heads, o.head_dim)),
      ringattn::reference::to_tensor(
          ringattn::thd_view<const T>(k.data(), o.tokens, o.kv_heads, o.head_dim)),
      ringattn::reference::to_tensor(
          ringattn::thd_view<const T>(v.data(), o.tokens, o.kv_heads, o.head_dim)),
      cu, args, w, rows);
  double max_err = 0.0, max_lse_err = 0.0;
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (int h = 0; h < o.heads; ++h) {
      const std::int64_t g = rows[i];
      max_lse_err =
          std::max(max_lse_err, std::abs(double(lse[static_cast<std::size_t>(h) * n + g]) -
                                         ref.lse_at(h, static_cast<std::int64_t>(i))));
      for (int d = 0; d < o.head_dim; ++d)
        max_err = std::max(
            max_err,
            std::abs(double(ringattn::to_float(
                         out[static_cast<std::size_t>((g * o.heads + h) * o.head_dim + d)])) -
                     ref.out(static_cast<std::int64_t>(i), h, d)));
    }
  std::int64_t hi = 0, total = 0;
  std::printf("\n  %5s %8s %14s %14s\n", "rank", "tokens", "work", "bytes sent");
  for (int r = 0; r < o.ranks; ++r) {
    const std::int64_t x = plan.work(r, w);
    hi = std::max(hi, x), total += x;
    std::printf("  %5d %8lld %14lld %14llu\n", r, static_cast<long long>(plan.local_tokens(r)),
                static_cast<long long>(x),
                static_cast<unsigned long long>(sent[static_cast<std::size_t>(r)]));
  }
  std::printf("  (work: the rank's visible query x key pairs, plan.work(rank, window); bytes "
              "sent: what its communicator sent%s)\n",
              gpus > 0 ? ", the warm-up's and the timed forward's" : "");
  const double flops = 4.0 * o.heads * static_cast<double>(total) * o.head_dim;
  const bool ok = max_err < 1e-2 && max_lse_err < 1e-4; // bf16 output: a few ulps of 2^-8
  const int steps = ringattn::ring_schedule::steps_needed(plan, w);
  std::printf("\n  %5s %-12s %-14s %8s %6s %10s %9s %10s %10s %12s\n", "ranks", "partitioner",
              "mask", "tokens", "steps", "time ms", "TFLOP/s", "max |err|", "lse err",
              "work max/mean");
  std::printf("  %5d %-12s %-14s %8d %6d %10.3f %9.4f %10.2e %10.2e %12.3f\n", o.ranks, P::name,
              Mask::name, o.tokens, steps, seconds * 1e3, flops / seconds / 1e12, max_err,
              max_lse_err, total > 0 ? static_cast<double>(hi) * o.ranks / total : 1.0);
  std::printf("  (time: the slowest rank's forward; max |err|: largest output difference from the "
              "float64 oracle over the sampled rows, tolerance 1e-2 for bf16; lse err: the same "
              "for the lse, tolerance 1e-4; steps: ring steps, fewer than the ranks where a window "
              "needs no block from further away; work max/mean: the busiest rank's visible scores "
              "over the mean, 1 is perfect balance)\n");
  std::printf("\n%zu sample rows x %d heads against the float64 oracle: %s\n", rows.size(), o.heads,
              ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}

template <class P>
int with_mask(const options& o) {
  if (o.window > 0)
    return o.mask == "full" ? run<P, ringattn::sliding_window>(o)
                            : run<P, ringattn::causal_window>(o);
  return o.mask == "full" ? run<P, ringattn::full>(o) : run<P, ringattn::causal>(o);
}
} // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  const int gpus = example::gpu_count(o.device);
  std::printf(
      "ringattn %d.%d.%d quickstart: ring attention forward, %d ranks as threads of this "
      "process, %s\n",
      ringattn::version.major, ringattn::version.minor, ringattn::version.patch, o.ranks,
      gpus == 0 ? "on the CPU (host path)"
      : gpus == 1
          ? "on one GPU (virtual ranks, device path)"
          : ("on " + std::to_string(std::min(gpus, o.ranks)) + " GPUs (device path)").c_str());
  if (o.partitioner == "zigzag") return with_mask<ringattn::zigzag>(o);
  if (o.partitioner == "round_robin") return with_mask<ringattn::round_robin>(o);
  if (o.partitioner == "balanced") return with_mask<ringattn::balanced>(o);
  return with_mask<ringattn::contiguous>(o);
} catch (const example::help_requested& h) {
  std::printf("%s", h.text.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
