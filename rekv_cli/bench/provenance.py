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
- `started`: when the run started, UTC, ISO 8601 to the second;
- `measures`: the code the figures measure, as the caller declares it (`measures=`): paths
  relative to the repository's top, files or folders. `python -m rekv_cli.bench.staleness` reads
  it to say when a quoted figure went stale (one of those paths changed after `commit`). The
  shared sets below (`SERVICES`, `IN_PROCESS`, `LINK`) are what most benches start from.

A tree that is not clean is logged as a warning: the figures then come from code that the commit
does not name. A declared path missing under `root` is logged too (a copy of the tree without
it); one that is absolute, climbs out of the tree or is empty raises `ValueError`.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from rekv_core import env

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
COMMIT_ENV = "REKV_COMMIT"
TREE_CLEAN_ENV = "REKV_TREE_CLEAN"

# The two services as processes: everything they import (the whole core), started by the launcher
# and called by the client.
SERVICES = ("rekv_core", "services", "rekv_cli/launcher.py", "rekv_cli/client.py")
# `rekv bench link`'s harness over them: the sweep, the router process, the namespaces, the
# balanced rate (timed in process by `handoff.py`) and the statistics.
LINK = (*SERVICES, "rekv_cli/bench/link", "rekv_cli/bench/handoff.py", "rekv_cli/bench/stats.py")
# A handoff in one process over the in-process link: the core it runs, no services.
IN_PROCESS = ("rekv_core/codecs", "rekv_core/handoff", "rekv_core/kernels", "rekv_core/model",
              "rekv_core/transport", "rekv_core/settings.py", "rekv_core/streams.py",
              "rekv_core/timing.py")


def _git(root: Path, *args: str) -> str | None:
    """The output of `git args` run in `root`, or None where git or the checkout fails it."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def checked_measures(root: Path, measures: Sequence[str]) -> list[str]:
    """`measures` as a list in their order, without repeats: ValueError unless there is at
    least one and each is a relative path inside the tree; a warning for each that `root` does
    not hold."""
    if isinstance(measures, str) or not measures:
        raise ValueError(f"measures: give the paths the figures measure, got {measures!r}")
    for path in measures:
        pure = PurePosixPath(path)
        if not path or pure.is_absolute() or ".." in pure.parts or "\\" in path:
            raise ValueError(f"measures: {path!r} is not a relative path inside the tree")
        if not (Path(root) / path).exists():
            logger.warning("measures: %s is not under %s", path, root)
    return list(dict.fromkeys(measures))


def provenance(root: Path | None = None, *, measures: Sequence[str]) -> dict:
    """`commit`, `tree_clean`, `started` and `measures` of a run starting now (see the module's
    docstring)."""
    root = REPO if root is None else root
    measured = checked_measures(root, measures)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(root).resolve():
        clean = {"1": True, "0": False}.get(env.get(TREE_CLEAN_ENV) or "")
        return {"commit": env.get(COMMIT_ENV), "tree_clean": clean, "started": started,
                "measures": measured}
    commit = _git(root, "rev-parse", "HEAD")
    changes = _git(root, "status", "--porcelain", "--untracked-files=no")
    clean = None if changes is None else not changes
    if clean is False:
        logger.warning("the working tree differs from commit %s in %d tracked file(s): these "
                       "figures come from uncommitted code", commit, len(changes.splitlines()))
    return {"commit": commit, "tree_clean": clean, "started": started, "measures": measured}
