"""The versions the generated control-plane modules need are what pyproject.toml promises: its
grpcio floor is at least the generator's GRPC_GENERATED_VERSION, its protobuf floor at least the
gencode version the modules validate at import, and the generator is the lock's grpcio-tools."""

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from rekv_cli import generate_rpc
from services.rpc.rekv.v1 import rekv_pb2_grpc
from tests.support.paths import ROOT

GENERATED = ROOT / "services" / "rpc" / "rekv" / "v1"


def _floor(name: str) -> Version:
    """The lower bound pyproject.toml gives the dependency `name`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        if requirement.name == name:
            floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
            assert len(floors) == 1, f"{line}: one >= floor expected"
            return floors[0]
    raise AssertionError(f"pyproject.toml does not depend on {name}")


def gencode_version(text: str) -> Version:
    """The protobuf version a generated *_pb2.py validates its runtime against."""
    match = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
                      r"\s*(\d+),\s*(\d+),\s*(\d+),", text)
    assert match is not None, "no ValidateProtobufRuntimeVersion call"
    return Version(".".join(match.groups()))


def test_the_grpcio_floor_covers_the_generated_code():
    assert _floor("grpcio") >= Version(rekv_pb2_grpc.GRPC_GENERATED_VERSION)


def test_the_protobuf_floor_covers_the_gencode_version():
    for module in GENERATED.glob("*_pb2.py"):
        assert _floor("protobuf") >= gencode_version(module.read_text()), module.name


def test_the_gencode_parser_reads_the_call():
    text = ("_runtime_version.ValidateProtobufRuntimeVersion(\n    _runtime_version.Domain.PUBLIC,"
            "\n    7,\n    35,\n    1,\n    '',\n    'rekv/v1/rekv.proto'\n)")
    assert gencode_version(text) == Version("7.35.1")
    with pytest.raises(AssertionError):
        gencode_version("no call here")


def test_the_modules_were_generated_by_the_locked_generator():
    assert rekv_pb2_grpc.GRPC_GENERATED_VERSION == generate_rpc.locked_generator()
    assert generate_rpc.generator_mismatch() is None  # the test venv holds the lock's


def test_another_generator_is_refused(monkeypatch):
    monkeypatch.setattr(generate_rpc.importlib.metadata, "version", lambda name: "1.66.0")
    reason = generate_rpc.generator_mismatch()
    assert reason is not None and "1.66.0" in reason and generate_rpc.locked_generator() in reason


def test_the_gpu_install_asks_for_the_same_floors():
    script = (ROOT / "bench" / "gpu" / "install_wheels.sh").read_text()
    floors = dict(re.findall(r"^(GRPC|PROTOBUF)_FLOOR=(\S+)$", script, re.M))
    assert Version(floors["GRPC"]) == _floor("grpcio")
    assert Version(floors["PROTOBUF"]) == _floor("protobuf")
