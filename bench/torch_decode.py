#!/usr/bin/env python3
"""ShardedDecoder (the extension's decode step) against PyTorch's SDPA over the whole cache.

usage: torchrun --nproc-per-node 1 bench/torch_decode.py OUT.json

bf16, 32 query heads over 8 kv heads, head_dim 128: 32 sequences of 32,768 cached tokens (1M in
all) with 1 and with 8 new tokens each, and one sequence of 131,072 cached tokens with 1 new token.
Each step, the median of 50 CUDA-event-timed calls after 3 warm-ups, each from an idle GPU (the
host work of the call in its time: `ms`), and the median of 5 runs of 10 calls back to back over
10 (`back_to_back_ms`: the host work of a call overlaps the previous call's kernels), of:
- `ShardedDecoder.step` over the NCCL group of one rank (the step plans itself: the host work is
  in the time), the cache packed (`slab`) and in pages of 16 tokens (`paged`, a shuffled pool);
- `ShardedDecoder.step` over 8 virtual ranks on the GPU, each holding 1/8 of every sequence;
- F.scaled_dot_product_attention over the whole cache with the new tokens appended ([batch,
  heads, tokens, 128], GQA, a bottom-right causal mask for 8 new tokens), cuDNN backend.
K/V read rate: the cache's bytes (2 x tokens x 8 x 128 x 2) over the step's time. Writes JSON to
OUT.json (the commit from RINGATTN_COMMIT, else git).
"""
import datetime
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ringattn_torch as ra

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines"))
from sdpa_baseline import time_ms  # noqa: E402

Q_HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
VIRTUAL_RANKS = 8


def back_to_back_ms(fn, calls=10, runs=5):
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return sorted(times)[len(times) // 2]


def steps(batch, cache, new, group):
    """(name, step function) of each implementation at this shape."""
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = make(batch * new, Q_HEADS, DIM), make(batch * new, KV_HEADS, DIM), make(
        batch * new, KV_HEADS, DIM)
    cu = [i * new for i in range(batch + 1)]
    k_cache, v_cache = make(batch * cache, KV_HEADS, DIM), make(batch * cache, KV_HEADS, DIM)
    lengths = [cache] * batch
    one = ra.ShardedDecoder(Q_HEADS, KV_HEADS, DIM, group=group)
    yield "ringattn_torch_slab", lambda: one.step(q, k, v, k_cache, v_cache, cu, lengths)

    # The same rows in a shuffled pool of 16-token pages.
    per = cache // PAGE
    order = torch.randperm(batch * per, device="cuda", generator=g)
    table = order.view(batch, per).int().cpu()
    k_pool = torch.empty(batch * per, PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.empty_like(k_pool)
    k_pool[order] = k_cache.view(batch * per, PAGE, KV_HEADS, DIM)
    v_pool[order] = v_cache.view(batch * per, PAGE, KV_HEADS, DIM)
    yield "ringattn_torch_paged", lambda: one.step(q, k, v, k_pool, v_pool, cu, lengths,
                                                   page_table=table)

    # Every sequence's cache split into 8 runs, one per virtual rank.
    share = cache // VIRTUAL_RANKS
    parts = lambda x: [x.view(batch, VIRTUAL_RANKS, share, KV_HEADS, DIM)[:, r].reshape(
        batch * share, KV_HEADS, DIM) for r in range(VIRTUAL_RANKS)]
    k_parts, v_parts = parts(k_cache), parts(v_cache)
    many = ra.ShardedDecoder(Q_HEADS, KV_HEADS, DIM, ranks=VIRTUAL_RANKS)
    yield "ringattn_torch_8_virtual_ranks", lambda: many.step(
        q, k, v, k_parts, v_parts, cu, [[share] * batch] * VIRTUAL_RANKS)

    # SDPA over the whole cache, the new tokens appended to it.
    bhsd = lambda x, n: x.view(batch, n, x.size(1), DIM).transpose(1, 2)
    q4 = bhsd(q, new).contiguous()
    k4 = torch.cat([bhsd(k_cache, cache), bhsd(k, new)], 2).contiguous()
    v4 = torch.cat([bhsd(v_cache, cache), bhsd(v, new)], 2).contiguous()
    mask = None
    if new > 1:
        mask = torch.ones(new, cache + new, device="cuda", dtype=torch.bool).tril(cache)

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
    yield "sdpa_cudnn", sdpa


def main(path):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    records = []
    for batch, cache, new in ((32, 32768, 1), (32, 32768, 8), (1, 131072, 1)):
        cache_bytes = 2 * batch * cache * KV_HEADS * DIM * 2
        for name, fn in steps(batch, cache, new, dist.group.WORLD):
            ms = time_ms(fn, iters=50)
            ahead = back_to_back_ms(fn)
            rec = dict(sequences=batch, cache_per_sequence=cache, new_per_sequence=new,
                       q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=DIM, implementation=name,
                       ms=ms, cache_tb_per_s=cache_bytes / ms / 1e9, back_to_back_ms=ahead)
            records.append(rec)
            print(f"{name:32s} {batch} x {new} over {batch} x {cache}: {ms:7.3f} ms "
                  f"({rec['cache_tb_per_s']:.2f} TB/s of K/V), back to back {ahead:7.3f} ms",
                  flush=True)
        torch.cuda.empty_cache()
    commit = os.environ.get("RINGATTN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(path, "w") as f:
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        json.dump(dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
                       device=torch.cuda.get_device_name(), commit=commit, date=when,
                       results=records), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
