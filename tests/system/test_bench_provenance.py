"""`provenance()`: the commit a result names, whether the tree matched it and the code it declares
it measures, in a real checkout."""

import logging
import time

import pytest

from rekv_cli.bench.provenance import COMMIT_ENV, TREE_CLEAN_ENV
from rekv_cli.bench.provenance import provenance as read_provenance
from tests.support.git_checkout import git, make_checkout


@pytest.fixture
def checkout(tmp_path):
    return make_checkout(tmp_path)


def provenance(root):
    """What a run at `root` measuring its one file records."""
    return read_provenance(root, measures=("code.py",))


def test_a_clean_checkout_names_its_full_head_and_a_clean_tree(checkout, monkeypatch, caplog):
    monkeypatch.setenv(COMMIT_ENV, "not-this-one")
    before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with caplog.at_level(logging.WARNING):
        found = provenance(checkout)
    assert found["commit"] == git(checkout, "rev-parse", "HEAD") and len(found["commit"]) == 40
    assert found["tree_clean"] is True
    assert before <= found["started"] <= time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    assert not caplog.records
    (checkout / "notes.txt").write_text("untracked files are not the figures' code\n")
    assert provenance(checkout)["tree_clean"] is True


def test_a_modified_tracked_file_marks_the_tree_and_warns(checkout, caplog):
    head = git(checkout, "rev-parse", "HEAD")
    (checkout / "code.py").write_text("FIGURE = 2\n")
    with caplog.at_level(logging.WARNING):
        found = provenance(checkout)
    assert found["commit"] == head and found["tree_clean"] is False
    assert any("uncommitted" in r.getMessage() for r in caplog.records)
    git(checkout, "commit", "-q", "-am", "second")
    after = provenance(checkout)
    assert after["tree_clean"] is True and after["commit"] not in (head, None)


def test_without_a_checkout_the_callers_commit_is_taken(tmp_path, monkeypatch):
    copy = tmp_path / "copy"
    copy.mkdir()
    monkeypatch.setenv(COMMIT_ENV, "a" * 40)
    assert provenance(copy)["commit"] == "a" * 40 and provenance(copy)["tree_clean"] is None
    monkeypatch.delenv(COMMIT_ENV)
    assert provenance(copy)["commit"] is None


def test_without_a_checkout_the_manifests_verdict_says_whether_the_tree_is_clean(
        tmp_path, monkeypatch):
    """On the lent machine `bench/gpu/tree_manifest.py verify` sets REKV_TREE_CLEAN."""
    copy = tmp_path / "copy"
    copy.mkdir()
    monkeypatch.setenv(COMMIT_ENV, "c" * 40)
    for value, clean in (("1", True), ("0", False), ("", None), ("yes", None)):
        monkeypatch.setenv(TREE_CLEAN_ENV, value)
        assert provenance(copy)["tree_clean"] is clean


def test_a_folder_inside_a_checkout_is_not_that_checkout(checkout, monkeypatch):
    """An installed copy inside some other repository must not borrow that repository's HEAD."""
    inside = checkout / "site-packages"
    inside.mkdir()
    monkeypatch.setenv(COMMIT_ENV, "b" * 40)
    found = provenance(inside)
    assert found["commit"] == "b" * 40 and found["tree_clean"] is None


def test_the_declared_code_is_recorded_in_order_without_repeats(checkout, caplog):
    with caplog.at_level(logging.WARNING):
        found = read_provenance(checkout, measures=("code.py", "lib", "code.py"))
    assert found["measures"] == ["code.py", "lib"]
    assert any("lib" in r.getMessage() for r in caplog.records)  # not in the tree: logged


@pytest.mark.parametrize("measures", [(), "code.py", ("/etc",), ("../code.py",), ("",)])
def test_no_declared_code_or_a_path_outside_the_tree_is_refused(checkout, measures):
    with pytest.raises(ValueError, match="measures"):
        read_provenance(checkout, measures=measures)
