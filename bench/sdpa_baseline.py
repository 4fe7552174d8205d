#!/usr/bin/env python3
"""PyTorch SDPA baseline (cuDNN and flash backends) at the block-forward benchmark's shapes.

Run in the same device session as bench_block_forward so ratios compare one machine state.
Writes JSON (list of records) to the path given as the first argument.
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
    main(sys.argv[1])
