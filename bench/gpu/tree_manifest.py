"""Which commit a copied working tree is, where there is no git: the lent GPU machine gets the
files of this checkout but not its `.git`.

    python bench/gpu/tree_manifest.py write [FILE]    here, before the device call (default
                                                      .gpu-manifest.json, carried with the call)
    python bench/gpu/tree_manifest.py verify [FILE]   there, first thing in bench/gpu/run.sh:
                                                      prints REKV_COMMIT=... and REKV_TREE_CLEAN=...

`write` records HEAD's commit, whether the checkout is clean (no tracked file differs from HEAD)
and HEAD's blob id of every tracked file. `verify` hashes every listed file as git does
(sha1 of "blob <size>\\0" + bytes; a symbolic link's target) and calls the copy clean only when
the checkout was clean and every file is there with its commit's bytes; it prints the variables
that `rekv_cli.bench.provenance` reads where there is no checkout, so every result of the run
names that commit and says whether the tree was clean. Files listed as differing go to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ".gpu-manifest.json"


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout


def blob_id(path: Path) -> str:
    data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write(root: Path, out: Path) -> dict:
    """The manifest of the checkout at `root`, written to `out`."""
    files = {}
    for line in _git(root, "ls-files", "-s", "-z").split("\0"):
        if line:
            meta, path = line.split("\t", 1)
            files[path] = meta.split()[1]
    manifest = {"commit": _git(root, "rev-parse", "HEAD").strip(),
                "checkout_clean": not _git(root, "status", "--porcelain",
                                           "--untracked-files=no").strip(),
                "files": files}
    out.write_text(json.dumps(manifest, indent=0))
    return manifest


def verify(manifest: dict, root: Path) -> dict:
    """`commit`, `tree_clean` and the `differing` files of the copy at `root`."""
    differing = [path for path, blob in manifest["files"].items()
                 if not (root / path).is_file() and not (root / path).is_symlink()
                 or blob_id(root / path) != blob]
    return {"commit": manifest["commit"],
            "tree_clean": manifest["checkout_clean"] and not differing, "differing": differing}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("what", choices=("write", "verify"))
    parser.add_argument("file", nargs="?", default=DEFAULT)
    args = parser.parse_args()
    path = Path(args.file) if Path(args.file).is_absolute() else ROOT / args.file
    if args.what == "write":
        manifest = write(ROOT, path)
        print(f"{path}: commit {manifest['commit']}, {len(manifest['files'])} files, checkout "
              f"{'clean' if manifest['checkout_clean'] else 'NOT clean'}")
        return 0
    result = verify(json.loads(path.read_text()), ROOT)
    for name in result["differing"][:20]:
        print(f"tree_manifest: differs from {result['commit'][:12]}: {name}", file=sys.stderr)
    print(f"REKV_COMMIT={result['commit']}")
    print(f"REKV_TREE_CLEAN={1 if result['tree_clean'] else 0}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
