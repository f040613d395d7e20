"""Each test file's measured seconds, for the order `make test` runs the files in.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=0 > run.log
    python tools/file_seconds.py run.log [--json tests/file_seconds.json]

Reads pytest's `--durations=0` report ("12.34s setup    tests/x.py::test_y") from a whole-suite
run and sums setup, call and teardown per file. Prints the table, longest first, with `--json`
also writes it as {"seconds_by_file": {...}, "total_s": ...}, which tests/conftest.py
(`_slowest_files_first`) reads: the longest files are handed out first, so none starts last and
runs alone at the end. Standard library only."""

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?\.py)::")


def seconds_by_file(report: str) -> dict[str, float]:
    """The summed phase durations of each file named in `report`, longest first."""
    totals: dict[str, float] = defaultdict(float)
    for line in report.splitlines():
        match = DURATION.match(line.strip())
        if match:
            totals[match.group(3)] += float(match.group(1))
    if not totals:
        raise ValueError("no '--durations=0' lines in the report (run pytest with --durations=0)")
    return dict(sorted(((name, round(s, 2)) for name, s in totals.items()),
                       key=lambda entry: (-entry[1], entry[0])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="pytest's output with --durations=0")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the table as JSON")
    args = parser.parse_args(argv)
    try:
        table = seconds_by_file(args.report.read_text())
    except (OSError, ValueError) as error:
        print(f"file_seconds.py: {error}", file=sys.stderr)
        return 2
    for name, seconds in table.items():
        print(f"{seconds:9.2f}  {name}")
    total = round(sum(table.values()), 2)
    print(f"{total:9.2f}  in all, {len(table)} files")
    if args.json:
        args.json.write_text(json.dumps({"seconds_by_file": table, "total_s": total}, indent=1)
                             + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
