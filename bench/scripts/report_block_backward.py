#!/usr/bin/env python3
"""Table (markdown) and plot of a recorded block-backward bundle.

usage: report_block_backward.py BUNDLE.json [PLOT.png]

BUNDLE is bench/results/block_backward.json's format: a list of runs, each with
bench_block_backward's Google Benchmark rows, sdpa_baseline.py --backward's JSON from the same
run, and bench_ring_forward's forward+backward rows. The table uses the first run; ratios
are against PyTorch measured in that run (a run without ring rows prints no ring table). Needs
matplotlib only for the plot.
"""
import json
import sys

# bench_block_backward's "path" argument. Older runs (path 2 the only wgmma one) name theirs "wgmma".
PATHS = {"0": "CUDA cores", "1": "mma.sync", "2": "wgmma x1", "3": "wgmma x2", "4": "wgmma x3 (producer)",
         "5": "wgmma five-product"}


def params(name):
    """tokens, kv_heads, causal, path, kernels (0: the whole backward) of a row name."""
    fields = dict(p.split(":") for p in name.split("/")[1:] if ":" in p)
    return (int(fields["tokens"]), int(fields["kv_heads"]), fields["causal"] == "1", fields["path"],
            int(fields.get("kernels", 0)))


def table(run):
    sdpa = {(r["backend"], r["tokens"], r["kv_heads"], r["causal"]): r["tflops"]
            for r in run["sdpa_backward"]["results"]}
    lines = ["| tokens | kv heads | mask | kernels | TFLOP/s | cuDNN | flash | / cuDNN | / flash |",
             "|---|---|---|---|---|---|---|---|---|"]
    shapes = []
    # The plot shows the default path (wgmma x3, "4") where the run has it, else the highest.
    paths = {params(r["name"])[3] for r in run["block_backward"]}
    best = "4" if "4" in paths else max(paths)
    for row in run["block_backward"]:
        s, kv, causal, path, kernels = params(row["name"])
        if ("cudnn", s, kv, causal) not in sdpa or kernels != 0:
            continue
        cudnn, flash, ours = sdpa[("cudnn", s, kv, causal)], sdpa[("flash", s, kv, causal)], row["TFLOP/s"]
        lines.append(f"| {s // 1024}K | {kv} | {'causal' if causal else 'full'} | {PATHS[path]} | "
                     f"{ours:.0f} | {cudnn:.0f} | {flash:.0f} | **{ours / cudnn:.2f}** | "
                     f"{ours / flash:.2f} |")
        if path == best:
            shapes.append((f"{s // 1024}K {kv}kv {'causal' if causal else 'full'}", ours, cudnn, flash))
    return "\n".join(lines), shapes


def ring(run):
    """The ring forward + backward table, or "" for a run that did not time the ring."""
    rows = {r["name"].split("/iterations")[0]: r["real_time"]
            for r in run.get("ring_forward_backward", [])}
    if not rows:
        return ""
    lines = ["| layout | single call ms | P = 1 ms | P = 4 | P = 8 | P = 8 / single |", "|---|---|---|---|---|---|"]
    for layout, causal in (("zigzag", 1), ("contiguous", 0)):
        single = rows.get(f"single_call/causal:{causal}/backward:1")
        at = [rows.get(f"ring_forward<ringattn::{layout}>/ranks:{p}/causal:{causal}/backward:1")
              for p in (1, 4, 8)]
        if single is None or None in at:
            continue
        lines.append(f"| {layout} {'causal' if causal else 'full'} | {single:.0f} | {at[0]:.0f} | "
                     f"{at[1]:.0f} | {at[2]:.0f} | **{single / at[2]:.2f}** |")
    return "\n".join(lines)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    bundle = json.load(open(sys.argv[1]))
    run = bundle["runs"][0]
    text, shapes = table(run)
    print(f"{bundle['machine']}; {run['commit']}\n")
    print(text + "\n")
    print(ring(run))
    if len(sys.argv) > 2:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(9, 4))
        x = range(len(shapes))
        w = 0.27
        for i, (label, k) in enumerate((("ringattn (wgmma, producer)", 1), ("PyTorch cuDNN", 2), ("PyTorch flash", 3))):
            ax.bar([v + (i - 1) * w for v in x], [s[k] for s in shapes], w, label=label)
        ax.set_xticks(list(x))
        ax.set_xticklabels([s[0] for s in shapes], rotation=20, fontsize=8)
        ax.set_ylabel("TFLOP/s (backward)")
        gpu = bundle["machine"].split(" (")[0].replace("NVIDIA ", "")
        ax.set_title(f"Block backward, bf16, 32 q heads, head_dim 128, {gpu} (same run)")
        ax.legend(fontsize=8, loc="lower center", ncol=3)
        fig.tight_layout()
        fig.savefig(sys.argv[2], dpi=110)


if __name__ == "__main__":
    main()
