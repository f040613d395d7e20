"""Figures that say when they went stale (`rekv_cli.bench.staleness`): on the repository, every
result declares the code it measures and no doc quotes a result whose code changed since; and the
check itself, in a scratch checkout, reports a quote of a result whose code changed after its
commit, not one whose code did not, and a result that declares nothing."""

import json
import subprocess
from pathlib import Path

import pytest

from rekv_cli.bench.provenance import provenance
from rekv_cli.bench.staleness import check, main, stale_line
from tests.support.git_checkout import git, make_checkout
from tests.support.paths import ROOT

README = """# A project

The figure (see `bench/results/stale.md`).
The other figure (see `bench/results/fresh.txt`).

```sh
python bench/x.py --json bench/results/stale.json   # a command, not a quote
```
"""
GUIDE = "# Guide\n\nMeasured in `stale.md` too.\n"


def _checkout_top() -> str | None:
    """Why the repository cannot be checked here (no checkout at ROOT, a shallow clone), or
    None."""
    try:
        top = git(ROOT, "rev-parse", "--show-toplevel")
        shallow = git(ROOT, "rev-parse", "--is-shallow-repository")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    if Path(top).resolve() != ROOT.resolve():
        return f"{ROOT} is not the checkout's top ({top})"
    return "a shallow clone: the results' commits are missing" if shallow == "true" else None


# The repository


@pytest.fixture(scope="module")
def repository():
    why = _checkout_top()
    if why:
        pytest.skip(why)
    return check(ROOT)


def test_every_result_declares_the_code_it_measures(repository):
    assert repository.problems == [], "\n".join(repository.problems)


def test_no_doc_quotes_a_stale_figure(repository):
    """Rerun the result (its JSON then declares the code and commit itself) or drop the quote."""
    stale = [stale_line(q, v) for q, v in repository.stale]
    assert not stale, "quotes of figures whose code changed since:\n" + "\n".join(stale)


# The check, in a scratch checkout


def _write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _commit(root, message: str) -> str:
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", message)
    return git(root, "rev-parse", "HEAD")


def _manifest(root, entries: dict) -> None:
    _write(root, {"bench/results/MEASURES.json": json.dumps({"results": entries})})


@pytest.fixture
def project(tmp_path):
    """A checkout whose code is measured at `measured` by two results: `stale` (its JSON written
    by provenance(), measuring lib/fast.py and code.py) and `fresh` (declared in MEASURES.json,
    measuring lib/slow.py); both quoted by the README, `stale` by docs/guide.md too."""
    root = make_checkout(tmp_path / "project")
    _write(root, {"lib/fast.py": "X = 1\n", "lib/slow.py": "Y = 1\n"})
    measured = _commit(root, "code")
    meta = provenance(root, measures=("lib/fast.py", "code.py"))
    _write(root, {"bench/results/stale.json": json.dumps({"meta": meta, "ms": 5}),
                  "bench/results/stale.md": "5 ms\n", "bench/results/fresh.txt": "7 ms\n",
                  "README.md": README, "docs/guide.md": GUIDE})
    _manifest(root, {"fresh": {"commit": measured, "measures": ["lib/slow.py"]}})
    _commit(root, "results")
    return root, measured


def test_a_quote_is_stale_once_its_measured_code_changes_and_not_before(project):
    root, measured = project
    before = check(root)
    assert before.stale == [] and before.problems == []
    assert [(q.doc, q.line, q.result) for q in before.quotes] == [
        ("README.md", 3, "stale"), ("README.md", 4, "fresh"), ("docs/guide.md", 3, "stale")]
    _write(root, {"lib/fast.py": "X = 2\n"})
    changed = git(root, "rev-parse", "--short", _commit(root, "faster"))
    _write(root, {"README.md": README + "\nMore prose.\n"})
    _commit(root, "prose")  # a later commit that touches no measured path
    after = check(root)
    why = f"(measured at {measured[:7]}, lib/fast.py changed since in {changed})"
    assert [stale_line(q, v) for q, v in after.stale] == [
        f"README.md:3 quotes stale {why}", f"docs/guide.md:3 quotes stale {why}"]
    assert after.problems == [] and after.verdicts["fresh"][0].changed == {}
    assert after.verdicts["stale"][0].commits == 1


