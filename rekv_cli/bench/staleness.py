"""Figures that say when they went stale: which quotes of `bench/results/` in the README and
`docs/` name a result whose measured code changed after the commit it ran at.

The contract:

- A *result* is a file at the top of `bench/results/`, named by its stem (its name less the last
  suffix: `demo-cpu.json` and `demo-cpu.txt` are the result `demo-cpu`), or a folder there, named
  by the folder (`throughput-orders`). `README.md` (the index) and `MEASURES.json` are none.
- Every result *declares* the commit its figures come from and the code they measure: paths
  relative to the repository's top, files or folders. Its JSON declares it where it holds an
  object with both `commit` and `measures` (what `rekv_cli.bench.provenance.provenance()` writes;
  a result combining runs holds one each); else `bench/results/MEASURES.json` does:
  `{"results": {stem: {"commit": sha, "measures": [path, ...], "commit_recorded": bool}}}`, for the
  results written before runs declared their code (`commit_recorded` false: the result names no
  commit, and the one given is the commit that added it to git).
- A *quote* is, in `README.md` or a `docs/**/*.md` file, outside fenced code blocks, a path
  `bench/results/<name>...` (`../bench/results/...` too) or a result's file or folder name standing
  alone (`lynx-mini-qwen2.5-7b.md`). A command in a code block quotes no figure.
- A result is *stale* when one of its measured paths differs between its commit and HEAD
  (`git diff`); each quote of it is reported as `<doc>:<line> quotes <result> (measured at
  <commit>, <path> changed since in <commit2>)`: the path whose change came first, and the first
  commit after the declared one that changed it (when the figures went stale).
- A stale quote may stay where its line says so: `(stale since <commit2>)`, naming the commit
  that made it stale (the first commit after the result's that changed a measured path, as the
  report gives it). The check lists such a quote as *marked*, not stale, so a reader sees how old
  the figure is and since when the code differs; a mark on a line whose result is not stale (it
  was rerun) is a problem, so the mark goes with the staleness.
- *Problems* fail the check as well: a result with no declaration; a manifest entry naming no
  result, or a result whose own JSON declares already (drop the entry once a rerun is committed);
  a manifest commit other than every commit the result's JSON records; a commit git does not know;
  a measured path that exists neither at its commit nor at HEAD; a quote of a name that is not
  under `bench/results/`.

`check(root)` returns the `Report`. `python -m rekv_cli.bench.staleness [--root DIR] [--json]`
prints it (`--json`: as one JSON object, every result's verdict included) and exits 1 when a quote
is stale or there is a problem, 0 otherwise. The working tree's uncommitted changes are not looked
at: HEAD is what the figures are compared with.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path("bench") / "results"
MANIFEST = "MEASURES.json"
NOT_RESULTS = ("README.md", MANIFEST)
_FENCE = re.compile(r"^\s*```")
_PATH_QUOTE = re.compile(r"bench/results/([\w.*-]*[\w*])")
_COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
_MARK = re.compile(r"\(stale since ([0-9a-f]{7,40})\)")


@dataclass(frozen=True)
class Declaration:
    """A result's commit and measured paths, and where they were declared."""
    commit: str
    measures: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class Quote:
    """A line of a doc that quotes a result."""
    doc: str
    line: int
    result: str
    marks: tuple[str, ...] = ()  # the commits its line's `(stale since <commit>)` marks name


@dataclass(frozen=True)
class Verdict:
    """Whether a declaration's paths changed since its commit: `changed` maps each changed path
    to the first commit after `commit` that changed it, earliest first; `commits` counts the
    commits since that changed any of them."""
    result: str
    commit: str
    changed: dict[str, str]
    commits: int


