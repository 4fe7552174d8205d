#!/usr/bin/env python3
"""The PyTorch extension on one rank against PyTorch's own attention at the same shapes.

usage: torchrun --nproc-per-node 1 bench/torch_extension.py OUT.json

One sequence, bf16, 32 query heads with 32 and 8 kv heads, head_dim 128, 8K and 32K tokens,
causal and full. Forward and forward + backward, each the median of 10 CUDA-event-timed calls
after 3 warm-ups, of: `ringattn_torch.ring_attention` over the NCCL group of one rank (THD
tensors, autograd), with the native kernels and (where the build has it) kernel="cudnn";
F.scaled_dot_product_attention with the cuDNN and the FlashAttention-2
backends (BHSD tensors, GQA native); and torch.distributed.tensor.experimental.context_parallel
around cuDNN SDPA on a device mesh of the same one rank (load balancing on for causal, off for
full, which it refuses). FLOPs: 4 h s^2 d (half for causal),
3.5x that for forward + backward. Writes JSON to OUT.json (the commit from RINGATTN_COMMIT, else
git).
"""
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringattn_torch as ra

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines"))
from sdpa_baseline import time_ms  # noqa: E402
from torch_cp_baseline import set_load_balance  # noqa: E402

HEADS, DIM = 32, 128


def forward_and_both(fwd, inputs):
    """Medians of the forward alone and of forward + backward (dout of ones)."""
    ms = time_ms(lambda: fwd(*inputs), iters=10)
    grads = [x.detach().requires_grad_() for x in inputs]

    def both():
        out = fwd(*grads)
        out.backward(torch.ones_like(out))
    return ms, time_ms(both, iters=10)


def main(path):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    from torch.distributed.tensor.experimental import context_parallel
    records = []
    for tokens in (8192, 32768):
        for kv_heads in (32, 8):
            for causal in (True, False):
                torch.manual_seed(0)
                mask = "causal" if causal else "full"
                shape = dict(tokens=tokens, q_heads=HEADS, kv_heads=kv_heads, head_dim=DIM,
                             mask=mask)
                flops = 4 * HEADS * tokens * tokens * DIM / (2 if causal else 1)
                q = torch.randn(tokens, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(tokens, kv_heads, DIM, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(tokens, kv_heads, DIM, device="cuda", dtype=torch.bfloat16)
                cu = [0, tokens]
                thd = (q, k, v)
                bhsd = tuple(x.transpose(0, 1).unsqueeze(0).contiguous() for x in thd)
                runs = {
                    "ringattn_torch": (lambda q, k, v: ra.ring_attention(
                        q, k, v, cu, group=group, partitioner="zigzag", mask=mask)[0], thd),
                }
                if ra.has_cudnn_kernel():
                    runs["ringattn_torch_cudnn"] = (lambda q, k, v: ra.ring_attention(
                        q, k, v, cu, group=group, partitioner="zigzag", mask=mask,
                        kernel="cudnn")[0], thd)
                for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                                      ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                    def sdpa(q, k, v, backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(
                                q, k, v, is_causal=causal, enable_gqa=kv_heads != HEADS)
                    runs[name] = (sdpa, bhsd)
                for name, (fwd, inputs) in runs.items():
                    rec = dict(shape, implementation=name)
                    try:
                        ms, both = forward_and_both(fwd, inputs)
                        rec.update(ms=ms, ms_forward_backward=both, tflops=flops / ms / 1e9,
                                   tflops_forward_backward=3.5 * flops / both / 1e9)
                    except RuntimeError as e:
                        rec["error"] = str(e)[:300]
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
                # PyTorch context parallel on the same one rank: K/V repeated to 32 heads (its
                # SDPA takes no GQA), cuDNN backend.
                rec = dict(shape, implementation="torch_context_parallel",
                           load_balance=causal if set_load_balance(causal) else "default")
                try:
                    full = [x.clone() for x in bhsd]
                    if kv_heads != HEADS:
                        full[1:] = [x.repeat_interleave(HEADS // kv_heads, 1) for x in full[1:]]
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        with context_parallel(mesh, buffers=full, buffer_seq_dims=[2, 2, 2]):
                            ms, both = forward_and_both(
                                lambda q, k, v: F.scaled_dot_product_attention(
                                    q, k, v, is_causal=causal), full)
                    rec.update(ms=ms, ms_forward_backward=both, tflops=flops / ms / 1e9,
                               tflops_forward_backward=3.5 * flops / both / 1e9)
                except Exception as e:  # an unsupported combination is reported, not fatal
                    rec["error"] = str(e)[:300]
                records.append(rec)
                print(json.dumps(rec), flush=True)
                del q, k, v, thd, bhsd
                torch.cuda.empty_cache()
    commit = os.environ.get("RINGATTN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(path, "w") as f:
        json.dump(dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                       device=torch.cuda.get_device_name(), commit=commit, results=records),
                  f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
