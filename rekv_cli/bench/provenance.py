"""Which code a benchmark result comes from, read once when the run starts.

`provenance()` returns the fields every writer of `bench/results/` records in its result's
meta. It is called first thing in a run, so that a commit made while the run goes on is never
credited with its figures:

- `commit`: the full sha of HEAD of the checkout whose top is `root` (by default `REPO`, the
  checkout holding this package); where `root` is no checkout's top (a copy of the tree on a lent
  machine, an installed package), the `REKV_COMMIT` environment variable the caller set, else
  None;
- `tree_clean`: True when no tracked file differs from HEAD (`git status --porcelain
  --untracked-files=no` lists nothing), False when one does; without a checkout, what
  `REKV_TREE_CLEAN` says (1 or 0: `bench/gpu/tree_manifest.py verify` sets it on the lent
  machine), else None (unknown);
- `started`: when the run started, UTC, ISO 8601 to the second.

A tree that is not clean is logged as a warning: the figures then come from code that the commit
does not name.
"""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

from rekv_core import env

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
COMMIT_ENV = "REKV_COMMIT"
TREE_CLEAN_ENV = "REKV_TREE_CLEAN"


def _git(root: Path, *args: str) -> str | None:
    """The output of `git args` run in `root`, or None where git or the checkout fails it."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def provenance(root: Path | None = None) -> dict:
    """`commit`, `tree_clean` and `started` of a run starting now (see the module's docstring)."""
    root = REPO if root is None else root
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():
        clean = {"1": True, "0": False}.get(env.get(TREE_CLEAN_ENV) or "")
        return {"commit": env.get(COMMIT_ENV), "tree_clean": clean, "started": started}
    commit = _git(root, "rev-parse", "HEAD")
    changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    clean = None if changes is None else not changes
    if clean is False:
        logger.warning("the working tree differs from commit %s in %d tracked file(s): these "
                       "figures come from uncommitted code", commit, len(changes.splitlines()))
    return {"commit": commit, "tree_clean": clean, "started": started}
