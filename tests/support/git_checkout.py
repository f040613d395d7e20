"""A throwaway git checkout with one committed file, for the tests of what a result records about
the code it came from (`rekv_cli.bench.provenance`)."""

import subprocess
from pathlib import Path


def git(root: Path, *args: str) -> str:
    """`git args` in `root` (with an identity, so commits need no global configuration)."""
    return subprocess.run(["git", "-c", "user.name=rekv", "-c", "user.email=rekv@example.com",
                           *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def make_checkout(root: Path) -> Path:
    """`root` (made if need be) as a git checkout whose one commit holds `code.py`; a clean
    tree."""
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q")
    (root / "code.py").write_text("FIGURE = 1\n")
    git(root, "add", "code.py")
    git(root, "commit", "-q", "-m", "first")
    return root
