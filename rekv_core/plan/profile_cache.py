"""The machine profile measured once on the machine that serves, and kept.

`cached_profile(model, codecs)` is the `Profile` of `model` with `codecs` on this machine: loaded
from the cache directory (env `REKV_PROFILE_CACHE`, default `~/.cache/rekv/profiles`) when a profile
with this machine's fingerprint is there and has every codec; else measured now and saved there.
The measurement is short (one layer at `STARTUP_LAYER_LENGTHS`, each codec at
`STARTUP_CODEC_LENGTH`, each the least of `MEASURE_ROUNDS` rounds: about a second on two idle cores
for the embedded model); a codec the cached profile lacks is measured alone and added to it.

The fingerprint (`fingerprint(...)`) names what the costs depend on: the machine (the CUDA device's
name, else the CPU's model name from /proc/cpuinfo), torch's version, the device, the dtype, torch's
intra-op threads and the model; the file name carries its hash, and the file records it in
`meta["fingerprint"]`, so a profile is never taken for another machine or setting. A directory that
cannot be written only logs a warning (the profile is measured and used, not kept). Processes that
start together on one machine measure once: the others wait on the entry's lock file, then load.

A cached profile is checked before it is used (`stale`): one layer at `CHECK_LENGTH` tokens is
timed now (the least of two runs, tens of ms) against the profile's figure. Where the live layer
runs `STALE_FACTOR` (2×) faster, the profile was measured while something else ran (a profile
cached during other load once predicted a 2,048-token prefill at 17.7 s against 1.87 s measured
idle); where it runs 2× slower on an idle machine, the machine is not what it was; and a profile
measured on a busy machine (`meta["measured_busy"]`, `machine_busy`: other work kept more than
`BUSY_SHARE` of the CPUs busy just before) is measured again once the machine is idle. In each case
the profile is measured again and replaces the cached one. A slower live layer on a busy machine
keeps the cache: the load, not the profile, is what changed. `meta["source"]` says where the
profile in hand came from ("cache" or "measured"), `meta["measured_at"]` when it was measured;
`rekv plan` shows both.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import platform
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rekv_core import env

from rekv_core.model.executor import Model
from rekv_core.plan.estimates import LayerCost
from rekv_core.plan.measure import measure_codec_costs, measure_layer_cost
from rekv_core.plan.profile import Profile, measure_profile

log = logging.getLogger("rekv.plan.profile_cache")

CACHE_ENV = "REKV_PROFILE_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/rekv/profiles")
# The short profile: prompt lengths for one layer's cost, and the prompt length for the codecs.
STARTUP_LAYER_LENGTHS = (64, 256, 1024)
STARTUP_CODEC_LENGTH = 512
MEASURE_ROUNDS = 2  # each figure kept is the least of this many rounds
CHECK_LENGTH = 256  # tokens of the live layer a cached profile is checked against
STALE_FACTOR = 2.0
BUSY_SHARE = 0.5  # of all CPUs, kept busy by other work: a measurement then is marked busy
BUSY_WINDOW_S = 0.2


def cache_dir() -> Path:
    """Where profiles are kept: `REKV_PROFILE_CACHE`, else `~/.cache/rekv/profiles`."""
    return Path(env.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def machine_name(device: torch.device | str = "cpu") -> str:
    """The CUDA device's name, else the CPU's model name (/proc/cpuinfo, else `platform`)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def fingerprint(model: str, device: torch.device | str, dtype: torch.dtype | str,
                torch_threads: int) -> dict:
    """What a profile's figures depend on (see the module doc)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return {"model": model, "machine": machine_name(device), "torch": torch.__version__,
            "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "torch_threads": int(torch_threads)}


def model_fingerprint(model: Model) -> dict:
    """The fingerprint of `model` as it runs in this process now."""
    return fingerprint(model.shape.name, model.device, model.dtype, torch.get_num_threads())


def cache_path(print_: dict, directory: str | Path | None = None) -> Path:
    """The file that holds the profile of fingerprint `print_`."""
    digest = hashlib.sha256(json.dumps(print_, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(directory).expanduser() if directory else cache_dir()
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", print_["model"])
    return folder / f"{name}-{digest}.json"


def load_cached(print_: dict, directory: str | Path | None = None) -> Profile | None:
    """The cached profile of fingerprint `print_`, if there is a readable one."""
    path = cache_path(print_, directory)
    if not path.is_file():
        return None
    try:
        profile = Profile.load(path)
    except (OSError, ValueError) as exc:
        log.warning("profile cache: ignoring %s (%s)", path, exc)
        return None
    return profile if profile.meta.get("fingerprint") == print_ else None


def machine_busy(window_s: float = BUSY_WINDOW_S) -> bool:
    """Whether other work kept more than `BUSY_SHARE` of the CPUs busy over the last
    `window_s` (/proc/stat; False where it cannot be read)."""
    def sample() -> tuple[int, int] | None:
        try:
            fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait

    first = sample()
    time.sleep(window_s)
    second = sample()
    if first is None or second is None or second[0] <= first[0]:
        return False
    return 1 - (second[1] - first[1]) / (second[0] - first[0]) > BUSY_SHARE


def stale(cached_ms: float, live_ms: float, busy: bool, measured_busy: bool = False) -> bool:
    """Whether a cached profile whose layer at `CHECK_LENGTH` costs `cached_ms` must be measured
    again, given that layer timed now (`live_ms`) and whether the machine is busy now."""
    if live_ms * STALE_FACTOR < cached_ms:
        return True  # measured under load
    if busy:
        return False
    return measured_busy or live_ms > STALE_FACTOR * cached_ms


def live_layer_ms(model: Model, length: int = CHECK_LENGTH) -> float:
    """One layer at `length` tokens on this machine now: the least of two runs."""
    return min(measure_layer_cost(model, (length,), repeats=1).ms[0] for _ in range(2))


def cached_profile(model: Model, codecs: Iterable[str], directory: str | Path | None = None
                   ) -> Profile:
    """The profile of `model` with `codecs` on this machine: cached and still true (`stale`),
    else measured and saved."""
    codecs = list(dict.fromkeys(codecs))
    print_ = model_fingerprint(model)
    path = cache_path(print_, directory)
    with _locked(path):
        profile = load_cached(print_, directory)
        if profile is not None and _stale(model, profile, path):
            profile = None
        missing = [c for c in codecs if profile is None or c not in profile.quantize_ms_per_mib
                   or c not in profile.restore_ms_per_mib]
        if profile is not None and not missing:
            log.info("profile cache: loaded %s (measured %s)", path,
                     profile.meta.get("measured_at", "at an unknown time"))
            profile.meta["source"] = "cache"
            return profile
        log.info("profile cache: measuring %s on %s (%s)", model.shape.name,
                 print_["machine"], ", ".join(missing) or "no codecs")
        busy = machine_busy()
        profile = _measured(model, missing if profile is not None else codecs, profile, print_)
        profile.meta["measured_busy"] = busy or bool(profile.meta.get("measured_busy"))
        _save(profile, path)
        profile.meta["source"] = "measured"
    return profile


def _stale(model: Model, profile: Profile, path: Path) -> bool:
    cached_ms = profile.layer_cost.at(CHECK_LENGTH)
    live_ms = live_layer_ms(model)
    busy = machine_busy()
    if not stale(cached_ms, live_ms, busy, bool(profile.meta.get("measured_busy"))):
        return False
    log.warning("profile cache: %s is stale (one layer at %d tokens: %.2f ms now, %.2f ms in "
                "the profile measured %s%s; the machine is %s now): measuring again", path,
                CHECK_LENGTH, live_ms, cached_ms, profile.meta.get("measured_at", "?"),
                " on a busy machine" if profile.meta.get("measured_busy") else "",
                "busy" if busy else "idle")
    return True


def _measured(model: Model, codecs: list[str], known: Profile | None, print_: dict) -> Profile:
    """`known` with `codecs` measured and added; or, without one, a short profile measured now.
    Each figure is the least of `MEASURE_ROUNDS` rounds: what the cache keeps for good must not be
    one that another process's burst of work slowed down."""
    if known is None:
        rounds = [measure_profile(model, codecs, STARTUP_LAYER_LENGTHS, STARTUP_CODEC_LENGTH)
                  for _ in range(MEASURE_ROUNDS)]
        profile = rounds[0]
        profile.layer_cost = LayerCost(list(profile.layer_cost.lengths), [
            min(r.layer_cost.ms[i] for r in rounds) for i in range(len(profile.layer_cost.ms))])
        for codec in codecs:
            profile.quantize_ms_per_mib[codec] = min(r.quantize_ms_per_mib[codec] for r in rounds)
            profile.restore_ms_per_mib[codec] = min(r.restore_ms_per_mib[codec] for r in rounds)
    else:
        profile = known
        for codec in codecs:
            rounds = [measure_codec_costs(codec, model.shape, STARTUP_CODEC_LENGTH, model.device)
                      for _ in range(MEASURE_ROUNDS)]
            profile.quantize_ms_per_mib[codec] = min(encode for encode, _ in rounds)
            profile.restore_ms_per_mib[codec] = min(decode for _, decode in rounds)
    profile.meta.update(fingerprint=print_,
                        measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(
                            timespec="seconds"))
    log.info("profile cache: %s, one layer %s ms at %s tokens; encode %s, restore %s ms/MiB",
             print_["model"], _rounded(profile.layer_cost.ms), list(profile.layer_cost.lengths),
             _rounded(profile.quantize_ms_per_mib), _rounded(profile.restore_ms_per_mib))
    return profile


def _rounded(figures):
    if isinstance(figures, dict):
        return {k: round(v, 3) for k, v in figures.items()}
    return [round(v, 3) for v in figures]


def _save(profile: Profile, path: Path) -> None:
    """Write atomically (a reader sees the old file or the new one); a failure only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(profile.to_json(), indent=1) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from the machine's other users
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("profile cache: cannot keep the profile in %s (%s); measuring again at the "
                    "next start", path.parent, exc)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the entry's lock file while it is looked up and measured (none if it cannot be made)."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError:
        yield
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
    finally:
        lock.close()
