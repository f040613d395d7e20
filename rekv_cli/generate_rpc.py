"""Regenerate the Python modules of the control plane from `proto/`:

    python -m rekv_cli.generate_rpc            # writes services/rpc/rekv/v1/
    python -m rekv_cli.generate_rpc --check    # exit 1 when the committed modules are stale

protoc writes absolute imports (`from rekv.v1 import rekv_pb2`); they are rewritten to import from
`services.rpc`, so no top-level `rekv` package is needed on sys.path.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "services" / "rpc"
PROTOS = ["rekv/v1/rekv.proto"]


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
