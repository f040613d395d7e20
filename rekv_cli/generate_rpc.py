"""Regenerate the Python modules of the control plane from `proto/`:

    python -m rekv_cli.generate_rpc            # writes services/rpc/rekv/v1/
    python -m rekv_cli.generate_rpc --check    # exit 1 when the committed modules are stale

The generator is the lock's grpcio-tools (requirements/cpu.lock): another release writes other
modules (its version string among them), so both modes refuse to run under any other, and the
check compares the committed modules with the pinned generator's output. The committed modules
require grpcio >= the generator's version and protobuf >= its gencode version at import:
pyproject.toml's floors say so (tests/unit/services/test_rpc_versions.py).

protoc writes absolute imports (`from rekv.v1 import rekv_pb2`); they are rewritten to import from
`services.rpc`, so no top-level `rekv` package is needed on sys.path.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "services" / "rpc"
PROTOS = ["rekv/v1/rekv.proto"]
LOCK = ROOT / "requirements" / "cpu.lock"


def locked_generator(lock: Path = LOCK) -> str:
    """The grpcio-tools version the lock pins."""
    match = re.search(r"^grpcio-tools==(\S+)$", lock.read_text(), re.M)
    if match is None:
        raise RuntimeError(f"{lock} pins no grpcio-tools")
    return match.group(1)


def generator_mismatch() -> str | None:
    """Why the installed grpcio-tools is not the lock's, or None when it is."""
    want = locked_generator()
    try:
        have = importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have == want:
        return None
    return (f"grpcio-tools {have or 'is not installed'}{'' if have is None else ' is installed'}, "
            f"the lock ({LOCK.relative_to(ROOT)}) pins {want}: install it "
            f"(`pip install -c {LOCK.relative_to(ROOT)} grpcio-tools`, or `make test`)")


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    (out / "rekv" / "v1").mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    status = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
                          f"--pyi_out={out}", f"--grpc_python_out={out}", *PROTOS])
    if status:
        raise RuntimeError(f"protoc failed with status {status}")
    written = []
    for path in sorted((out / "rekv" / "v1").glob("*.py*")):
        text = path.read_text().replace("from rekv.v1 import", "from services.rpc.rekv.v1 import")
        path.write_text(text)
        written.append(path)
    for package in (out / "rekv", out / "rekv" / "v1"):
        (package / "__init__.py").touch()
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed modules instead of writing them")
    args = parser.parse_args()
    mismatch = generator_mismatch()
    if mismatch is not None:
        print(f"not generating with another grpcio-tools than the lock's: {mismatch}",
              file=sys.stderr)
        return 2
    if not args.check:
        for path in generate(OUT):
            print(path.relative_to(ROOT))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = []
        for fresh in generate(Path(tmp)):
            committed = OUT / fresh.relative_to(tmp)
            if not committed.exists() or committed.read_text() != fresh.read_text():
                stale.append(str(committed.relative_to(ROOT)))
    if stale:
        print("stale, run `python -m rekv_cli.generate_rpc`: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
