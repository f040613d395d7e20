"""The documentation's promises, checked on the files (fast: no processes, no network).

- `README.md` has at most `README_MAX_LINES` lines and, before its first section heading, its
  first code block is the two commands `make demo` and `make test`;
- every file under `bench/results/` is named in `bench/results/README.md` (a file in a folder by
  its path, or by its name with each of its folders named too);
- every relative link in `README.md`, `docs/*.md` and the READMEs the docs split wrote
  (`bench/results/README.md`, `helm/rekv/README.md`, `tests/README.md`) resolves to an existing
  path.

Each check is a function returning what is wrong (empty when nothing is), tested here on broken
inputs as well as on the repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.paths import ROOT

RESULTS = ROOT / "bench" / "results"
README_MAX_LINES = 200
README_COMMANDS = ("make demo", "make test")

_FENCE = re.compile(r"^\s*```")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_NAME_END = r"(?![\w-]|\.\w)"


def _outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    lines, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append((number, line))
    return lines


def readme_problems(text: str) -> list[str]:
    """What breaks the README's promises: its length, and the two commands first."""
    problems = []
    lines = text.splitlines()
    if len(lines) > README_MAX_LINES:
        problems.append(f"README has {len(lines)} lines, more than {README_MAX_LINES}")
    block, inside = None, False
    for line in lines:
        if _FENCE.match(line):
            if inside:
                break
            inside, block = True, []
        elif inside:
            block.append(line)
        elif line.startswith("## "):
            break
    commands = [line.split("#")[0].strip() for line in block or [] if line.strip()]
    if tuple(commands) != README_COMMANDS:
        problems.append(f"the first code block before any section is {commands or 'missing'}, "
                        f"not the commands {list(README_COMMANDS)}")
    return problems


def _named(text: str, relative: Path) -> bool:
    if len(relative.parts) == 1:
        start = r"(?:(?<![\w./-])|(?<=bench/results/))"
        return re.search(start + re.escape(relative.name) + _NAME_END, text) is not None
    whole = r"(?<![\w./-])" + re.escape(relative.as_posix()) + _NAME_END
    if re.search(whole, text):
        return True
    words = [re.escape(folder) + "/" for folder in relative.parts[:-1]]
    words.append(re.escape(relative.name) + _NAME_END)
    return all(re.search(r"(?<![\w.-])" + word, text) for word in words)


def unindexed_results(results: Path) -> list[str]:
    """Files under `results` that its README.md does not name."""
    text = (results / "README.md").read_text()
    files = sorted(p.relative_to(results) for p in results.rglob("*") if p.is_file())
    return [f.as_posix() for f in files if f != Path("README.md") and not _named(text, f)]


def broken_links(doc: Path, root: Path) -> list[str]:
    """Relative link targets in `doc` (outside code blocks) that do not exist under `root`."""
    broken = []
    for number, line in _outside_fences(doc.read_text()):
        for target in _LINK.findall(line):
            path = target.split("#")[0]
            if not path or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # an anchor on the same page, or a URL
            if not (doc.parent / path).resolve().exists():
                broken.append(f"{doc.relative_to(root)}:{number}: {target}")
    return broken


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), RESULTS / "README.md",
            ROOT / "helm" / "rekv" / "README.md", ROOT / "tests" / "README.md"]


# The repository


def test_readme_is_short_and_starts_with_the_two_commands():
    assert readme_problems((ROOT / "README.md").read_text()) == []


def test_every_result_file_is_indexed():
    assert unindexed_results(RESULTS) == []


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    assert broken_links(doc, ROOT) == []


# The checks themselves, on broken inputs


GOOD_README = "# x\n\nwhat it is\n\n```sh\nmake demo   # a\nmake test   # b\n```\n\n## More\n"


def test_readme_check_passes_a_good_readme():
    assert readme_problems(GOOD_README) == []


def test_readme_check_catches_a_long_readme():
    long = GOOD_README + "line\n" * README_MAX_LINES
    assert any("more than 200" in p for p in readme_problems(long))


@pytest.mark.parametrize("text", [
    "# x\n\n## Start\n\n```sh\nmake demo\nmake test\n```\n",       # commands after a section
    "# x\n\n```sh\nmake test\nmake demo\n```\n",                     # out of order
    "# x\n\n```sh\npip install rekv\n```\n\n```sh\nmake demo\nmake test\n```\n",  # not first
    "# x\n\n```sh\nmake demo\n```\n",                                # one missing
    "# x\n\nno commands at all\n",
], ids=["after-a-heading", "swapped", "second-block", "one-missing", "none"])
def test_readme_check_catches_commands_not_first(text):
    assert any("not the commands" in p for p in readme_problems(text))


def _results(tmp_path: Path, readme: str, files: list[str]) -> Path:
    results = tmp_path / "results"
    for name in files:
        (results / name).parent.mkdir(parents=True, exist_ok=True)
        (results / name).write_text("{}")
    (results / "README.md").write_text(readme)
    return results


def test_results_check_passes_when_every_file_is_named(tmp_path):
    results = _results(tmp_path, "- `a.json`, `bench/results/b.txt`\n- `runs/`: `c.json`, "
                       "`runs/d.json`\n", ["a.json", "b.txt", "runs/c.json", "runs/d.json"])
    assert unindexed_results(results) == []


def test_results_check_catches_an_unnamed_file(tmp_path):
    results = _results(tmp_path, "- `a.json`\n", ["a.json", "b.json"])
    assert unindexed_results(results) == ["b.json"]


def test_results_check_does_not_take_a_longer_name_for_a_shorter_one(tmp_path):
    readme = "- `link-ttft.json`, `ttft-2.json`, `runs/x.json.gz`\n"
    results = _results(tmp_path, readme, ["link-ttft.json", "ttft.json", "ttft-2.json",
                                          "runs/x.json.gz", "runs/x.json"])
    assert unindexed_results(results) == ["runs/x.json", "ttft.json"]


def test_results_check_wants_a_nested_files_folder_named_too(tmp_path):
    results = _results(tmp_path, "- `c.json`\n", ["runs/c.json"])
    assert unindexed_results(results) == ["runs/c.json"]


def test_link_check_catches_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "there.md").write_text("x")
    doc = tmp_path / "docs" / "page.md"
    doc.write_text("[ok](../there.md#part) [gone](../missing.md) [web](https://example.com/x)\n"
                   "[anchor](#top)\n```\n[in code](nowhere.md)\n```\n"
                   "![picture](img/none.png)\n")
    assert broken_links(doc, tmp_path) == [
        "docs/page.md:1: ../missing.md", "docs/page.md:6: img/none.png"]
