#!/usr/bin/env python3
"""Merge-cost ranges from recorded `block_forward_merge_cost` runs.

usage: bench/scripts/report_merge_cost.py FILE.json [FILE.json ...] [--variant NAME ...]

Each FILE is either a raw Google Benchmark JSON (its runs count as variant "-") or a record of
the form {"about": ..., "runs": [{"variant", "round", "bench", "benchmarks"}, ...]} as kept
in bench/results/. Prints, per variant and shape, how many runs there are and the range of
`merge_cost_pct` (the merging call against plain output, timed alternately), plus the range of
the merging call's own time, which does not depend on how fast another build's plain output ran.
"""
import argparse
import collections
import json
import re


def runs_of(path):
    data = json.load(open(path))
    if "runs" in data:
        for r in data["runs"]:
            yield r.get("variant", "-"), r["benchmarks"]
    else:
        yield "-", data["benchmarks"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--variant", action="append", help="only these variants")
    args = ap.parse_args()
    table = collections.defaultdict(list)
    for path in args.files:
        for variant, benchmarks in runs_of(path):
            if args.variant and variant not in args.variant:
                continue
            for b in benchmarks:
                if "merge_cost_pct" not in b:
                    continue
                shape = re.sub(r"^block_forward_merge_cost/|/iterations:.*$", "", b["name"])
                table[(variant, shape)].append((b["merge_cost_pct"], b["merge_us"]))
    print("| variant | shape | runs | merge cost | merging call (us) |")
    print("|---|---|---|---|---|")
    for (variant, shape), xs in sorted(table.items()):
        pct = [x[0] for x in xs]
        us = [x[1] for x in xs]
        print(f"| {variant} | {shape} | {len(xs)} | {min(pct):.1f} to {max(pct):.1f}% "
              f"| {min(us):.1f}-{max(us):.1f} |")


if __name__ == "__main__":
    main()
