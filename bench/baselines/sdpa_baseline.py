#!/usr/bin/env python3
"""PyTorch SDPA baseline (cuDNN and flash backends) at the block benchmarks' shapes.

usage: sdpa_baseline.py OUT.json [--backward | --ring | --decode | --widths]

Forward (default): bench_block_forward's shapes. --backward: bench_block_backward's shapes (bf16,
32 q heads with 32 and 8 kv heads, head_dim 128, 2K, 8K and 32K tokens, full and causal); the time
of the backward alone is that of forward + backward minus that of the forward (medians), FLOPs
2.5x the forward's. --ring: one whole-sequence call at bench_ring_forward's shape (64K tokens,
32:8 heads, head_dim 128, full and causal), forward and forward + backward (FLOPs 3.5x the
forward's), cuDNN only. --decode: bench_sharded_decode's steps on one GPU over the whole cache: 32
sequences of 1 and of 8 new tokens each against 32768 cached tokens each (1M in all; new token i
sees the cache and new tokens 0..i, a boolean mask for 8), and one sequence of 1 new token against
131072, 32:8 heads, head_dim 128, every backend that takes it (the default choice, cuDNN, flash,
efficient). --widths: bench_block_backward's block_mla shapes (q and k 192 wide, v
128, 8K tokens, 32:32 and 32:8 heads), forward and backward, every backend that takes them. Run in
the same job as our benchmark so ratios compare one machine
state. Writes JSON (list of records) to OUT.json.
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def time_ms(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def backward(path):
    out = []
    torch.manual_seed(0)
    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
        for s in (2048, 8192, 32768):
            for kvh in (32, 8):
                for causal in (False, True):
                    rec = dict(backend=name, tokens=s, kv_heads=kvh, head_dim=128, causal=causal,
                               pass_="backward")
                    q = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16,
                                    requires_grad=True)
                    k = torch.randn(1, kvh, s, 128, device="cuda", dtype=torch.bfloat16,
                                    requires_grad=True)
                    v = torch.randn(1, kvh, s, 128, device="cuda", dtype=torch.bfloat16,
                                    requires_grad=True)
                    dout = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16)
                    try:
                        with sdpa_kernel(backend):
                            fwd = lambda: F.scaled_dot_product_attention(
                                q, k, v, is_causal=causal, enable_gqa=kvh != 32)
                            both = lambda: fwd().backward(dout)
                            ms_fwd = time_ms(lambda: fwd().detach())
                            ms_both = time_ms(both)
                        rec["gqa"] = "native"
                    except RuntimeError as e:
                        rec["error"] = str(e)[:200]
                        out.append(rec)
                        continue
                    ms = ms_both - ms_fwd
                    flops = 2.5 * 4 * 32 * s * s * 128 / (2 if causal else 1)
                    rec.update(ms=ms, ms_forward_backward=ms_both, tflops=flops / ms / 1e9)
                    out.append(rec)
                    print(f"{name:6s} backward s={s:6d} kvh={kvh:2d} causal={causal!s:5s} "
                          f"{ms:8.3f} ms {rec['tflops']:7.1f} TFLOP/s", flush=True)
                    del q, k, v, dout
    with open(path, "w") as f:
        json.dump(dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                       device=torch.cuda.get_device_name(), results=out), f, indent=1)


def ring(path):
    out = []
    torch.manual_seed(0)
    s, kvh = 65536, 8
    q = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kvh, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kvh, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16)
    for causal in (True, False):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            ms_fwd = time_ms(lambda: fwd().detach(), iters=5)
            ms_both = time_ms(lambda: fwd().backward(dout), iters=5)
        flops = 4 * 32 * s * s * 128 / (2 if causal else 1)
        for pass_, ms, f in (("forward", ms_fwd, flops), ("forward_backward", ms_both, 3.5 * flops)):
            rec = dict(backend="cudnn", tokens=s, kv_heads=kvh, head_dim=128, causal=causal,
                       pass_=pass_, ms=ms, tflops=f / ms / 1e9)
            out.append(rec)
            print(f"cudnn  whole s={s} causal={causal!s:5s} {pass_:16s} {ms:9.3f} ms "
                  f"{rec['tflops']:7.1f} TFLOP/s", flush=True)
    with open(path, "w") as f:
        json.dump(dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                       device=torch.cuda.get_device_name(), results=out), f, indent=1)


def decode(path):
    out = []
    torch.manual_seed(0)
    kvh = 8
    backends = ((None, "default"), (SDPBackend.CUDNN_ATTENTION, "cudnn"),
                (SDPBackend.FLASH_ATTENTION, "flash"), (SDPBackend.EFFICIENT_ATTENTION, "efficient"))
    for batch, cache, new in ((32, 32768, 1), (32, 32768, 8), (1, 131072, 1)):
        q = torch.randn(batch, 32, new, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, kvh, cache + new, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, kvh, cache + new, 128, device="cuda", dtype=torch.bfloat16)
        cache_bytes = 2 * batch * kvh * cache * 128 * k.element_size()
        # New token i sees the cache and new tokens 0..i (the causal mask aligned bottom right).
        mask = None
        if new > 1:
            mask = torch.ones(new, cache + new, device="cuda", dtype=torch.bool).tril(cache)
        for backend, name in backends:
            rec = dict(backend=name, sequences=batch, cache_per_sequence=cache,
                       new_per_sequence=new, q_heads=32, kv_heads=kvh, head_dim=128)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            try:
                if backend is None:
                    ms = time_ms(fn, iters=50)
                else:
                    with sdpa_kernel(backend):
                        ms = time_ms(fn, iters=50)
            except RuntimeError as e:
                rec["error"] = str(e)[:200]
                out.append(rec)
                print(f"{name:9s} decode {batch} x {new}: {rec['error'][:80]}", flush=True)
                continue
            rec.update(ms=ms, cache_gb_per_s=cache_bytes / ms / 1e6)
            out.append(rec)
            print(f"{name:9s} decode {batch} x {new} over {batch} x {cache}: {ms:8.3f} ms "
                  f"({rec['cache_gb_per_s']:.0f} GB/s of K/V)", flush=True)
        del q, k, v
    with open(path, "w") as f:
        json.dump(dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                       device=torch.cuda.get_device_name(), results=out), f, indent=1)


def widths(path):
    """bench_block_backward's block_mla shapes: q and k 192 wide, v 128, 8K tokens, 32 q heads with
    32 and 8 kv heads, full and causal; forward, and backward as forward + backward minus forward."""
    out = []
    torch.manual_seed(0)
    backends = ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash"),
                (SDPBackend.EFFICIENT_ATTENTION, "efficient"))
    s = 8192
    for backend, name in backends:
        for kvh in (32, 8):
            for causal in (False, True):
                rec = dict(backend=name, tokens=s, kv_heads=kvh, head_dim=192, head_dim_v=128,
                           causal=causal)
                q = torch.randn(1, 32, s, 192, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True)
                k = torch.randn(1, kvh, s, 192, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True)
                v = torch.randn(1, kvh, s, 128, device="cuda", dtype=torch.bfloat16,
                                requires_grad=True)
                dout = torch.randn(1, 32, s, 128, device="cuda", dtype=torch.bfloat16)
                try:
                    with sdpa_kernel(backend):
                        fwd = lambda: F.scaled_dot_product_attention(
                            q, k, v, is_causal=causal, enable_gqa=kvh != 32)
                        ms_fwd = time_ms(lambda: fwd().detach())
                        ms_both = time_ms(lambda: fwd().backward(dout))
                except RuntimeError as e:
                    rec["error"] = str(e)[:200]
                    out.append(rec)
                    print(f"{name:9s} kvh={kvh:2d} causal={causal!s:5s} refused: {rec['error']}",
                          flush=True)
                    continue
                flops = 2 * 32 * s * s * (192 + 128) / (2 if causal else 1)
                rec.update(ms_forward=ms_fwd, ms_backward=ms_both - ms_fwd,
                           tflops_forward=flops / ms_fwd / 1e9,
                           tflops_backward=2.5 * flops / (ms_both - ms_fwd) / 1e9)
                out.append(rec)
                print(f"{name:9s} 192/128 s={s} kvh={kvh:2d} causal={causal!s:5s} forward "
                      f"{ms_fwd:8.3f} ms backward {ms_both - ms_fwd:8.3f} ms", flush=True)
                del q, k, v, dout
    with open(path, "w") as f:
        json.dump(dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                       device=torch.cuda.get_device_name(), results=out), f, indent=1)


def main(path):
    out = []
    torch.manual_seed(0)
    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")):
        for s in (2048, 8192, 32768):
            for kvh in (32, 8):
                for d in (128, 64):
                    for causal in (False, True):
                        q = torch.randn(1, 32, s, d, device="cuda", dtype=torch.bfloat16)
                        k = torch.randn(1, kvh, s, d, device="cuda", dtype=torch.bfloat16)
                        v = torch.randn(1, kvh, s, d, device="cuda", dtype=torch.bfloat16)
                        rec = dict(backend=name, tokens=s, kv_heads=kvh, head_dim=d, causal=causal)
                        try:
                            with sdpa_kernel(backend):
                                fn = lambda: F.scaled_dot_product_attention(
                                    q, k, v, is_causal=causal, enable_gqa=kvh != 32)
                                ms = time_ms(fn)
                            rec["gqa"] = "native"
                        except RuntimeError:
                            # A backend without native GQA: give it repeated K/V (not timed).
                            kr = k.repeat_interleave(32 // kvh, dim=1)
                            vr = v.repeat_interleave(32 // kvh, dim=1)
                            try:
                                with sdpa_kernel(backend):
                                    fn = lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
                                    ms = time_ms(fn)
                                rec["gqa"] = "repeated"
                            except RuntimeError as e:
                                rec["error"] = str(e)[:200]
                                out.append(rec)
                                continue
                        flops = 4 * 32 * s * s * d / (2 if causal else 1)
                        rec.update(ms=ms, tflops=flops / ms / 1e9)
                        out.append(rec)
                        print(f"{name:6s} s={s:6d} kvh={kvh:2d} d={d:3d} causal={causal!s:5s} "
                              f"{ms:8.3f} ms {rec['tflops']:7.1f} TFLOP/s ({rec['gqa']})", flush=True)
                        del q, k, v
    with open(path, "w") as f:
        json.dump(dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                       device=torch.cuda.get_device_name(), results=out), f, indent=1)


if __name__ == "__main__":
    if "--backward" in sys.argv[2:]:
        backward(sys.argv[1])
    elif "--ring" in sys.argv[2:]:
        ring(sys.argv[1])
    elif "--decode" in sys.argv[2:]:
        decode(sys.argv[1])
    elif "--widths" in sys.argv[2:]:
        widths(sys.argv[1])
    else:
        main(sys.argv[1])
