#!/usr/bin/env python3
"""Tables (markdown) and plot of the cuDNN block kernel against the native kernels and PyTorch.

usage: report_cudnn.py RING.json SDPA_FWD.json SDPA_BWD.json SDPA_RING.json [PLOT.png]
       [--bundle OUT.json --commit C --machine M]
       report_cudnn.py --from BUNDLE.json [PLOT.png]

RING.json: bench_ring_forward's Google Benchmark JSON (its cudnn_block, cudnn_atomic_block,
native_block, cudnn_ring, cudnn_atomic_ring and ring_forward rows and single_call); SDPA_*.json: sdpa_baseline.py's JSON (default, --backward
and --ring) from the same device run. --bundle writes all four into one file
(bench/results/cudnn.json), which --from reads back. Every ratio is against PyTorch measured in
that run. The block rows are one rank (a single block, CUDA-event timed) at bench_ring_forward's
shape: bf16, 32 query heads, 8 kv heads, head_dim 128. The backward alone is forward + backward
minus the forward, on both sides (the cuDNN model's forward is the same for both backward
algorithms). Needs matplotlib only for the plot.
"""
import json
import sys


def rows(bench):
    """{(kind, ranks, causal, backward, tokens): ms} of bench_ring_forward's rows."""
    out = {}
    for r in bench["benchmarks"]:
        if r.get("run_type") == "aggregate" or r.get("error_occurred"):
            continue  # a plan the block kernel refused (its reason is in the row)
        parts = r["name"].split("/")
        fields = dict(p.split(":") for p in parts[1:] if ":" in p)
        kind = parts[0]
        if kind == "schedules":
            continue
        if kind.startswith("ring_forward<"):
            kind = "native_ring/" + kind[len("ring_forward<ringattn::"):-1]
        elif kind in ("cudnn_ring", "cudnn_atomic_ring"):
            kind = kind + "/" + parts[1]
        if kind == "single_call":
            key = (kind, 1, fields["causal"] == "1", fields["backward"] == "1", 65536)
        else:
            tokens = int(fields["tokens"]) or 65536
            key = (kind, int(fields["ranks"]), fields["causal"] == "1", fields["backward"] == "1", tokens)
        out[key] = r["real_time"]
    return out


def flops(tokens, causal, factor):
    return factor * 4 * 32 * tokens * tokens * 128 / (2 if causal else 1)


