"""The one place rekv reads its environment: every `REKV_*` variable goes through `get`.

What each variable sets:
- `REKV_MODEL`, `REKV_DEVICE`, `REKV_DTYPE`, `REKV_TORCH_THREADS`: the runtime settings
  (`rekv_core.settings.RuntimeSettings.from_env`), also of the services;
- `REKV_<FIELD>` for every other field of the services' settings (`services.settings`), e.g.
  `REKV_MAX_PROMPT_TOKENS`, or `REKV_QUALITY` (a request's quality setting where it sets none:
  lossless or gated); a command-line flag wins over it;
- `REKV_MODEL_CACHE`: where converted weights are kept (`model.conversion_cache`);
- `REKV_PROFILE_CACHE`: where machine profiles are kept (`plan.profile_cache`);
- `REKV_COMMIT`, `REKV_TREE_CLEAN` (1 or 0): the commit a benchmark records where the tree is
  not a git checkout, and whether the copy equals it (`bench/gpu/tree_manifest.py` sets both).
An empty variable counts as unset.
"""

from __future__ import annotations

import os

PREFIX = "REKV_"


def get(name: str) -> str | None:
    """The variable `name` (a `REKV_*` name), or None when it is unset or empty."""
    if not name.startswith(PREFIX):
        raise ValueError(f"environment: rekv reads only {PREFIX}* variables, not {name!r}")
    return os.environ.get(name) or None
