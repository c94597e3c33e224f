#!/usr/bin/env python3
"""Checks the size limits of docs/ARCHITECTURE.md ("Rooms") on the crates'
non-test source: every file at most 600 lines, the scheduler at most 300, each
model architecture at most 400. `#[cfg(test)]` modules do not count.

Usage: tools/check_room_sizes.py [--list]   (exit 1 when a limit is broken)
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_LIMIT = 600
# Files with a tighter limit than the default.
LIMITS = {
    "worker/core/src/scheduler.rs": 300,
}
# Model architecture files: one per family; shared layers live in layers.rs.
ARCH_LIMIT = 400
ARCH_FILES = re.compile(r"^worker/src/models/(llama|mistral|qwen2|qwen3)\.rs$")
# Kernel files whose bulk is one instruction set's code may exceed the default.
ISA_FILES = re.compile(r"^kernels/src/cpu/.*(avx2|avx512|neon|asm).*\.rs$")


def non_test_lines(path: pathlib.Path) -> int:
    lines = path.read_text().splitlines()
    count, i = 0, 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped == "#[cfg(test)]":
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and re.match(r"\s*(pub(\(\w+\))?\s+)?mod\s+\w+\s*\{\s*$", lines[j]):
                indent = lines[j][: len(lines[j]) - len(lines[j].lstrip())]
                k = j + 1
                while k < len(lines) and lines[k].rstrip() != indent + "}":
                    k += 1
                i = k + 1
                continue
            if j < len(lines) and re.match(r"\s*(pub(\(\w+\))?\s+)?mod\s+\w+\s*;", lines[j]):
                i = j + 1
                continue
        count += 1
        i += 1
    return count


def limit_for(rel: str) -> int | None:
    if rel in LIMITS:
        return LIMITS[rel]
    if ARCH_FILES.match(rel):
        return ARCH_LIMIT
    if ISA_FILES.match(rel):
        return None
    return DEFAULT_LIMIT


def main() -> int:
    failures, rows = [], []
    for crate in ["common", "kernels", "worker", "coordinator"]:
        for path in sorted((ROOT / crate).rglob("*.rs")):
            rel = path.relative_to(ROOT).as_posix()
            if "/tests/" in rel or "/benches/" in rel or rel.endswith("/tests.rs") or "/target/" in rel:
                continue
            n = non_test_lines(path)
            limit = limit_for(rel)
            rows.append((n, rel, limit))
            if limit is not None and n > limit:
                failures.append(f"{rel}: {n} non-test lines (limit {limit})")
    if "--list" in sys.argv:
        for n, rel, limit in sorted(rows, reverse=True):
            print(f"{n:6} {rel}" + ("" if limit is not None else "  (ISA kernel, no limit)"))
    for f in failures:
        print(f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