@dataclass
class Report:
    """Stale quotes (each with its verdict), problems, and every declared result's verdicts;
    `marked`: the stale quotes whose line says so (not failures)."""
    stale: list[tuple[Quote, Verdict]]
    problems: list[str]
    quotes: list[Quote]
    verdicts: dict[str, list[Verdict]]
    marked: list[tuple[Quote, Verdict]] = dataclasses.field(default_factory=list)

    def lines(self) -> list[str]:
        """The report as text, one stale quote or problem a line, then a summary."""
        out = [stale_line(q, v) for q, v in self.stale] + [f"problem: {p}" for p in self.problems]
        out += [f"marked: {stale_line(q, v)}" for q, v in self.marked]
        stale = sorted({q.result for q, _ in self.stale})
        out.append(f"{len(self.quotes)} quotes of {len({q.result for q in self.quotes})} results; "
                   f"{len(self.stale)} stale ({', '.join(stale) or 'none'}); "
                   f"{len(self.marked)} marked stale; {len(self.problems)} problems")
        return out

    def to_json(self) -> dict:
        """The report as one JSON object."""
        return {"stale": [{**asdict(q), "commit": v.commit, "changed": v.changed,
                           "commits": v.commits, "text": stale_line(q, v)}
                          for q, v in self.stale],
                "marked": [{**asdict(q), "commit": v.commit, "since": first_change(v),
                            "text": stale_line(q, v)} for q, v in self.marked],
                "problems": self.problems,
                "quotes": [asdict(q) for q in self.quotes],
                "results": {stem: [asdict(v) for v in verdicts]
                            for stem, verdicts in sorted(self.verdicts.items())}}


def first_change(verdict: Verdict) -> str:
    """The commit that made a stale verdict stale (short sha): its earliest changed path's."""
    return next(iter(verdict.changed.values()))


def stale_line(quote: Quote, verdict: Verdict) -> str:
    """`<doc>:<line> quotes <result> (measured at <commit>, <path> changed since in <commit2>)`."""
    path, since = next(iter(verdict.changed.items()))
    return (f"{quote.doc}:{quote.line} quotes {quote.result} (measured at {verdict.commit[:7]}, "
            f"{path} changed since in {since})")


# Git


def git(root: Path, *args: str) -> str:
    """The output of `git args` in `root`; CalledProcessError when git fails."""
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                          check=True).stdout.strip()


def _under(file: str, path: str) -> bool:
    """Whether the file is `path` or lies in the folder `path`."""
    return file == path or file.startswith(path.rstrip("/") + "/")


@functools.lru_cache(maxsize=None)
def resolve(root: Path, commit: str) -> str | None:
    """The full sha of `commit`, or None where git does not know it."""
    try:
        return git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    except subprocess.CalledProcessError:
        return None


@functools.lru_cache(maxsize=None)
def present(root: Path, commit: str, paths: tuple[str, ...]) -> frozenset[str]:
    """Which of `paths` (files, or folders holding a file) exist at `commit`."""
    files = git(root, "ls-tree", "-r", "--name-only", commit, "--", *paths).splitlines()
    return frozenset(p for p in paths if any(_under(f, p) for f in files))


@functools.lru_cache(maxsize=None)
def changed_since(root: Path, commit: str, head: str,
                  paths: tuple[str, ...]) -> tuple[dict[str, str], int]:
    """Each of `paths` whose content differs between `commit` and `head`, with the first commit
    after `commit` that changed it (short sha), earliest first; and how many commits since
    changed any of them."""
    files = git(root, "diff", "--name-only", commit, head, "--", *paths).splitlines()
    changed = [p for p in paths if any(_under(f, p) for f in files)]
    if not changed:
        return {}, 0
    since = f"{commit}..{head}"
    order = git(root, "log", "--reverse", "--format=%h", since, "--", *changed).splitlines()
    first = {p: (git(root, "log", "--reverse", "--format=%h", since, "--", p).split("\n", 1)[0]
                 or "?") for p in changed}
    rank = {c: i for i, c in enumerate(order)}
    earliest = sorted(changed, key=lambda p: rank.get(first[p], len(rank)))
    return {p: first[p] for p in earliest}, len(order)


# Results and their declarations


