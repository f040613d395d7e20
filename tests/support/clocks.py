"""`HandClock`: a clock for code that takes one (`clock=`, or `time.monotonic` patched), whose
seconds move only when a test sets or advances `now`."""


class HandClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now
