"""What prepares a GPU run on the CPU (`bench/gpu/`): the wheel slimmer, the carry's size, the
copied tree's manifest, the step plan, the import check's exemptions, and the tests' rule that a
carried package missing on a device run fails instead of skipping."""

import base64
import csv
import hashlib
import io
import json
import subprocess
import sys
import zipfile

import pytest

from tests.support import requires
from tests.support.git_checkout import git, make_checkout
from tests.support.paths import ROOT, load_script

slim_wheels = load_script(ROOT / "bench/gpu/slim_wheels.py", "slim_wheels")
carry_size = load_script(ROOT / "bench/gpu/carry_size.py", "carry_size")
tree_manifest = load_script(ROOT / "bench/gpu/tree_manifest.py", "tree_manifest")
step_sizes = load_script(ROOT / "bench/gpu/step_sizes.py", "step_sizes")
import_check = load_script(ROOT / "bench/gpu/import_check.py", "import_check")

KEPT = ["libucx/__init__.py", "libucx/load.py", "libucx/lib/libucp.so", "libucx/lib/libucp.so.0",
        "libucx/lib/libucp.so.0.0.0", "libucx/lib/ucx/libuct_cuda.so.0", "libucx/bin/ucx_info",
        "libucx_cu13-1.0.dist-info/METADATA", "libucx_cu13-1.0.dist-info/WHEEL"]
DROPPED = ["libucx/lib/libucp.a", "libucx/include/ucp/api/ucp.h", "libucx/bin/ucx_perftest",
           "libucx/bin/io_demo", "libucx/lib/ucx/libucx_perftest_cuda.so.0",
           "libucx/lib/cmake/ucx/ucx-config.cmake", "libucx/share/ucx/examples/hello.c"]


def _record_line(name: str, data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return f"{name},sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},{len(data)}"


def _wheel(path, names):
    """A wheel holding `names` (each its own bytes) and a RECORD listing all of them."""
    record = "libucx_cu13-1.0.dist-info/RECORD"
    lines = []
    with zipfile.ZipFile(path, "w") as wheel:
        for name in names:
            data = (b"Metadata-Version: 2.1\nName: libucx-cu13\nVersion: 1.0\n"
                    if name.endswith("METADATA") else
                    b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
                    if name.endswith("WHEEL") else name.encode() * 50)
            wheel.writestr(name, data)
            lines.append(_record_line(name, data))
        wheel.writestr(record, "\n".join(lines + [f"{record},,"]) + "\n")
    return path


def test_slimming_drops_only_what_no_process_opens_and_installs(tmp_path):
    wheel = _wheel(tmp_path / "libucx_cu13-1.0-py3-none-any.whl", KEPT + DROPPED)
    other = _wheel(tmp_path / "grpcio-1.0-py3-none-any.whl", KEPT + DROPPED)
    before = other.read_bytes()
    result = slim_wheels.slim(wheel)
    assert result["files_dropped"] == len(DROPPED)
    with zipfile.ZipFile(wheel) as slim:
        names = set(slim.namelist())
        record = slim.read("libucx_cu13-1.0.dist-info/RECORD").decode()
    assert set(KEPT) <= names and not names & set(DROPPED)
    listed = {row[0] for row in csv.reader(io.StringIO(record)) if row}
    assert listed == names  # RECORD lists exactly what is in the wheel
    assert slim_wheels.slim(wheel)["files_dropped"] == 0  # idempotent
    subprocess.run([sys.executable, "-m", "slim_wheels", str(tmp_path)], cwd=tmp_path,
                   env={"PYTHONPATH": str(ROOT / "bench/gpu")}, check=True, capture_output=True)
    assert other.read_bytes() == before  # not a library wheel of the UCX stack: untouched
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, capture_output=True)
    assert (target / "libucx/lib/libucp.so.0").read_bytes() == b"libucx/lib/libucp.so.0" * 50
    assert not (target / "libucx/lib/libucp.a").exists()


