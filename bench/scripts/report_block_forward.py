#!/usr/bin/env python3
"""Table and plot of the block-forward benchmark against PyTorch SDPA measured in the same run.

usage: bench/scripts/report_block_forward.py OURS.json SDPA.json PLOT.png
Prints a Markdown table (the wgmma kernel merged and plain, the mma.sync kernel merged, cuDNN,
flash, ratios, merge cost) and writes a TFLOP/s-vs-length plot. Results without a "path" field
(runs before the wgmma kernel existed) count as the mma.sync kernel.
Needs matplotlib only for the plot.
"""
import json
import re
import sys


def ours(path):
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        m = re.search(r"tokens:(\d+)/kv_heads:(\d+)/head_dim:(\d+)/causal:(\d)/merge:(\d)(?:/path:(\d))?",
                      b["name"])
        if not m or "TFLOP/s" not in b:
            continue
        s, kvh, d, causal, merge = map(int, m.groups()[:5])
        path = "wgmma" if m.group(6) == "1" else "mma_sync"
        out[(s, kvh, d, bool(causal), bool(merge), path)] = b["TFLOP/s"]
    return out


def sdpa(path):
    out = {}
    for r in json.load(open(path))["results"]:
        if "tflops" in r:
            out[(r["backend"], r["tokens"], r["kv_heads"], r["head_dim"], r["causal"])] = r["tflops"]
    return out


def main(ours_path, sdpa_path, plot_path):
    o, t = ours(ours_path), sdpa(sdpa_path)
    print("| tokens | kv heads | head_dim | mask | wgmma (merge) | wgmma (plain) | mma.sync (merge) "
          "| cuDNN | flash | wgmma/cuDNN | wgmma/flash | merge cost |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x: f"{x:.0f}" if x else "-"
    for d in (128, 64):
        for causal in (False, True):
            for kvh in (32, 8):
                for s in (2048, 8192, 32768):
                    w = o.get((s, kvh, d, causal, True, "wgmma"))
                    wp = o.get((s, kvh, d, causal, False, "wgmma"))
                    m = o.get((s, kvh, d, causal, True, "mma_sync"))
                    c = t.get(("cudnn", s, kvh, d, causal))
                    f = t.get(("flash", s, kvh, d, causal))
                    best = w or m
                    if best is None:
                        continue
                    ratio = lambda x, y: f"{x / y:.2f}" if x and y else "-"
                    cost = f"{(1 - w / wp) * 100:.1f}%" if w and wp else "-"
                    print(f"| {s} | {kvh} | {d} | {'causal' if causal else 'full'} | {fmt(w)} | {fmt(wp)} | "
                          f"{fmt(m)} | {fmt(c)} | {fmt(f)} | {ratio(best, c)} | {ratio(best, f)} | {cost} |")
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
            for path, color in (("wgmma", "C0"), ("mma_sync", "C3")):
                ys = [o.get((s, 8, d, causal, True, path)) for s in lengths]
                if all(ys):
                    ax.plot(lengths, ys, "o" + style, color=color, label=f"ringattn {path}, {mask}")
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
    date = json.load(open(ours_path))["context"].get("date", "")[:10]
    fig.suptitle(f"Forward attention on one H200 (same run), {date}")
    fig.tight_layout()
    fig.savefig(plot_path, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:4])