def block_table(ours, fwd, bwd):
    sdpa_f = {(r["tokens"], r["causal"]): r["ms"] for r in fwd["results"]
              if r["backend"] == "cudnn" and r["kv_heads"] == 8 and r["head_dim"] == 128 and "ms" in r}
    sdpa_b = {(r["tokens"], r["causal"]): (r["ms"], r["ms_forward_backward"]) for r in bwd["results"]
              if r["backend"] == "cudnn" and r["kv_heads"] == 8 and "ms" in r}
    lines = ["| tokens | mask | pass | native TFLOP/s | cuDNN model | cuDNN model, atomic | PyTorch cuDNN | "
             "native / PyTorch | **cuDNN model / PyTorch** | **atomic / PyTorch** |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    plot = []
    for causal in (False, True):
        for s in (2048, 8192, 32768):
            if (s, causal) not in sdpa_f or (s, causal) not in sdpa_b:
                continue
            mask = "causal" if causal else "full"
            got = {}
            for kind in ("native_block", "cudnn_block"):
                f = ours.get((kind, 1, causal, False, s))
                fb = ours.get((kind, 1, causal, True, s))
                if f is None or fb is None:
                    break
                got[kind] = {"forward": f, "backward": fb - f, "forward + backward": fb}
            if len(got) < 2:
                continue
            afb = ours.get(("cudnn_atomic_block", 1, causal, True, s))
            f = got["cudnn_block"]["forward"]
            got["atomic"] = {"forward": f, "backward": (afb - f) if afb else None,
                             "forward + backward": afb}
            torch = {"forward": sdpa_f[(s, causal)], "backward": sdpa_b[(s, causal)][0],
                     "forward + backward": sdpa_b[(s, causal)][1]}
            for p, factor in (("forward", 1.0), ("backward", 2.5), ("forward + backward", 3.5)):
                tf = {k: (flops(s, causal, factor) / (ms * 1e9) if ms else None)
                      for k, ms in (("native", got["native_block"][p]), ("cudnn", got["cudnn_block"][p]),
                                    ("atomic", got["atomic"][p]), ("torch", torch[p]))}
                at = "-" if tf["atomic"] is None else f"{tf['atomic']:.0f}"
                at_ratio = "-" if tf["atomic"] is None else f"**{tf['atomic'] / tf['torch']:.2f}**"
                lines.append(f"| {s // 1024}K | {mask} | {p} | {tf['native']:.0f} | {tf['cudnn']:.0f} | {at} | "
                             f"{tf['torch']:.0f} | {tf['native'] / tf['torch']:.2f} | "
                             f"**{tf['cudnn'] / tf['torch']:.2f}** | {at_ratio} |")
                if p != "forward + backward":
                    plot.append((f"{s // 1024}K {mask}\n{p}", tf["native"], tf["cudnn"], tf["atomic"],
                                 tf["torch"]))
    return "\n".join(lines), plot


def ring_table(ours, whole):
    torch = {(r["causal"], r["pass_"] == "forward_backward"): r["ms"] for r in whole["results"]}
    lines = ["| layout | pass | PyTorch cuDNN, one call (ms) | backward algorithm | cuDNN model P = 1 (ms) | "
             "P = 4 | P = 8 | native P = 8 | cuDNN model P = 4 / PyTorch | "
             "**cuDNN model P = 8 / PyTorch** | native P = 8 / PyTorch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for layout, causal in (("zigzag", True), ("contiguous", False)):
        for backward, kind, algorithm in ((False, "cudnn_ring", "-"), (True, "cudnn_ring", "deterministic"),
                                          (True, "cudnn_atomic_ring", "atomic")):
            one = torch.get((causal, backward))
            at = [ours.get((f"{kind}/{layout}", p, causal, backward, 65536)) for p in (1, 4, 8)]
            native = ours.get((f"native_ring/{layout}", 8, causal, backward, 65536))
            if one is None or at[2] is None:
                continue
            ms = lambda x: "-" if x is None else f"{x:.1f}"
            ratio = lambda x: "-" if x is None else f"{one / x:.2f}"
            lines.append(f"| {layout} {'causal' if causal else 'full'} | "
                         f"{'forward + backward' if backward else 'forward'} | {one:.1f} | {algorithm} | "
                         f"{ms(at[0])} | {ms(at[1])} | {ms(at[2])} | {ms(native)} | {ratio(at[1])} | "
                         f"**{one / at[2]:.2f}** | {ratio(native)} |")
    return "\n".join(lines)


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    opts = {}
    for flag in ("--bundle", "--commit", "--machine", "--from"):
        if flag in args:
            i = args.index(flag)
            opts[flag] = args[i + 1]
            del args[i:i + 2]
    if "--from" in opts:
        bundle = json.load(open(opts["--from"]))
        plot_path = args[0] if args else None
    else:
        names = ("ring_forward", "sdpa_forward", "sdpa_backward", "sdpa_ring")
        bundle = {n: json.load(open(p)) for n, p in zip(names, args[:4])}
        bundle["commit"] = opts.get("--commit", "")
        bundle["machine"] = opts.get("--machine", "")
        plot_path = args[4] if len(args) > 4 else None
        if "--bundle" in opts:
            with open(opts["--bundle"], "w") as f:
                json.dump(bundle, f, indent=1)
    ours = rows(bundle["ring_forward"])
    text, plot = block_table(ours, bundle["sdpa_forward"], bundle["sdpa_backward"])
    print(f"{bundle.get('machine', '')}; commit {bundle.get('commit', '')}\n")
    print(text + "\n")
    print(ring_table(ours, bundle["sdpa_ring"]))
    if plot_path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(10, 4))
        x = range(len(plot))
        w = 0.27
        labels = ("ringattn native", "ringattn cuDNN model", "ringattn cuDNN model, atomic",
                  "PyTorch SDPA (cuDNN)")
        w = 0.2
        for i, label in enumerate(labels):
            ax.bar([v + (i - 1.5) * w for v in x], [s[i + 1] or 0 for s in plot], w, label=label)
        ax.set_xticks(list(x))
        ax.set_xticklabels([s[0] for s in plot], fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title("One block, bf16, 32:8 heads, head_dim 128, H200 (same run)")
        ax.set_ylim(0, 1.18 * max(max(v for v in s[1:] if v) for s in plot))
        ax.legend(fontsize=8, loc="upper center", ncol=4)
        fig.tight_layout()
        fig.savefig(plot_path, dpi=110)


if __name__ == "__main__":
    main()
