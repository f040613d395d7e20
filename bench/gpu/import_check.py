"""Import every module a GPU run can reach, in the interpreter that will run it: the packages
`rekv_core`, `services` and `rekv_cli` whole, and the scripts `bench/gpu/run.sh` calls. A module
may fail only where it is listed in `OPTIONAL` with the one missing package it names (a feature
the device image cannot serve and the GPU steps do not use); any other failure is printed and the
exit status is 1.

    python bench/gpu/import_check.py [--json]

`bench/gpu/install_wheels.sh` runs it as its smoke check on the lent machine, and
`bench/gpu/device_venv.sh` so on the CPU, in a venv holding only the device's packages.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rekv_core", "services", "rekv_cli")
SCRIPTS = ("bench/gpu/env_info.py", "bench/gpu/kernels_check.py", "bench/gpu/services_e2e.py",
           "bench/gpu/summarize.py", "bench/gpu/step_sizes.py", "bench/gpu/tree_manifest.py",
           "bench/executor.py", "bench/batched_decode.py", "bench/codecs.py")
# module -> the top-level package it may lack: what needs it, and why a GPU run does without it
OPTIONAL = {
    # the OTLP test collector of the tracing bench; tracing itself is off without OpenTelemetry
    "rekv_cli.bench.otlp_collector": "opentelemetry",
    # the services' OTLP exporter, loaded only when OTEL_* asks for tracing
    "services.tracing_sdk": "opentelemetry",
}


def module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        names.append(package)
        names += [info.name for info in pkgutil.walk_packages(root.__path__, f"{package}.")
                  if not info.name.endswith(".__main__")]  # importing one runs its command
    return names


def script_module(relative: str) -> str:
    """The module name of a script under the repo root (`bench` is a namespace package)."""
    return relative.removesuffix(".py").replace("/", ".")


def check() -> dict:
    """{"imported": [...], "optional_missing": {module: package}, "failed": {module: error}}."""
    sys.path.insert(0, str(ROOT))
    imported, optional, failed = [], {}, {}
    for name in [*module_names(), *map(script_module, SCRIPTS)]:
        try:
            importlib.import_module(name)
            imported.append(name)
        except ModuleNotFoundError as exc:
            missing = (exc.name or "").partition(".")[0]
            if OPTIONAL.get(name) == missing:
                optional[name] = missing
            else:
                failed[name] = traceback.format_exc(limit=4)
        except Exception:  # any import-time failure is a failure of the check
            failed[name] = traceback.format_exc(limit=4)
    return {"imported": imported, "optional_missing": optional, "failed": failed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    result = check()
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name, error in result["failed"].items():
            print(f"FAILED {name}:\n{error}")
        print(f"import_check: {len(result['imported'])} imported, "
              f"{len(result['optional_missing'])} optional missing "
              f"{sorted(set(result['optional_missing'].values()))}, "
              f"{len(result['failed'])} failed")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
