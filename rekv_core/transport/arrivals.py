"""The link rate as the receiver saw it: from when each message of a request arrived.

A receiving transport stamps each message with an `Arrival` (its own `time.perf_counter`
clock): how long its reader took, after the previous message had landed, to begin looking for
this one (long when it waited for the consumer to take the previous one, or for a core); whether
its first look found the message's first part; the span within which that part arrived (the first
look's own duration, or from the start of the last look that found nothing to the end of the one
that found it); when the last byte landed; and the message's size. `link_sample(arrivals)` turns
a request's arrivals into one (bytes, seconds) sample of the link, or None when they say nothing
reliable about it.

Only messages that were queued behind the previous one say how fast the wire is: a prompt first
look found their first part, and the reader had begun looking promptly. From the end of the
previous message to the end of a run of queued messages, the wire carried nothing but the run.
The run's start is that previous message's end, which is known only if the previous message came
while the reader was looking: it arrived within its span `w`, so it may have landed up to `w`
before the reader saw it. A run counts with `w / 2` added to its time, and only while `w` is at
most `max_uncertainty` of that time. A message the sender held back (encoding a layer on a fast
link) joins no run; it can only start one. A message already there when the reader began looking,
but not promptly, neither joins nor starts one: since when it was there is unknown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# A reader that begins looking, or whose first look ends, this long (seconds) after the previous
# message landed may have left the next one waiting: what it then finds times nothing.
PROMPT = 200e-6


@dataclass(frozen=True)
class Arrival:
    held: float  # from the previous message's last byte until the reader began looking for this
    first_look: bool  # the reader's first look found it
    window: float  # it arrived within this many seconds before the reader saw it
    completed: float  # the last byte landed
    nbytes: int

    @property
    def queued(self) -> bool:
        """It was waiting when the reader promptly looked: the wire was busy up to it."""
        return self.first_look and self.held <= PROMPT and self.window <= PROMPT

    @property
    def came_while_looking(self) -> bool:
        """It arrived after the reader began looking: its end is late by at most `window`."""
        return not self.first_look


def link_sample(arrivals: Sequence[Arrival], max_uncertainty: float = 0.2
                ) -> tuple[int, float] | None:
    """(bytes, seconds) over the runs of back-to-back messages, or None when there is none."""
    total_bytes, total_seconds = 0, 0.0
    anchor = None  # where the current run starts, known to within `uncertainty` (it may be early)
    uncertainty, run_bytes, run_end = 0.0, 0, 0.0

    def close_run() -> None:
        nonlocal total_bytes, total_seconds
        if anchor is None or run_bytes == 0:
            return
        seconds = run_end - anchor + uncertainty / 2
        if seconds > 0 and uncertainty <= max_uncertainty * seconds:
            total_bytes += run_bytes
            total_seconds += seconds

    for arrival in arrivals:
        if anchor is not None and arrival.queued:
            run_bytes += arrival.nbytes
            run_end = arrival.completed
            continue
        close_run()
        if arrival.came_while_looking:
            anchor, uncertainty, run_bytes = arrival.completed, arrival.window, 0
        else:
            anchor = None
    close_run()
    if total_bytes == 0:
        return None
    return total_bytes, total_seconds
