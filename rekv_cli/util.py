"""Small pieces every `rekv` subcommand shares: comma-separated flags and JSON output files."""

from __future__ import annotations

import json
import os
from pathlib import Path


def csv_of(kind):
    """An argparse `type` reading `a,b,c` as a list of `kind`."""
    def parse(text: str):
        return [kind(item) for item in text.split(",") if item]
    return parse


def write_json(path: str | Path | None, payload, indent: int = 2) -> None:
    """Write `payload` to `path` (creating its folder); nothing when `path` is empty. Atomic: a
    reader (or a run killed mid-write) sees the old file or the new one, never half of one."""
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(payload, indent=indent) + "\n")
        os.replace(partial, path)
