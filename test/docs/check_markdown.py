#!/usr/bin/env python3
"""Checks the project's Markdown as GitHub renders it: every table row has as many cells as its
header (GitHub drops the cells beyond the header's and leaves missing ones empty), and every
relative link names a file or folder that exists and, with a #fragment, a heading of that file.

Usage: check_markdown.py ROOT [FILE.md ...]   (default: README.md, CHANGELOG.md, docs/*.md,
examples/**/README.md, bench/**/README.md, python/README.md under ROOT). Exit 1 with one line per
fault."""

import functools
import pathlib
import re
import sys

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
DELIMITER = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def cells(row: str) -> int:
    """Cells of a table row: split on pipes not escaped by a backslash (GitHub splits inside code
    spans too), without the outer pipes."""
    body = row.strip()
    if body.startswith("|"):
        body = body[1:]
    if body.endswith("|") and not body.endswith("\\|"):
        body = body[:-1]
    return len(re.split(r"(?<!\\)\|", body))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: pathlib.Path) -> frozenset:
    """The fragments GitHub gives `path`'s headings (read once per file)."""
    seen, out = {}, set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def check(path: pathlib.Path, root: pathlib.Path) -> list:
    faults = []
    lines = path.read_text(encoding="utf-8").splitlines()
    fenced = False
    header = None  # the cell count of the table being read
    for i, line in enumerate(lines, start=1):
        if FENCE.match(line):
            fenced = not fenced
            header = None
            continue
        if fenced:
            continue
        stripped = line.strip()
        if header is None:
            if stripped.startswith("|") and i < len(lines) and DELIMITER.match(lines[i]):
                header = cells(stripped)
        elif stripped.startswith("|"):
            if not DELIMITER.match(stripped) and cells(stripped) != header:
                faults.append(f"{path.relative_to(root)}:{i}: a table row of {cells(stripped)} "
                              f"cells under a header of {header}")
        else:
            header = None
        for m in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m.group(1) or m.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("<"):
                continue  # a URL (http:, https:, mailto:) or a placeholder
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                faults.append(f"{path.relative_to(root)}:{i}: the link '{target}' names no file")
                continue
            if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                faults.append(f"{path.relative_to(root)}:{i}: the link '{target}' names no "
                              f"heading of {dest.relative_to(root)}")
    return faults


def main() -> int:
    root = pathlib.Path(sys.argv[1]).resolve()
    if len(sys.argv) > 2:
        files = [pathlib.Path(f).resolve() for f in sys.argv[2:]]
    else:
        files = [root / "README.md", root / "CHANGELOG.md"]
        files += sorted((root / "docs").glob("*.md"))
        for folder in ("examples", "bench", "python"):
            files += sorted((root / folder).glob("**/README.md"))
    faults = []
    for f in files:
        if f.exists():
            faults += check(f, root)
    for fault in faults:
        print(fault)
    print(f"{len(files)} files checked, {len(faults)} faults")
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
