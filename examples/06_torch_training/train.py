#!/usr/bin/env python3
"""A transformer block trained with context-parallel attention from PyTorch.

    torchrun --nproc-per-node N examples/06_torch_training/train.py [--steps 30] [--check]
                                                                  [--kernel cudnn]
    torchrun --nproc-per-node N examples/06_torch_training/train.py --device cpu [--check]

Each rank holds its shard of a packed batch of sequences (zigzag: balanced causal work), applies
rotary embeddings at the positions `position_ids` gives, and runs attention through
`ringattn_torch.ring_attention` over NCCL (bf16 on the GPUs) or, with --device cpu, over gloo
(float32 on CPU threads, a smaller batch: no GPU needed); gradients of the (replicated) weights
are summed across ranks as data parallelism would. Rank 0 also trains the same model from the
same weights on the whole batch with PyTorch's scaled_dot_product_attention, and with --check
the run fails unless both loss curves agree to 1e-2 relative at every step (1e-4 on the CPU).
Works with N = 1 (a ring of one rank). --kernel cudnn computes the GPU blocks with cuDNN's fused
attention (builds that have it) instead of the library's own kernels.
"""

import argparse
import os

import torch
# Before the process group is made: torch.optim imports it at the first optimizer, and imported
# while a default group exists it keeps that group alive past destroy_process_group, so that the
# group's gloo threads outlive main() and can abort the interpreter's shutdown.
import torch._dynamo  # noqa: F401
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ringattn_torch as ra


class Block(nn.Module):
    """Pre-norm attention (GQA, rotary) and MLP, on packed tokens [tokens, width]."""

    def __init__(self, width=512, heads=8, kv_heads=2, head_dim=64, dtype=torch.bfloat16):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.dtype = heads, kv_heads, head_dim, dtype
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, width, bias=False)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, width)

    def forward(self, x, positions, attend):
        h = self.norm1(x)
        q, k, v = self.qkv(h).split([self.heads * self.head_dim,
                                     self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], dim=-1)
        q = rotary(q.view(-1, self.heads, self.head_dim), positions)
        k = rotary(k.view(-1, self.kv_heads, self.head_dim), positions)
        v = v.view(-1, self.kv_heads, self.head_dim)
        a = attend(q.to(self.dtype), k.to(self.dtype), v.to(self.dtype).contiguous())
        x = x + self.proj(a.float().flatten(1))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def rotary(x, positions, base=10000.0):
    half = x.size(-1) // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angle = positions.float()[:, None, None] * freq
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def sdpa_packed(q, k, v, cu):
    """Causal attention of a packed batch, sequence by sequence, with PyTorch's SDPA."""
    out = []
    for b, e in zip(cu[:-1], cu[1:]):
        out.append(F.scaled_dot_product_attention(
            q[b:e].transpose(0, 1), k[b:e].transpose(0, 1), v[b:e].transpose(0, 1),
            is_causal=True, enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: one GPU a rank, NCCL, bf16; cpu: gloo, float32")
    parser.add_argument("--kernel", choices=ra.KERNELS, default="native",
                        help="the block kernel on the GPU (cudnn: CUDA tensors only)")
    args = parser.parse_args()

    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device, dtype, tolerance = torch.device("cuda", local), torch.bfloat16, 1e-2
        cu = [0, 1500, 1501, 3900, 4097, 6000]
    else:
        dist.init_process_group("gloo")
        device, dtype, tolerance = torch.device("cpu"), torch.float32, 1e-4
        cu = [0, 150, 151, 390, 410, 600]
    rank, ranks = dist.get_rank(), dist.get_world_size()

    # The same data and weights on every rank (one seed); sequences of uneven lengths.
    torch.manual_seed(0)
    width = 512
    x_full = torch.randn(cu[-1], width, device=device)
    y_full = torch.randn(cu[-1], width, device=device)
    model = Block(width, dtype=dtype).to(device)
    reference = Block(width, dtype=dtype).to(device) if rank == 0 else None
    if reference is not None:
        reference.load_state_dict(model.state_dict())

    x, y = ra.shard(x_full, cu), ra.shard(y_full, cu)
    positions = ra.position_ids(cu).to(device)
    ring = lambda q, k, v: ra.ring_attention(q, k, v, cu, partitioner="zigzag", mask="causal",
                                             kernel=args.kernel)[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if reference is not None:
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        ref_positions = torch.cat([torch.arange(e - b) for b, e in zip(cu[:-1], cu[1:])]).to(device)

    worst = 0.0
    for step in range(args.steps):
        # Sum of squared errors over this rank's tokens, over all tokens: the ranks' losses add
        # up to the full batch's mean, and so do their gradients.
        loss = F.mse_loss(model(x, positions, ring), y, reduction="sum") / (cu[-1] * width)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if reference is not None:
            ref_loss = F.mse_loss(reference(x_full, ref_positions,
                                            lambda q, k, v: sdpa_packed(q, k, v, cu)), y_full)
            ref_optimizer.zero_grad(set_to_none=True)
            ref_loss.backward()
            ref_optimizer.step()
            gap = abs(total.item() - ref_loss.item()) / abs(ref_loss.item())
            worst = max(worst, gap)
            print(f"step {step:3d}  ring loss {total.item():.6f}  sdpa loss {ref_loss.item():.6f}"
                  f"  relative gap {gap:.1e}", flush=True)
    ok = torch.tensor([1.0 if worst < tolerance else 0.0], device=device)
    dist.broadcast(ok, src=0)
    if rank == 0:
        print(f"{ranks} rank(s), {args.steps} steps: largest relative gap between the loss "
              f"curves {worst:.1e}", flush=True)
    dist.destroy_process_group()
    if args.check and ok.item() != 1.0:
        raise SystemExit(f"the ring's loss curve left the reference's by more than {tolerance}")


if __name__ == "__main__":
    main()
