"""Rewrite the carried RAPIDS library wheels without what a running process never opens, so the
wheel set fits the device carry (64 MiB with the working tree) with room.

    python bench/gpu/slim_wheels.py DIR [--json]

Dropped from every wheel in DIR whose name starts with one of `SLIMMED` (the C++ library wheels
of the UCX stack; the Python ones are small): static archives (`*.a`), C/C++ headers and CMake or
pkg-config files (for building against the library, not for loading it), UCX's example sources,
its benchmark and demo programs (`ucx_perftest*`, `io_demo`) and the perftest module
(`libucx_perftest_cuda*`). Kept: every shared library under each of its names (`libucs.so` is
what `libucx.load_library` opens, `libucs.so.0` what the linker resolves, and UCX opens its
transport modules as `lib<framework>_<module>` plus the suffix it was itself loaded with), the
Python loaders, `ucx_info` and the metadata. The wheel's RECORD loses the dropped files' lines;
the name stays, so the offline install finds it. Idempotent: a slim wheel is left as it is.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import json
import os
import sys
import zipfile
from pathlib import Path

SLIMMED = ("libucx_", "libucxx_", "librmm_")
DROPPED = ("*.a", "*/include/*", "*/cmake/*", "*/pkgconfig/*", "*/share/ucx/examples/*",
           "*/bin/ucx_perftest*", "*/bin/io_demo", "*/lib/ucx/libucx_perftest_cuda*")


def dropped(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in DROPPED)


def slim(wheel: Path) -> dict:
    """Rewrite `wheel` in place without the dropped files; returns its sizes and what went."""
    before = wheel.stat().st_size
    with zipfile.ZipFile(wheel) as source:
        infos = source.infolist()
        gone = [info.filename for info in infos if dropped(info.filename)]
        if not gone:
            return {"wheel": wheel.name, "bytes_before": before, "bytes_after": before,
                    "files_dropped": 0}
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        gone_set = set(gone)
        tmp = wheel.with_suffix(".slim-tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as target:
            for info in infos:
                if info.filename in gone_set:
                    continue
                data = source.read(info)
                if info.filename == record:
                    rows = [row for row in csv.reader(io.StringIO(data.decode()))
                            if row and row[0] not in gone_set]
                    text = io.StringIO()
                    csv.writer(text, lineterminator="\n").writerows(rows)
                    data = text.getvalue().encode()
                target.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, wheel)
    return {"wheel": wheel.name, "bytes_before": before, "bytes_after": wheel.stat().st_size,
            "files_dropped": len(gone)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("dir", type=Path, help="the wheel folder (bench/gpu/fetch_wheels.sh's)")
    parser.add_argument("--json", action="store_true", help="print the sizes as JSON")
    args = parser.parse_args()
    results = [slim(wheel) for wheel in sorted(args.dir.glob("*.whl"))
               if wheel.name.startswith(SLIMMED)]
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            print(f"{r['wheel']}: {r['bytes_before'] / 2**20:.1f} -> "
                  f"{r['bytes_after'] / 2**20:.1f} MiB ({r['files_dropped']} files dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
