#!/usr/bin/env python3
"""Table and scaling plot of a bench/scripts/run_multi_gpu.sh run .

usage: bench/scripts/report_multi_gpu.py OUT_DIR|BUNDLE.json [PLOT.png] [--bundle BUNDLE.json]

OUT_DIR is what bench/scripts/run_multi_gpu.sh wrote ($OUT); --bundle writes its files (ring_nccl_P.json,
torch_cp.json, block_local.json, log.txt) into one JSON for bench/results/, which the report also
reads.

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


def load(out):
    """The run's files by name, from a directory or a bundle."""
    if out.endswith(".json"):
        return json.load(open(out))["files"]
    files = {}
    for f in sorted(glob.glob(out + "/*")):
        name = f.rsplit("/", 1)[1]
        if not name.endswith((".json", ".txt")):
            continue
        files[name] = json.load(open(f)) if name.endswith(".json") else open(f).read()
    return files


def ring_results(files):
    rows = {}
    bandwidth = {}
    for name, data in files.items():
        m = re.match(r"ring_nccl_(\d+)\.json", name)
        if not m:
            continue
        p = int(m.group(1))
        for b in data["benchmarks"]:
            m = re.match(r"ring_nccl<ringattn::(\w+)>/tokens_per_gpu:(\d+)/causal:(\d)/comm:(\d)",
                         b["name"])
            if m:
                part, tok, causal, comm = m.group(1), int(m.group(2)), m.group(3) == "1", m.group(4) == "1"
                rows[(p, part, tok, causal, comm)] = (b["real_time"], b["TFLOP/s/GPU"] / 1e12)
            m = re.match(r"ring_exchange/tokens_per_gpu:(\d+)", b["name"])
            if m:
                bandwidth[(p, int(m.group(1)))] = b["GB/s"]
    return rows, bandwidth


def block_local(files):
    res = {}
    for b in files["block_local.json"]["benchmarks"]:
        m = re.search(r"tokens:(\d+)/kv_heads:8/head_dim:128/causal:(\d)/merge:1/path:1", b["name"])
        if m and "TFLOP/s" in b:
            res[(int(m.group(1)), m.group(2) == "1")] = b["TFLOP/s"]
    return res


def training_results(files):
    """Forward + backward rows: (P, layout, tokens/GPU, causal) -> (ms, TFLOP/s per GPU)."""
    rows = {}
    for name, data in files.items():
        m = re.match(r"ring_nccl_(\d+)\.json", name)
        if not m:
            continue
        for b in data["benchmarks"]:
            t = re.match(r"ring_nccl_training<ringattn::(\w+)>/tokens_per_gpu:(\d+)/causal:(\d)",
                         b["name"])
            if t and "TFLOP/s/GPU" in b:
                rows[(int(m.group(1)), t.group(1), int(t.group(2)), t.group(3) == "1")] = (
                    b["real_time"], b["TFLOP/s/GPU"] / 1e12)
    return rows


def block_training_local(files, forward):
    """Our block kernel's forward + backward TFLOP/s at the local size (3.5x the forward's FLOPs
    over the forward's time plus the backward's)."""
    res = {}
    data = files.get("block_backward_local.json")
    if not data:
        return res
    for b in data["benchmarks"]:
        m = re.search(r"tokens:(\d+)/kv_heads:8/causal:(\d)", b["name"])
        if m and "TFLOP/s" in b:
            key = (int(m.group(1)), m.group(2) == "1")
            if key in forward:
                res[key] = 3.5 / (1.0 / forward[key] + 2.5 / b["TFLOP/s"])
    return res


def torch_cp(files):
    res = {}
    runs = files.get("torch_cp.json", {}).get("runs", {})
    for p, run in runs.items():
        for r in run["results"]:
            if "tflops_per_gpu" in r:
                res[(int(p), r["tokens_per_gpu"], r["causal"])] = r["tflops_per_gpu"]
    return res


def main(out, plot=None, bundle=None):
    files = load(out)
    if bundle:
        log = files.get("log.txt", "")
        head = dict(date=log.splitlines()[0] if log else "", machine="nvidia-h200-x2 or larger",
                    command="RINGATTN_PHASE=bench bash bench/scripts/run_multi_gpu.sh; "
                            "python3 bench/scripts/report_multi_gpu.py OUT --bundle THIS")
        json.dump(dict(about=head, files=files), open(bundle, "w"), indent=1)
    rows, bw = ring_results(files)
    single = block_local(files)
    cp = torch_cp(files)
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
    training = training_results(files)
    curves_t = {}
    if training:
        single_t = block_training_local(files, single)
        cp_t = {}
        for p, run in files.get("torch_cp.json", {}).get("runs", {}).items():
            for r in run["results"]:
                if "tflops_per_gpu_forward_backward" in r:
                    cp_t[(int(p), r["tokens_per_gpu"], r["causal"])] = r["tflops_per_gpu_forward_backward"]
        print()
        print("| P | layout | mask | tokens/GPU | forward+backward TFLOP/s/GPU | efficiency | "
              "PyTorch CP TFLOP/s/GPU | PyTorch efficiency |")
        print("|---|---|---|---|---|---|---|---|")
        for (p, part, tok, causal), (ms, tf) in sorted(training.items()):
            eff = tf / single_t[(tok, causal)] if (tok, causal) in single_t else None
            c = cp_t.get((p, tok, causal))
            c1 = cp_t.get((1, tok, causal))
            ceff = c / c1 if c and c1 else None
            print(f"| {p} | {part} | {'causal' if causal else 'full'} | {tok} | {tf:.0f} | "
                  f"{'-' if eff is None else f'{eff:.3f}'} | {'-' if c is None else f'{c:.0f}'} | "
                  f"{'-' if ceff is None else f'{ceff:.3f}'} |")
            curves_t.setdefault((part, tok, causal), {})[p] = eff
            if part == "zigzag":
                curves_t.setdefault(("pytorch", tok, causal), {})[p] = ceff
    for (p, tok), g in sorted(bw.items()):
        print(f"ring send/recv, P = {p}, {tok} tokens/GPU block: {g:.1f} GB/s per rank")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        panels = [("forward", curves)] + ([("forward + backward", curves_t)] if curves_t else [])
        fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), squeeze=False)
        colors = {"zigzag": "tab:blue", "round_robin": "tab:green", "contiguous": "tab:orange",
                  "pytorch": "tab:red"}
        for ax, (title, cv) in zip(axes[0], panels):
            for (part, tok, causal), pts in sorted(cv.items()):
                xs = [p for p in counts if pts.get(p)]
                if not xs:
                    continue
                # colour: layout (PyTorch CP in red); line: solid causal, dashed full; marker: size
                ax.plot(xs, [pts[p] for p in xs],
                        ("o" if tok < 32768 else "s") + ("-" if causal else "--"),
                        color=colors[part],
                        label=f"{'PyTorch CP' if part == 'pytorch' else 'ringattn ' + part}, "
                              f"{'causal' if causal else 'full'}, {tok // 1024}K/GPU")
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(p) for p in counts])
            ax.set_xlabel("GPUs (P)")
            ax.set_ylabel("parallel efficiency")
            ax.set_title(title)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)


if __name__ == "__main__":
    args = sys.argv[1:]
    bundle = None
    if "--bundle" in args:
        i = args.index("--bundle")
        bundle = args[i + 1]
        del args[i:i + 2]
    main(args[0], args[1] if len(args) > 1 else None, bundle)