def results(root: Path) -> dict[str, list[Path]]:
    """Every result under `bench/results/`: its stem and its files."""
    found: dict[str, list[Path]] = {}
    if not (root / RESULTS).is_dir():
        return found
    for entry in sorted((root / RESULTS).iterdir()):
        if entry.name in NOT_RESULTS or entry.name.startswith("."):
            continue
        stem = entry.name if entry.is_dir() else entry.stem
        files = sorted(p for p in entry.rglob("*") if p.is_file()) if entry.is_dir() else [entry]
        found.setdefault(stem, []).extend(files)
    return found


def _objects(value):
    """Every dict inside a JSON value, itself included."""
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _objects(item)
    elif isinstance(value, list):
        for item in value:
            yield from _objects(item)


def _json(path: Path):
    """The JSON value in `path`, or None where it holds none."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def json_declarations(root: Path, files: list[Path]) -> list[Declaration]:
    """What a result's JSON files declare: each object with a `commit` and `measures`."""
    found = []
    for path in (f for f in files if f.suffix == ".json"):
        for obj in _objects(_json(path)):
            if isinstance(obj.get("commit"), str) and isinstance(obj.get("measures"), list):
                found.append(Declaration(obj["commit"], tuple(obj["measures"]),
                                         path.relative_to(root).as_posix()))
    return list(dict.fromkeys(found))


def recorded_commits(files: list[Path]) -> set[str]:
    """Every commit a result's JSON files record (`commit` or `git_commit` anywhere)."""
    found = set()
    for path in (f for f in files if f.suffix == ".json"):
        for obj in _objects(_json(path)):
            for key in ("commit", "git_commit"):
                if isinstance(obj.get(key), str) and _COMMIT.match(obj[key]):
                    found.add(obj[key])
    return found


def manifest(root: Path) -> dict[str, Declaration]:
    """`bench/results/MEASURES.json`'s entries (none where there is no such file)."""
    path = root / RESULTS / MANIFEST
    if not path.is_file():
        return {}
    source = (RESULTS / MANIFEST).as_posix()
    return {stem: Declaration(str(entry.get("commit", "")), tuple(entry.get("measures", ())),
                              source)
            for stem, entry in json.loads(path.read_text()).get("results", {}).items()}


def _same_commit(a: str, b: str) -> bool:
    """Whether two shas, either abbreviated, name the same commit."""
    return a.startswith(b) or b.startswith(a)


def declarations(root: Path) -> tuple[dict[str, list[Declaration]], list[str]]:
    """Every result's declarations (its JSON's, else the manifest's), and what is wrong with
    them: an undeclared result, a manifest entry for no result or a declared one, a manifest
    commit its JSON contradicts."""
    found, problems, listed = {}, [], manifest(root)
    for stem, files in results(root).items():
        own, entry = json_declarations(root, files), listed.get(stem)
        if own and entry:
            problems.append(f"{stem}: its JSON declares its code; drop its entry in {MANIFEST}")
        recorded = recorded_commits(files)
        if entry and not own and recorded and not any(_same_commit(entry.commit, c)
                                                      for c in recorded):
            problems.append(f"{stem}: {MANIFEST} says commit {entry.commit}, its JSON records "
                            f"{', '.join(sorted(c[:7] for c in recorded))}")
        if own or entry:
            found[stem] = own or [entry]
        else:
            problems.append(f"{stem}: no measured paths declared (its JSON declares none and "
                            f"{MANIFEST} has no entry)")
    problems += [f"{MANIFEST} names {stem}, which is not under {RESULTS.as_posix()}/"
                 for stem in sorted(set(listed) - set(results(root)))]
    return found, problems


def verdict(root: Path, head: str, stem: str,
            declared: Declaration) -> tuple[Verdict | None, list[str]]:
    """The declaration's verdict against the commit `head`, or None and the problem where git
    cannot give one; and the paths it declares that never existed."""
    commit = resolve(root, declared.commit) if declared.commit else None
    if commit is None:
        return None, [f"{stem}: commit {declared.commit} ({declared.source}) is not in this "
                      f"repository"]
    if not declared.measures:
        return None, [f"{stem}: no measured paths declared ({declared.source})"]
    paths = tuple(declared.measures)
    missing = set(paths) - present(root, commit, paths) - present(root, head, paths)
    problems = [f"{stem}: measured path {p} ({declared.source}) exists neither at "
                f"{declared.commit[:7]} nor at HEAD" for p in paths if p in missing]
    return Verdict(stem, commit, *changed_since(root, commit, head, paths)), problems