def test_the_carry_counts_the_tree_that_travels_and_the_carried_paths(tmp_path):
    root = make_checkout(tmp_path / "repo")
    (root / ".gitignore").write_text("/ignored/\n/wheels/\n")
    (root / "untracked.txt").write_bytes(b"u" * 1000)  # travels: not ignored
    (root / "ignored").mkdir()
    (root / "ignored" / "big").write_bytes(b"i" * 10**6)  # does not travel
    (root / "wheels").mkdir()
    (root / "wheels" / "a.whl").write_bytes(b"w" * 3 * 2**20)
    tree = len("FIGURE = 1\n") + len("/ignored/\n/wheels/\n") + 1000
    result = carry_size.measure(root, ["wheels"], limit_mib=4, room_mib=0.5)
    assert result["tree_bytes"] == tree and result["carried_bytes"] == 3 * 2**20
    assert result["fits"]
    assert not carry_size.measure(root, ["wheels"], limit_mib=4, room_mib=1.5)["fits"]
    with pytest.raises(FileNotFoundError, match="nowhere"):
        carry_size.measure(root, ["nowhere"], 64, 8)


def test_the_manifest_tells_a_copy_of_the_commit_from_a_changed_one(tmp_path):
    root = make_checkout(tmp_path / "repo")
    (root / "link").symlink_to("code.py")
    git(root, "add", "link")
    git(root, "commit", "-q", "-m", "a link")
    manifest = tree_manifest.write(root, tmp_path / "manifest.json")
    assert manifest["commit"] == git(root, "rev-parse", "HEAD") and manifest["checkout_clean"]
    assert manifest["files"]["code.py"] == git(root, "hash-object", "code.py")
    copy = tmp_path / "copy"  # what the device gets: the files, no .git
    copy.mkdir()
    (copy / "code.py").write_text("FIGURE = 1\n")
    (copy / "link").symlink_to("code.py")
    assert tree_manifest.verify(manifest, copy) == {"commit": manifest["commit"],
                                                     "tree_clean": True, "differing": []}
    (copy / "code.py").write_text("FIGURE = 2\n")
    assert tree_manifest.verify(manifest, copy)["differing"] == ["code.py"]
    (copy / "code.py").unlink()
    assert not tree_manifest.verify(manifest, copy)["tree_clean"]
    (root / "code.py").write_text("FIGURE = 3\n")  # a dirty checkout never makes a clean copy
    dirty = tree_manifest.write(root, tmp_path / "dirty.json")
    (copy / "code.py").write_text("FIGURE = 1\n")
    assert not dirty["checkout_clean"] and not tree_manifest.verify(dirty, copy)["tree_clean"]


def test_the_step_plan_fits_its_budget_with_the_seed_table_first():
    plan = step_sizes.steps()
    names = [s.name for s in plan]
    assert names[:5] == ["env", "cuda_tests", "handoff_qwen2.5-7b", "handoff_qwen2.5-3b",
                         "handoff_qwen3-8b"]
    assert step_sizes.fits(plan), [(s.name, s.estimate_s, s.limit_s) for s in plan]
    table1 = {s.name: s.args for s in plan if s.name.startswith("handoff_")}
    for args in table1.values():
        assert args[args.index("--prompt-len") + 1] == "8192"
        assert args[args.index("--link-gbps") + 1].split(",")[0] == "18.4"
    dry = [s.name for s in step_sizes.steps(dry_run=True)]
    assert dry == ["env", "cuda_tests", "handoff_smollm2-135m", *names[5:]]


def test_a_grid_too_big_for_the_budget_does_not_fit(monkeypatch):
    """The estimate counts the grid: four times the TTFT rounds no longer fits."""
    fitting = step_sizes.ttft_estimate()
    monkeypatch.setitem(step_sizes.TTFT, "runs", step_sizes.TTFT["runs"] * 4 + 3)
    assert step_sizes.ttft_estimate() > 2 * fitting
    assert not step_sizes.fits(step_sizes.steps())


def test_every_import_exemption_names_a_module_that_exists():
    names = set(import_check.module_names())
    assert set(import_check.OPTIONAL) <= names
    assert all((ROOT / script).is_file() for script in import_check.SCRIPTS)


def test_a_missing_package_skips_here_and_fails_on_a_device_run(monkeypatch):
    monkeypatch.delenv(requires.DEVICE_RUN_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception):
        requires.require("rekv_no_such_package")
    monkeypatch.setenv(requires.DEVICE_RUN_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="rekv_no_such_package.*did not install"):
        requires.require("rekv_no_such_package")
    assert requires.require("json") is json