def test_a_result_with_no_declared_paths_is_reported(project):
    root, measured = project
    _write(root, {"bench/results/orphan.md": "9 ms\n", "bench/results/empty.txt": "1 ms\n"})
    _manifest(root, {"fresh": {"commit": measured, "measures": ["lib/slow.py"]},
                     "empty": {"commit": measured, "measures": []}})
    problems = check(root).problems
    assert any(p.startswith("orphan: no measured paths declared") for p in problems), problems
    assert any(p.startswith("empty: no measured paths declared") for p in problems), problems


def test_the_declarations_are_held_to_the_results_and_to_git(project):
    """A manifest entry for no result or for a result that declares itself, a commit the result
    contradicts or git does not know, a path that never existed: each a problem."""
    root, measured = project
    first = git(root, "rev-list", "--max-parents=0", "HEAD")
    _write(root, {"bench/results/old.json": json.dumps({"meta": {"commit": measured}}),
                  "bench/results/lost.txt": "1\n", "bench/results/typo.txt": "2\n"})
    _manifest(root, {"fresh": {"commit": measured, "measures": ["lib/slow.py"]},
                     "stale": {"commit": measured, "measures": ["lib/fast.py"]},
                     "gone": {"commit": measured, "measures": ["lib/slow.py"]},
                     "old": {"commit": first, "measures": ["code.py"]},
                     "lost": {"commit": "0" * 40, "measures": ["code.py"]},
                     "typo": {"commit": measured, "measures": ["lib/fats.py"]}})
    problems = "\n".join(check(root).problems)
    for expected in ("stale: its JSON declares its code; drop its entry",
                     "MEASURES.json names gone, which is not under bench/results/",
                     f"old: MEASURES.json says commit {first}, its JSON records {measured[:7]}",
                     f"lost: commit {'0' * 40} (bench/results/MEASURES.json) is not in this",
                     "typo: measured path lib/fats.py (bench/results/MEASURES.json) exists"):
        assert expected in problems


def test_a_quote_of_a_name_not_under_results_is_reported(project):
    root, _ = project
    _write(root, {"docs/guide.md": GUIDE + "And `bench/results/gone.md`.\n"})
    assert check(root).problems == [
        "docs/guide.md:4 quotes bench/results/gone.md, which is not there"]


def test_the_command_prints_json_and_fails_on_a_stale_quote(project, capsys):
    root, measured = project
    assert main(["--root", str(root)]) == 0
    assert "3 quotes of 2 results; 0 stale (none); 0 marked stale; 0 problems" in (
        capsys.readouterr().out)
    _write(root, {"code.py": "FIGURE = 2\n"})
    changed = git(root, "rev-parse", "--short", _commit(root, "figure"))
    assert main(["--root", str(root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(s["doc"], s["line"], s["result"], s["changed"]) for s in report["stale"]] == [
        ("README.md", 3, "stale", {"code.py": changed}),
        ("docs/guide.md", 3, "stale", {"code.py": changed})]
    assert report["results"]["stale"][0]["commit"] == measured and report["problems"] == []


def test_a_quote_that_says_since_when_it_is_stale_passes_and_a_wrong_mark_fails(project):
    root, measured = project
    _write(root, {"lib/fast.py": "X = 2\n"})
    changed = git(root, "rev-parse", "--short", _commit(root, "faster"))
    marked = README.replace("`bench/results/stale.md`)", f"`bench/results/stale.md`) (stale since "
                                                        f"{changed})")
    _write(root, {"README.md": marked})
    _commit(root, "marked")
    report = check(root)
    # the README's quote says so; the guide's does not, and stays stale
    assert [(q.doc, q.result) for q, _ in report.marked] == [("README.md", "stale")]
    assert [(q.doc, q.result) for q, _ in report.stale] == [("docs/guide.md", "stale")]
    assert report.problems == []
    # a mark naming another commit, or on a quote of a fresh result, is a problem
    wrong = marked.replace(changed, measured[:7]).replace(
        "`bench/results/fresh.txt`)", f"`bench/results/fresh.txt`) (stale since {changed})")
    _write(root, {"README.md": wrong})
    _commit(root, "wrong marks")
    report = check(root)
    assert ("README.md", "stale") in [(q.doc, q.result) for q, _ in report.stale]
    assert [p.split(" says")[0] for p in report.problems] == ["README.md:3", "README.md:4"]
    assert all("drop or correct the mark" in p for p in report.problems)
