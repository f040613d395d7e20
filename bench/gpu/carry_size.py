"""What a device call would carry, summed before anything is sent: the working tree that travels
(tracked files and untracked ones git does not ignore, as the device tool copies them) plus each
carried path, against the tool's 64 MiB, keeping `--room-mib` free.

    python bench/gpu/carry_size.py [--carry .gpu-wheels] [--limit-mib 64] [--room-mib 8] [--json]

Exit status 0 when tree + carried <= limit - room, 1 when not (the largest files are listed, so
the one that grew is plain), 2 when a carried path is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def tree_files(root: Path) -> list[Path]:
    """The files of the working tree that travel (deleted tracked files do not)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, check=True).stdout
    paths = [root / name for name in listed.decode().split("\0") if name]
    shared = root / "shared"
    if shared.is_dir():
        paths += [p for p in shared.rglob("*") if p.is_file()]
    return [p for p in dict.fromkeys(paths) if p.is_file() and not p.is_symlink()]


def carried_files(root: Path, carry: list[str]) -> list[Path]:
    files = []
    for name in carry:
        path = root / name
        if not path.exists():
            raise FileNotFoundError(f"carry: {name} does not exist under {root}")
        files += [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return files


def measure(root: Path, carry: list[str], limit_mib: float, room_mib: float) -> dict:
    tree = tree_files(root)
    carried = carried_files(root, carry)
    sizes = {p: p.stat().st_size for p in (*tree, *carried)}
    tree_bytes = sum(sizes[p] for p in tree)
    carried_bytes = sum(sizes[p] for p in carried)
    total = tree_bytes + carried_bytes
    largest = sorted(sizes, key=sizes.get, reverse=True)[:10]
    return {"tree_bytes": tree_bytes, "carried_bytes": carried_bytes, "total_bytes": total,
            "total_mib": round(total / MIB, 2), "limit_mib": limit_mib, "room_mib": room_mib,
            "fits": total <= (limit_mib - room_mib) * MIB, "carry": carry,
            "largest": [[os.path.relpath(p, root), sizes[p]] for p in largest]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--carry", action="append", default=None,
                        help="a carried path, relative to the repo (repeatable; default "
                             ".gpu-wheels)")
    parser.add_argument("--limit-mib", type=float, default=64.0)
    parser.add_argument("--room-mib", type=float, default=8.0,
                        help="kept free below the limit (default 8)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        result = measure(ROOT, args.carry if args.carry is not None else [".gpu-wheels"],
                         args.limit_mib, args.room_mib)
    except FileNotFoundError as exc:
        print(f"carry_size.py: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"tree {result['tree_bytes'] / MIB:.2f} MiB + carried "
              f"{result['carried_bytes'] / MIB:.2f} MiB = {result['total_mib']:.2f} MiB "
              f"(limit {args.limit_mib:g}, keeping {args.room_mib:g} free): "
              f"{'fits' if result['fits'] else 'DOES NOT FIT'}")
        if not result["fits"]:
            for name, size in result["largest"]:
                print(f"  {size / MIB:8.2f} MiB  {name}")
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
