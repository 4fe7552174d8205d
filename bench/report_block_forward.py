#!/usr/bin/env python3
"""Table and plot of the block-forward benchmark against PyTorch SDPA measured in the same run.

usage: bench/report_block_forward.py OURS.json SDPA.json PLOT.png
Prints a Markdown table (ours merge/plain, cuDNN, flash, ratios) and writes a TFLOP/s-vs-length plot.
Needs matplotlib only for the plot.
"""
import json
import re
import sys


def ours(path):
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        m = re.search(r"tokens:(\d+)/kv_heads:(\d+)/head_dim:(\d+)/causal:(\d)/merge:(\d)", b["name"])
        if not m:
            continue
        s, kvh, d, causal, merge = map(int, m.groups())
        out[(s, kvh, d, bool(causal), bool(merge))] = b["TFLOP/s"] / 1e0
    return out


def sdpa(path):
    out = {}
    for r in json.load(open(path))["results"]:
        if "tflops" in r:
            out[(r["backend"], r["tokens"], r["kv_heads"], r["head_dim"], r["causal"])] = r["tflops"]
    return out


def main(ours_path, sdpa_path, plot_path):
    o, t = ours(ours_path), sdpa(sdpa_path)
    print("| tokens | kv heads | head_dim | mask | ours (merge) | ours (plain) | cuDNN | flash | ours/cuDNN | ours/flash |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in (128, 64):
        for causal in (False, True):
            for kvh in (32, 8):
                for s in (2048, 8192, 32768):
                    m = o.get((s, kvh, d, causal, True))
                    p = o.get((s, kvh, d, causal, False))
                    c = t.get(("cudnn", s, kvh, d, causal))
                    f = t.get(("flash", s, kvh, d, causal))
                    if m is None:
                        continue
                    fmt = lambda x: f"{x:.0f}" if x else "-"
                    print(f"| {s} | {kvh} | {d} | {'causal' if causal else 'full'} | {m:.0f} | {fmt(p)} | "
                          f"{fmt(c)} | {fmt(f)} | {m / c:.2f} | {m / f:.2f} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    lengths = (2048, 8192, 32768)
    for ax, d in zip(axes, (128, 64)):
        for causal, style in ((False, "-"), (True, "--")):
            mask = "causal" if causal else "full"
            ax.plot(lengths, [o[(s, 8, d, causal, True)] for s in lengths], "o" + style, color="C0",
                    label=f"ringattn block kernel, {mask}")
            ax.plot(lengths, [t[("cudnn", s, 8, d, causal)] for s in lengths], "s" + style, color="C1",
                    label=f"SDPA cuDNN, {mask}")
            ax.plot(lengths, [t[("flash", s, 8, d, causal)] for s in lengths], "^" + style, color="C2",
                    label=f"SDPA flash (FA2), {mask}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, ["2K", "8K", "32K"])
        ax.set_title(f"head_dim {d}, 32 q heads : 8 kv heads, bf16")
        ax.set_xlabel("tokens (q = k)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[0].legend(fontsize=7)
    fig.suptitle("Forward attention on one H200 (same run), 2026-11-29")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:4])
