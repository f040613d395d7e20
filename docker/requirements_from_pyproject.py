"""Print pyproject.toml's [project].dependencies as a requirements file, with some replaced.

    python requirements_from_pyproject.py pyproject.toml --replace ucxx-cu12=ucxx-cu13==0.52.0

The CUDA 13 image needs the package's dependencies with the CUDA 13 build of ucxx in place of the
ucxx-cu12 that pyproject.toml names (both wheels install the same `ucxx` module, so they cannot sit
side by side). It installs what this prints, then the package itself with `--no-deps`: the list
comes from pyproject.toml at build time and cannot drift from it. A replaced name that pyproject
does not list is an error, so a renamed dependency fails the build instead of going unnoticed.
Standard library only (tomllib: Python >= 3.11).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def normalize(name: str) -> str:
    """PEP 503 form of a distribution name: ucxx_CU12 and ucxx-cu12 are one name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if not match:
        raise ValueError(f"cannot read a distribution name from {requirement!r}")
    return normalize(match.group(1))


def requirements(pyproject: str, replace: dict[str, str]) -> list[str]:
    """The dependencies, each one named in `replace` swapped for its replacement. A requirement's
    environment marker (`; platform_system == 'Linux'`) carries over to its replacement."""
    with open(pyproject, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    wanted = {normalize(old): new for old, new in replace.items()}
    out, seen = [], set()
    for dep in deps:
        name = requirement_name(dep)
        if name in wanted:
            marker = dep.split(";", 1)[1].strip() if ";" in dep else ""
            out.append(f"{wanted[name]}; {marker}" if marker else wanted[name])
            seen.add(name)
        else:
            out.append(dep)
    missing = sorted(set(wanted) - seen)
    if missing:
        raise ValueError(f"not among {pyproject}'s dependencies: {', '.join(missing)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pyproject", help="path of pyproject.toml")
    parser.add_argument("--replace", action="append", default=[], metavar="OLD=NEW",
                        help="swap the dependency named OLD for the requirement NEW (repeatable)")
    args = parser.parse_args(argv)
    replace = {}
    for item in args.replace:
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip():
            parser.error(f"--replace wants OLD=NEW, got {item!r}")
        replace[old.strip()] = new.strip()
    try:
        print("\n".join(requirements(args.pyproject, replace)))
    except (OSError, KeyError, ValueError) as exc:
        print(f"requirements_from_pyproject: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
