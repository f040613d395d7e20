"""Reading the services' logs: `logged_at(text, offset)`, the time of the line holding `offset`,
from the "YYYY-MM-DD HH:MM:SS,mmm" stamp that every line of rekv's log format starts with."""

from datetime import datetime


def logged_at(text: str, offset: int) -> float:
    """Seconds since the epoch (local time, as logged) of the line of `text` holding `offset`."""
    line = text[text.rfind("\n", 0, offset) + 1:]
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
