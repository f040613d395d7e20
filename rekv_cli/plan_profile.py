"""Which profile `rekv plan` plans with, and how old it is.

`plan_profile(args)` returns (profile, where it came from): `--profile`; else this machine's cached
profile (measured now with `--measure`); else the shipped one, with a warning on stderr.
`measured_when(profile)` says when it was measured (and whether on a busy machine).
"""

from __future__ import annotations

import argparse
import sys

from rekv_core.model.shapes import DEFAULT_MODEL


def measured_when(profile) -> tuple[float | None, str]:
    """(age in seconds, or None; how `rekv plan` says it) of a profile's measurement."""
    import datetime

    at = profile.meta.get("measured_at")
    busy = " on a busy machine" if profile.meta.get("measured_busy") else ""
    try:
        when = datetime.datetime.fromisoformat(at)
    except (TypeError, ValueError):
        return None, f"measured at an unknown time{busy}"
    age = (datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()
    for unit, seconds in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= seconds:
            return age, f"measured {age / seconds:.1f} {unit} ago{busy}"
    return age, f"measured {age:.0f} s ago{busy}"


def plan_profile(args: argparse.Namespace):
    """(profile, where it came from) for `rekv plan`: --profile; else this machine's cached
    profile (measured now with --measure); else the shipped one, with a warning on stderr."""
    from rekv_core.plan.profile import Profile, shipped_profile
    from rekv_core.plan.profile_cache import cached_profile, load_cached
    from rekv_core.settings import RuntimeSettings, usable_cores

    if args.profile:
        if args.measure:
            raise ValueError("measure: --profile names the profile; pass one or the other")
        return Profile.load(args.profile), args.profile
    source = args.model if args.model == DEFAULT_MODEL else f"synthetic:{args.model}"
    settings = RuntimeSettings.from_env(model=source, device=args.device, dtype=args.dtype,
                                        torch_threads=args.threads)
    if args.measure:
        settings.apply_threads()
        return cached_profile(settings.load_model(), args.codecs), "measured on this machine"
    print_ = _fingerprint(args.model, settings, usable_cores())
    cached = load_cached(print_) if print_ else None
    if cached is not None and all(c in cached.quantize_ms_per_mib and c in
                                  cached.restore_ms_per_mib for c in args.codecs):
        return cached, "cached for this machine"
    shipped = shipped_profile(args.model)
    if shipped is None:
        raise ValueError(f"profile: none ships for {args.model} and none is cached for this "
                         f"machine; pass --measure, or run `rekv profile` and pass --profile")
    made_on = shipped.meta.get("fingerprint", {}).get("machine")
    here = print_.get("machine") if print_ else None
    if made_on is not None and made_on == here:
        return shipped, "shipped, measured on this CPU model"
    print(f"rekv plan: warning: the shipped profile of {args.model} was measured on "
          f"{made_on or 'another machine (it does not say which)'}, not on this one "
          f"({here or 'unknown'}); compute costs differ by up to 10x between CPUs (AVX-512 BF16 "
          f"or not), so its choice may be wrong here. Pass --measure to measure this machine "
          f"(seconds; cached, as the services cache theirs) or --profile FILE", file=sys.stderr)
    return shipped, "shipped, measured on another machine"


def _fingerprint(model: str, settings, cores: int) -> dict | None:
    """This machine's profile fingerprint under `settings`, without loading the model (None
    where the device cannot be asked, such as CUDA on a machine without it)."""
    from rekv_core.plan.profile_cache import fingerprint

    try:
        return fingerprint(model, settings.device, settings.torch_dtype,
                           settings.torch_threads or cores)
    except (RuntimeError, AssertionError):
        return None
