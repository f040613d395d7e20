"""Reading the services' logs: `logged_at(text, offset)`, the time of the line holding `offset`,
from the "YYYY-MM-DD HH:MM:SS,mmm" stamp that every line of rekv's log format starts with;
`wait_for_line(path, text, timeout_s)`, the log once it holds `text` (what a service does in the
background may be logged after the request a test made)."""

import time
from datetime import datetime
from pathlib import Path


def logged_at(text: str, offset: int) -> float:
    """Seconds since the epoch (local time, as logged) of the line of `text` holding `offset`."""
    line = text[text.rfind("\n", 0, offset) + 1:]
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def wait_for_line(path: Path, text: str, timeout_s: float) -> str:
    """The log at `path` once it holds `text`, read again every 0.2 s; after `timeout_s` the log
    as it is (the caller's assertions then say what is missing)."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = path.read_text()
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.2)
