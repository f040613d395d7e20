"""What a process holds, for benchmarks that watch memory: VmRSS and threads (/proc/<pid>/status),
resident memory by kind of mapping (/proc/<pid>/smaps; glibc's thread arenas are the 64 MiB-aligned
anonymous mappings), and whether a curve of samples stopped growing."""

from __future__ import annotations

import re
from collections import defaultdict





# A curve "stops growing" when its growth over the last half of the run is at most this fraction
# of the growth over the first half, or at most PLATEAU_MIB (noise: a few pages of a sample)
PLATEAU_FRACTION, PLATEAU_MIB = 0.25, 8.0


ARENA_ALIGN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: each thread arena is aligned to it


def proc_status(pid: int) -> dict:
    """VmRSS, VmHWM (MiB) and Threads of a live process."""
    fields = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return {"rss_mib": int(fields["VmRSS"][0]) / 1024, "hwm_mib": int(fields["VmHWM"][0]) / 1024,
            "threads": int(fields["Threads"][0])}


def growth(curve: list[dict], role: str) -> dict:
    """RSS at the start, middle and end of the curve, the growth over each half, and whether it
    stopped growing (module constants PLATEAU_*)."""
    rss = [point[role]["rss_mib"] for point in curve]
    mid = len(rss) // 2
    first, second = rss[mid] - rss[0], rss[-1] - rss[mid]
    return {"start_mib": rss[0], "mid_mib": rss[mid], "end_mib": rss[-1], "peak_mib": max(rss),
            "first_half_mib": first, "second_half_mib": second,
            "stopped_growing": second <= max(PLATEAU_FRACTION * max(first, 0.0), PLATEAU_MIB)}


def memory_map(pid: int) -> dict:
    """Resident MiB of a process by kind of mapping (/proc/<pid>/smaps), and the number of
    64 MiB-aligned anonymous mappings (glibc's thread arenas)."""
    kinds: dict[str, float] = defaultdict(float)
    kind, arenas = "", 0
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", parts[0]):
                path = parts[5] if len(parts) > 5 else ""
                kind = _mapping_kind(int(parts[0].split("-")[0], 16), path)
                arenas += kind == "malloc arenas"
            elif parts[0] == "Rss:":
                kinds[kind] += int(parts[1]) / 1024
    return {"rss_mib_by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "arena_mappings": arenas}


def _mapping_kind(start: int, path: str) -> str:
    if path == "[heap]":
        return "main heap (brk)"
    if path.startswith("[stack"):
        return "main stack"
    if path.startswith(("/dev/shm", "/memfd:")):
        return "shared memory"
    if ".so" in path:
        return "libraries"
    if path.startswith("/"):
        return "other files"
    if path:
        return "other " + path
    return "malloc arenas" if start % ARENA_ALIGN == 0 else "other anonymous"
