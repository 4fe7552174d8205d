#!/usr/bin/env python3
"""Table (markdown) of the extension's decode step (bench/torch_decode.py's JSON) against
PyTorch's cuDNN SDPA over the whole cache, measured in the same job.

usage: report_torch_decode.py TORCH_DECODE.json

Prints, per shape and implementation, the time of a call from an idle GPU (host work included),
the same against SDPA (SDPA's time over ours: above 1 is faster than SDPA), the cache's K/V
bytes read per second, and the time per call back to back.
"""
import json
import sys

NAMES = {"ringattn_torch_slab": "ShardedDecoder, 1 rank, packed cache",
         "ringattn_torch_paged": "ShardedDecoder, 1 rank, pages of 16",
         "ringattn_torch_8_virtual_ranks": "ShardedDecoder, 8 virtual ranks",
         "sdpa_cudnn": "SDPA (cuDNN) over the whole cache"}


def main(path):
    with open(path) as f:
        data = json.load(f)
    shapes = {}
    for r in data["results"]:
        key = (r["sequences"], r["cache_per_sequence"], r["new_per_sequence"])
        shapes.setdefault(key, {})[r["implementation"]] = r
    print(f"{data['device']}, PyTorch {data['torch']}, cuDNN {data['cudnn']}, commit "
          f"{data['commit']}, {data.get('date', '')}\n")
    print("| step | implementation | from idle (ms) | SDPA / ours | K/V read (TB/s) | "
          "back to back (ms) |")
    print("|---|---|---|---|---|---|")
    for (batch, cache, new), rows in shapes.items():
        base = rows.get("sdpa_cudnn", {}).get("ms")
        shape = f"{batch} x {new} new over {batch} x {cache // 1024}K"
        for name, r in rows.items():
            ratio = f"{base / r['ms']:.2f}" if base else ""
            ahead = r.get("back_to_back_ms")
            print(f"| {shape} | {NAMES.get(name, name)} | {r['ms']:.3f} | {ratio} | "
                  f"{r['cache_tb_per_s']:.2f} | {'' if ahead is None else f'{ahead:.3f}'} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
