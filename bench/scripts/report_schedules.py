#!/usr/bin/env python3
"""Table (markdown) and plot of the ring schedule against the all-gather schedule.

usage: report_schedules.py RING.json [PLOT.png]

RING.json: bench_ring_forward's Google Benchmark JSON with its schedules/ rows (8 virtual ranks
on one GPU, zigzag causal, bf16, 32 query heads, head_dim 128, 8 or 32 kv heads, 8K-64K tokens,
forward and forward + backward). Prints one row per shape: the time of each schedule, their
ratio, and the K/V bytes a rank sends in the forward (the same for both schedules: P - 1 blocks of
a rank's tokens x kv heads x head_dim x 2 tensors x 2 bytes). Needs matplotlib only for the plot.
"""
import json
import sys

RANKS, HEAD_DIM = 8, 128


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


def table(got):
    lines = ["| kv heads | tokens | pass | ring ms | all-gather ms | **ring / all-gather** | "
             "K/V sent per rank (forward) |", "|---|---|---|---|---|---|---|"]
    plot = []
    for kv in sorted({k[1] for k in got}):
        for backward in (False, True):
            for tokens in sorted({k[3] for k in got}):
                ring, gather = got.get(("ring", kv, backward, tokens)), got.get(("all_gather", kv, backward, tokens))
                if ring is None or gather is None:
                    continue
                sent = (RANKS - 1) * (tokens // RANKS) * kv * HEAD_DIM * 2 * 2
                lines.append(f"| {kv} | {tokens // 1024}K | {'fwd+bwd' if backward else 'fwd'} | {ring:.2f} | "
                             f"{gather:.2f} | **{ring / gather:.2f}** | {sent / 2**20:.0f} MiB |")
                plot.append((kv, backward, tokens, ring / gather))
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
        fig, ax = plt.subplots(figsize=(7, 4))
        for kv in sorted({p[0] for p in plot}):
            for backward in (False, True):
                pts = sorted((t, r) for k, b, t, r in plot if k == kv and b == backward)
                if pts:
                    ax.plot([t // 1024 for t, _ in pts], [r for _, r in pts], marker="o",
                            label=f"32:{kv} heads, {'fwd+bwd' if backward else 'fwd'}")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (K), 8 virtual ranks, zigzag causal")
        ax.set_ylabel("ring time / all-gather time")
        ax.set_title("The two schedules (> 1: the all-gather is faster)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(argv[2], dpi=120)


if __name__ == "__main__":
    main(sys.argv)
