"""Small pieces every `rekv` subcommand shares: comma-separated flags and JSON output files."""

from __future__ import annotations

import json
from pathlib import Path


def csv_of(kind):
    """An argparse `type` reading `a,b,c` as a list of `kind`."""
    def parse(text: str):
        return [kind(item) for item in text.split(",") if item]
    return parse


def write_json(path: str | Path | None, payload, indent: int = 2) -> None:
    """Write `payload` to `path` (creating its folder); nothing when `path` is empty."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=indent) + "\n")
