#!/usr/bin/env python3
"""Table (markdown) of the sharded decode step against PyTorch SDPA over the whole cache.

usage: report_decode.py DECODE.json SDPA.json [--bundle OUT.json]
       report_decode.py --from BUNDLE.json

DECODE.json: bench_sharded_decode's Google Benchmark JSON (32 sequences x 1 or 8 new tokens
against 32 x 32768 cached tokens, or 1 x 1 against 131072; 32:8 heads, head_dim 128, bf16; P
virtual ranks on one GPU; the cache packed or in pages of 16 tokens). SDPA.json:
sdpa_baseline.py --decode of the same run. Prints, per block kernel, cache shape, layout, new
tokens and rank count, the step's time, PyTorch's cuDNN SDPA time over the whole cache divided by
it, an FP8 cache's step time over the bf16 cache's (same shape and layout), the cache's K/V bytes
read per second, the bytes a rank sends per step and the per-step plan's time. --bundle
writes both inputs into one file (bench/results/sharded_decode.json); --from reads such a file.
"""
import json
import sys


def table(decode, sdpa):
    base = {(r["backend"], r.get("new_per_sequence", 1), r.get("sequences", 32)): r["ms"]
            for r in sdpa["results"] if "ms" in r}
    rows = {}
    for r in decode["benchmarks"]:
        if r.get("run_type") == "aggregate" or not r["name"].startswith("decode/"):
            continue
        parts = r["name"].split("/")
        kernel, ranks, plan = parts[1], int(parts[2]), parts[3] == "1"
        num = [int(x) for x in parts[4:8] if x.isdigit()]
        num += [1, 0, 0, 0][len(num):]  # older files: no layout, shape or element arguments
        new, paged, sequences, fp8 = num[0], num[1] == 1, 1 if num[2] == 1 else 32, num[3]
        key = (kernel, -sequences, paged, fp8, new, ranks)
        rows.setdefault(key, {})["plan" if plan else "step"] = r
    print("| block kernel | cache | new tokens | ranks | step (ms) | PyTorch cuDNN SDPA / step | "
          "step / bf16 step | K/V read (TB/s) | bytes a rank sends | plan (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    elements = {0: "", 1: ", FP8 (head scales)", 2: ", FP8 (page scales)"}
    for (kernel, sequences, paged, fp8, new, ranks), r in sorted(rows.items()):
        step, plan = r.get("step"), r.get("plan")
        if step is None:
            continue
        ms, bf16 = step["real_time"], rows.get((kernel, sequences, paged, 0, new, ranks), {})
        sequences = -sequences
        cache = (("32 x 32K" if sequences == 32 else "1 x 128K") +
                 (", pages of 16" if paged else "") + elements[fp8])
        versus = ms / bf16["step"]["real_time"] if fp8 and "step" in bf16 else float("nan")
        print(f"| {kernel} | {cache} | {new} | {ranks} | {ms:.2f} | "
              f"{base.get(('cudnn', new, sequences), float('nan')) / ms:.2f} | "
              f"{'' if not fp8 else f'{versus:.2f}'} | "
              f"{step['cache_bytes_per_second'] / 1e12:.2f} | {step['bytes_per_rank'] / 1e6:.2f} MB | "
              f"{format(plan['real_time'], '.3f') if plan else ''} |")
    for (name, new, sequences), ms in sorted(base.items(), key=lambda x: (-x[0][2], x[0][1], x[0][0])):
        print(f"\nPyTorch SDPA ({name}) over the whole cache, {sequences} x {new} new: {ms:.3f} ms")


def main(argv):
    if argv[:1] == ["--from"]:
        bundle = json.load(open(argv[1]))
        table(bundle["decode"], bundle["sdpa"])
        return
    decode, sdpa = json.load(open(argv[0])), json.load(open(argv[1]))
    table(decode, sdpa)
    if "--bundle" in argv:
        with open(argv[argv.index("--bundle") + 1], "w") as f:
            json.dump(dict(decode=decode, sdpa=sdpa), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