# Quotes


def docs(root: Path) -> list[Path]:
    """The README and every markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _outside_fences(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    inside = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            inside = not inside
        elif not inside:
            yield number, line


def _result_of(name: str, names: dict[str, str]) -> str | None:
    """The result a quoted name under bench/results/ is (a file, folder or stem, `stem.*` too)."""
    for candidate in (name, name.removesuffix(".*")):
        if candidate in names:
            return names[candidate]
    return None


def quotes(root: Path, stems: list[str]) -> tuple[list[Quote], list[str]]:
    """Every quote of a result in the docs, and every quoted name that is no result."""
    top = [p.name for p in (root / RESULTS).iterdir() if p.name not in NOT_RESULTS]
    names = {**{s: s for s in stems}, **{n: (n if (root / RESULTS / n).is_dir() else Path(n).stem)
                                         for n in top}}
    alternatives = "|".join(re.escape(n) for n in sorted(top, key=len, reverse=True))
    bare = re.compile(r"(?<![\w./-])(" + (alternatives or r"(?!)") + r")(?![\w-]|\.\w)")
    found, problems = [], []
    for doc in (d for d in docs(root) if d.is_file()):
        where = doc.relative_to(root).as_posix()
        for number, line in _outside_fences(doc.read_text()):
            quoted = [m.group(1) for m in _PATH_QUOTE.finditer(line)] + bare.findall(line)
            marks = tuple(_MARK.findall(line))
            for name in dict.fromkeys(n for n in quoted if n not in NOT_RESULTS):
                result = _result_of(name, names)
                if result is None:
                    problems.append(f"{where}:{number} quotes bench/results/{name}, which is not "
                                    f"there")
                else:
                    found.append(Quote(where, number, result, marks))
    return list(dict.fromkeys(found)), problems


# The check


def check(root: Path) -> Report:
    """Every stale quote and problem of the repository at `root` (see the module's docstring)."""
    root = Path(root).resolve()
    head = git(root, "rev-parse", "HEAD")
    declared, problems = declarations(root)
    verdicts: dict[str, list[Verdict]] = {}
    for stem, declarations_of in declared.items():
        for one in declarations_of:
            found, wrong = verdict(root, head, stem, one)
            problems += wrong
            if found is not None:
                verdicts.setdefault(stem, []).append(found)
    quoted, wrong = quotes(root, list(results(root)))
    stale = [(q, v) for q in quoted for v in verdicts.get(q.result, []) if v.changed]
    marked = [(q, v) for q, v in stale if any(_same_commit(m, first_change(v)) for m in q.marks)]
    return Report([s for s in stale if s not in marked], problems + wrong + _stray_marks(quoted,
                  marked), quoted, verdicts, marked)


def _stray_marks(quoted: list[Quote], marked: list[tuple[Quote, Verdict]]) -> list[str]:
    """A line's `(stale since X)` marks that no stale quote on it accounts for."""
    used: dict[tuple[str, int], set[str]] = {}
    for quote, verdict in marked:
        used.setdefault((quote.doc, quote.line), set()).add(first_change(verdict))
    problems = []
    for doc, line, marks in dict.fromkeys((q.doc, q.line, q.marks) for q in quoted if q.marks):
        for mark in marks:
            if not any(_same_commit(mark, c) for c in used.get((doc, line), ())):
                problems.append(f"{doc}:{line} says (stale since {mark}), but no result it quotes "
                                f"went stale at {mark}: drop or correct the mark")
    return problems


def main(argv: list[str] | None = None) -> int:
    """The command line: print the report, exit 1 when anything is stale or wrong."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the repository's top (default: the checkout holding this package)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = parser.parse_args(argv)
    report = check(args.root)
    print(json.dumps(report.to_json(), indent=1) if args.json else "\n".join(report.lines()))
    return 1 if report.stale or report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
