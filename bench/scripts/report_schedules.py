#!/usr/bin/env python3
"""Table (markdown) and plot of the schedules: the ring, the all-gather, the all-to-all and the
hybrid (all-to-all in groups of 4, K/V gathered across the 2 groups).

usage: report_schedules.py SCHEDULES.json [PLOT.png]

SCHEDULES.json: bench_ring_forward's Google Benchmark JSON with its schedules/ rows (8 virtual
ranks on one GPU, zigzag causal, bf16, 32 query heads, head_dim 128, 8 or 32 kv heads, 8K-64K
tokens, forward and forward + backward). Prints one row per shape: each schedule's time, the
ring's time over each other's (> 1: faster than the ring), and the bytes a rank sends in the
forward on each (the formulas of docs/guides.md, "Choosing a schedule"). Needs matplotlib only
for the plot.
"""
import json
import sys

RANKS, Q_HEADS, HEAD_DIM, ELEMENT, GROUP = 8, 32, 128, 2, 4
SCHEDULES = [("ring", "ring"), ("all_gather", "all-gather"), ("all_to_all", "all-to-all"),
             ("hybrid_4x2", "hybrid 4x2")]


def rows(bench):
    """{(schedule, kv_heads, backward, tokens): ms} of the schedules/ rows."""
    out = {}
    for r in bench["benchmarks"]:
        if r.get("run_type") == "aggregate" or not r["name"].startswith("schedules/"):
            continue
        parts = r["name"].split("/")
        fields = dict(p.split(":") for p in parts if ":" in p)
        schedule, kv = parts[1], int(parts[3][2:])
        out[(schedule, kv, fields["backward"] == "1", int(fields["tokens"]))] = r["real_time"]
    return out


def forward_bytes(schedule, kv, tokens):
    """Bytes one rank sends in the forward (equal shards, bf16, lse included)."""
    n, p, h, d, e = tokens // RANKS, RANKS, Q_HEADS, HEAD_DIM, ELEMENT
    if schedule in ("ring", "all_gather"):
        return (p - 1) * n * 2 * kv * d * e
    a = p if schedule == "all_to_all" else GROUP
    kv_per = max(kv, a) // a
    inside = (a - 1) * n * (h // a) * (2 * d * e + 4)  # q out, output and lse back
    return inside + (p - 1) * n * kv_per * 2 * d * e  # K/V to every other rank


def table(got):
    names = [s for s, _ in SCHEDULES if any(k[0] == s for k in got)]
    head = " | ".join(f"{label} ms" for s, label in SCHEDULES if s in names)
    ratios = " | ".join(f"ring / {label}" for s, label in SCHEDULES if s in names and s != "ring")
    sent = " / ".join(label for s, label in SCHEDULES if s in names)
    lines = [f"| kv heads | tokens | pass | {head} | {ratios} | MiB sent per rank, fwd ({sent}) |",
             "|" + "---|" * (3 + 2 * len(names) - 1 + 1)]
    plot = []
    for kv in sorted({k[1] for k in got}):
        for backward in (False, True):
            for tokens in sorted({k[3] for k in got}):
                times = [got.get((s, kv, backward, tokens)) for s in names]
                if any(t is None for t in times):
                    continue
                ring = times[0]
                ms = " | ".join(f"{t:.2f}" for t in times)
                rel = " | ".join(f"**{ring / t:.2f}**" for t in times[1:])
                mib = " / ".join(f"{forward_bytes(s, kv, tokens) / 2**20:.0f}" for s in names)
                lines.append(f"| {kv} | {tokens // 1024}K | {'fwd+bwd' if backward else 'fwd'} | "
                             f"{ms} | {rel} | {mib} |")
                for s, t in zip(names[1:], times[1:]):
                    plot.append((s, kv, backward, tokens, ring / t))
    return "\n".join(lines), plot


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    with open(argv[1]) as f:
        got = rows(json.load(f))
    text, plot = table(got)
    print(text)
    if len(argv) > 2:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        labels = dict(SCHEDULES)
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, backward in zip(axes, (False, True)):
            for s in [s for s, _ in SCHEDULES[1:]]:
                for kv, style in ((8, "-"), (32, "--")):
                    pts = sorted((t, r) for x, k, b, t, r in plot if x == s and k == kv and b == backward)
                    if pts:
                        ax.plot([t // 1024 for t, _ in pts], [r for _, r in pts], style, marker="o",
                                label=f"{labels[s]}, 32:{kv}")
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ticks = sorted({t // 1024 for _, _, _, t, _ in plot})
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.set_xlabel("tokens (K), 8 virtual ranks, zigzag causal")
            ax.set_title("forward + backward" if backward else "forward")
        axes[0].set_ylabel("ring time / schedule's time (> 1: faster)")
        axes[1].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(argv[2], dpi=120)


if __name__ == "__main__":
    main(sys.argv)
