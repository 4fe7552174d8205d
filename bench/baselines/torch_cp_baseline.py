#!/usr/bin/env python3
"""PyTorch context parallel at the shapes of bench/ring_nccl.cu: the peer to compare the ring with.

usage: torchrun --nproc-per-node P bench/baselines/torch_cp_baseline.py OUT.json

One sequence of P x tokens_per_gpu tokens, bf16, 32 query heads, head_dim 128, causal and full,
8K and 32K tokens per GPU: torch.distributed.tensor.experimental.context_parallel around
F.scaled_dot_product_attention with the cuDNN backend (ring attention over NCCL, load-balanced
sharding for causal). K and V have 32 heads (repeated from 8): context parallel's SDPA does not
take GQA, so its bytes per step are 4x ours; both counts go into the JSON. Time: the slowest
rank's median of 10 event-timed calls after 3 warm-ups; forward + backward (3.5x the forward's
FLOPs) the median of 5 after 3. Load balancing on for causal, off for
full (it refuses full masks). FLOPs per GPU: 4 h s^2 d / P (half for
causal). Rank 0 writes OUT.json. Run with NCCL_NVLS_ENABLE=0 on machines that require it.
"""
import importlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel


def set_load_balance(on):
    """Context parallel's load balancing (zigzag-like sharding) is for causal masks only; full
    attention runs with it off. Its switch has moved between releases."""
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            importlib.import_module(name)._cp_options.enable_load_balance = on
            return True
        except (ImportError, AttributeError):
            continue
    return False


def main(path):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    mesh = init_device_mesh("cuda", (world,))
    from torch.distributed.tensor.experimental import context_parallel

    heads, dim = 32, 128
    out = []
    for per_gpu in (8192, 32768):
        for causal in (True, False):
            s = per_gpu * world
            torch.manual_seed(0)
            q = torch.randn(1, heads, s, dim, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, heads, s, dim, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, heads, s, dim, device="cuda", dtype=torch.bfloat16)
            rec = dict(tokens_per_gpu=per_gpu, causal=causal, gpus=world,
                       backend="cudnn", kv_heads_sent=heads,
                       load_balance=causal if set_load_balance(causal) else "default")
            try:
                times = []
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                        for i in range(13):
                            a = torch.cuda.Event(enable_timing=True)
                            b = torch.cuda.Event(enable_timing=True)
                            a.record()
                            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            b.record()
                            b.synchronize()
                            if i >= 3:
                                times.append(a.elapsed_time(b))
                        # Forward + backward on this rank's shards (leaf copies that need grad).
                        both = []
                        try:
                            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
                            for i in range(8):
                                a = torch.cuda.Event(enable_timing=True)
                                b = torch.cuda.Event(enable_timing=True)
                                a.record()
                                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                                o.backward(torch.ones_like(o))
                                b.record()
                                b.synchronize()
                                if i >= 3:
                                    both.append(a.elapsed_time(b))
                        except Exception as e:  # reported; the forward still counts
                            rec["backward_error"] = str(e)[:300]
                            both = []
                times.sort()
                both.sort()
                ms = torch.tensor([times[len(times) // 2], both[len(both) // 2] if both else 0.0],
                                  device="cuda")
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                flops = 4 * heads * s * s * dim / (2 if causal else 1) / world
                rec.update(ms=ms[0].item(), tflops_per_gpu=flops / ms[0].item() / 1e9)
                if both:
                    rec.update(ms_forward_backward=ms[1].item(),
                               tflops_per_gpu_forward_backward=3.5 * flops / ms[1].item() / 1e9)
            except Exception as e:  # an unsupported combination is reported, not fatal
                rec["error"] = str(e)[:300]
            out.append(rec)
            if rank == 0:
                print(json.dumps(rec), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(dict(torch=torch.__version__, device=torch.cuda.get_device_name(),
                           gpus=world, results=out), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
