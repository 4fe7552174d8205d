#!/usr/bin/env python3
"""What the first calls of a process and of a layout cost through the PyTorch extension.

usage: python3 bench/torch_first_calls.py [--device cpu|cuda] [--tokens N] [--out OUT.json]

One rank without a process group (`ring_attention`), then virtual rings of 2 and 4 ranks: for
each layout three forward + backward calls in a row, each timed on its own (the GPU synchronised
around it), the first layout of the process first. Two sequences of N / 2 tokens, 8 query and
4 kv heads, head_dim 128; bf16 on the GPU, fp32 on the CPU. Prints the table and writes JSON
(the commit from RINGATTN_COMMIT, else git) where --out is given.
"""
import argparse
import json
import os
import subprocess
import time

import torch

import ringattn_torch as ra


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out")
    args = parser.parse_args()
    device, n = args.device, args.tokens
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def now():
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    start = now()
    if device == "cuda":
        torch.zeros(1, device=device)
    rows = [{"what": "context", "ms": 1e3 * (now() - start)}]
    g = torch.Generator().manual_seed(0)

    def tensor(heads):
        return torch.randn(n, heads, 128, generator=g).to(device, dtype).requires_grad_()

    layouts = [("one rank, causal", 1, "causal"), ("one rank, full", 1, "full"),
               ("2 virtual ranks, causal", 2, "causal"), ("4 virtual ranks, full", 4, "full")]
    for name, ranks, mask in layouts:
        q, k, v = tensor(8), tensor(4), tensor(4)
        cu = [0, n // 2, n]
        for call in range(3):
            a = now()
            if ranks == 1:
                out, _ = ra.ring_attention(q, k, v, cu, mask=mask)
            else:
                out, _ = ra.virtual_ring_attention(q, k, v, cu, ranks, mask=mask)
            b = now()
            out.sum().backward()
            c = now()
            rows.append({"what": name, "call": call, "forward_ms": 1e3 * (b - a),
                         "backward_ms": 1e3 * (c - b)})
    for r in rows:
        if "call" in r:
            print(f"{r['what']:26s} call {r['call']}: forward {r['forward_ms']:9.1f} ms  "
                  f"backward {r['backward_ms']:9.1f} ms")
        else:
            print(f"{r['what']:26s} {r['ms']:9.1f} ms")
    if args.out:
        commit = os.environ.get("RINGATTN_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "cpus": os.cpu_count(), "torch": torch.__version__, "tokens": n,
                "dtype": str(dtype), "commit": commit,
                "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
