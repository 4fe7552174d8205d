#!/usr/bin/env python3
"""Table and scaling plot of a bench/run_multi_gpu.sh run (the multi-GPU issue).

usage: bench/report_multi_gpu.py OUT_DIR [PLOT.png]

Parallel efficiency of our ring = its TFLOP/s per GPU (global attention FLOPs / time / P) divided
by our block kernel's TFLOP/s on one GPU at the local size (same mask, merged, wgmma kernel: the
same run's block_local.json). Exposed communication = 1 - time(no exchange) / time(ring), same
run. PyTorch context parallel's efficiency = its TFLOP/s per GPU at P over its own at P = 1.
"""
import glob
import json
import re
import sys

NAMES = {"zigzag": "zigzag", "round_robin": "round_robin", "contiguous": "contiguous"}


def ring_results(out):
    rows = {}
    bandwidth = {}
    for f in glob.glob(out + "/ring_nccl_*.json"):
        p = int(re.search(r"ring_nccl_(\d+)", f).group(1))
        for b in json.load(open(f))["benchmarks"]:
            m = re.match(r"ring_nccl<ringattn::(\w+)>/tokens_per_gpu:(\d+)/causal:(\d)/comm:(\d)",
                         b["name"])
            if m:
                part, tok, causal, comm = m.group(1), int(m.group(2)), m.group(3) == "1", m.group(4) == "1"
                rows[(p, part, tok, causal, comm)] = (b["real_time"], b["TFLOP/s/GPU"])
            m = re.match(r"ring_exchange/tokens_per_gpu:(\d+)", b["name"])
            if m:
                bandwidth[(p, int(m.group(1)))] = b["GB/s"]
    return rows, bandwidth


def block_local(out):
    res = {}
    for b in json.load(open(out + "/block_local.json"))["benchmarks"]:
        m = re.search(r"tokens:(\d+)/kv_heads:8/head_dim:128/causal:(\d)/merge:1/path:1", b["name"])
        if m and "TFLOP/s" in b:
            res[(int(m.group(1)), m.group(2) == "1")] = b["TFLOP/s"]
    return res


def torch_cp(out):
    res = {}
    try:
        runs = json.load(open(out + "/torch_cp.json"))["runs"]
    except FileNotFoundError:
        return res
    for p, run in runs.items():
        for r in run["results"]:
            if "tflops_per_gpu" in r:
                res[(int(p), r["tokens_per_gpu"], r["causal"])] = r["tflops_per_gpu"]
    return res


def main(out, plot=None):
    rows, bw = ring_results(out)
    single = block_local(out)
    cp = torch_cp(out)
    counts = sorted({k[0] for k in rows})
    print("| P | layout | mask | tokens/GPU | TFLOP/s/GPU | efficiency | exposed comm | PyTorch CP TFLOP/s/GPU | PyTorch efficiency |")
    print("|---|---|---|---|---|---|---|---|---|")
    curves = {}
    for (p, part, tok, causal, comm), (ms, tf) in sorted(rows.items()):
        if not comm:
            continue
        eff = tf / single[(tok, causal)] if (tok, causal) in single else None
        quiet = rows.get((p, part, tok, causal, False))
        exposed = 1 - quiet[0] / ms if quiet else None
        c = cp.get((p, tok, causal))
        c1 = cp.get((1, tok, causal))
        ceff = c / c1 if c and c1 else None
        f = lambda x, fmt: fmt.format(x) if x is not None else "-"
        print(f"| {p} | {part} | {'causal' if causal else 'full'} | {tok} | {tf:.0f} | {f(eff, '{:.3f}')} | "
              f"{f(exposed and exposed * 100, '{:.1f}%')} | {f(c, '{:.0f}')} | {f(ceff, '{:.3f}')} |")
        curves.setdefault((part, tok, causal), {})[p] = eff
        if part == "zigzag":
            curves.setdefault(("pytorch", tok, causal), {})[p] = ceff
    for (p, tok), g in sorted(bw.items()):
        print(f"ring send/recv, P = {p}, {tok} tokens/GPU block: {g:.1f} GB/s per rank")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for (part, tok, causal), pts in sorted(curves.items()):
            xs = [p for p in counts if pts.get(p)]
            if not xs:
                continue
            style = "--" if part == "pytorch" else "-"
            ax.plot(xs, [pts[p] for p in xs], "o" + style,
                    label=f"{'PyTorch CP' if part == 'pytorch' else 'ringattn ' + part}, "
                          f"{'causal' if causal else 'full'}, {tok // 1024}K/GPU")
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(p) for p in counts])
        ax.set_xlabel("GPUs (P)")
        ax.set_ylabel("parallel efficiency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
