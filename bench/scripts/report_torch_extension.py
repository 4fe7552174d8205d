#!/usr/bin/env python3
"""Table (markdown) of the PyTorch extension on one rank against PyTorch's attention.

usage: report_torch_extension.py TORCH_EXTENSION.json

Reads bench/torch_extension.py's JSON. One row per shape and block kernel of the extension (native,
and cudnn where the run has it); each ratio is the other implementation's time over the
extension's (above 1: the extension is faster), forward and forward + backward, same run.
"""
import json
import sys

#: The extension's rows: its implementation name in the JSON, and the kernel it runs.
KERNELS = (("ringattn_torch", "native"), ("ringattn_torch_cudnn", "cudnn"))
OTHERS = (("sdpa_cudnn", "SDPA cuDNN"), ("sdpa_flash", "SDPA FlashAttention-2"),
          ("torch_context_parallel", "context parallel"))


def main(path):
    with open(path) as f:
        data = json.load(f)
    table = {}
    for r in data["results"]:
        key = (r["tokens"], r["kv_heads"], r["mask"])
        table.setdefault(key, {})[r["implementation"]] = r
    print(f"{data['device']}, PyTorch {data['torch']}, cuDNN {data['cudnn']}, "
          f"commit {data['commit']}\n")
    head = "| tokens | heads (q:kv) | mask | kernel | extension ms (fwd / fwd+bwd) |"
    head += "".join(f" {name} ms | {name} / extension |" for _, name in OTHERS)
    print(head)
    print("|" + "---|" * (5 + 2 * len(OTHERS)))
    for (tokens, kv, mask), runs in sorted(table.items()):
        for impl, kernel in KERNELS:
            ours = runs.get(impl)
            if ours is None or "ms" not in ours:
                continue
            line = (f"| {tokens // 1024}K | 32:{kv} | {mask} | {kernel} | {ours['ms']:.2f} / "
                    f"{ours['ms_forward_backward']:.2f} |")
            for key, _ in OTHERS:
                other = runs.get(key, {})
                if "ms" not in other:
                    line += f" {other.get('error', 'not run')[:40]} | — |"
                    continue
                line += (f" {other['ms']:.2f} / {other['ms_forward_backward']:.2f} |"
                         f" {other['ms'] / ours['ms']:.2f}x / "
                         f"{other['ms_forward_backward'] / ours['ms_forward_backward']:.2f}x |")
            print(line)

if __name__ == "__main__":
    main(sys.argv[1])
