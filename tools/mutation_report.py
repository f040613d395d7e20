"""The report of `make mutate`: mutmut's results over rekv_core/plan, handoff and engine, with the
hand-written verdict on every mutant that no test killed.

    python tools/mutation_report.py begin      record this run's commit (mutants/rekv-runs.json),
                                               first restoring the committed report's results
                                               into a fresh mutants/
    python tools/mutation_report.py [--out STEM] [--triage FILE]
                                               write STEM.md and STEM.json from mutants/

Run from the repository's top in .venv-mutate (the Makefile does both). The results are mutmut's
own records under mutants/ (a `.meta` JSON per source file: each mutant's exit code), read and
classified with the functions that `mutmut results` and `mutmut show` call (mutmut is pinned in
requirements/mutate.lock), so the statuses and diffs are exactly those the two commands print, for
thousands of mutants in one process.

The report (default bench/results/mutation-rekv-core.{md,json}) gives the machine, the commit and
whether the tree was clean (`rekv_cli.bench.provenance`), the runs that made the results, the
command, counts per package and per module, and every mutant that no test killed (survived, no
tests, suspicious, segfault), plus every one the triage names, with its file:line, its diff and
its `verdict`, read from the triage file (default tools/mutation_triage.json, edited by
hand and never written here): `{"verdicts": {mutant name: "killed by <test>" or "equivalent:
<why>"}}`. A mutant without one is `untriaged`. A name is stable while its function's source is:
mutmut numbers a function's mutants afresh only when the function changes, and then tests them
again. A `killed by` verdict is proven by rerunning the mutant (`mutmut run NAME`): its status
then reads `killed`.

The report's JSON also keeps every mutant's result (`state`: per source file, each function's
hash and each checked mutant's exit code), since mutants/ is not kept in git: `begin` on a
machine without mutants/ writes them back as mutmut's `.meta` files (and the runs so far), and
mutmut, generating the mutants afresh, keeps the result of every mutant whose function's hash is
unchanged. So a run resumes where the last committed report stopped, on any machine.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from collections import Counter
from pathlib import Path

import libcst as cst
from mutmut.configuration import config
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import (get_diff_for_mutant, read_functions_from_index,
                                        read_mutants_module, read_original_function)
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files
from mutmut.utils.format_utils import orig_function_and_class_names_from_key

from rekv_cli.bench.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = Path("mutants")
RUNS = MUTANTS / "rekv-runs.json"
OUT = Path("bench/results/mutation-rekv-core")
TRIAGE = Path("tools/mutation_triage.json")
COMMAND = "make mutate (mutmut run, then python tools/mutation_report.py)"
# What the results depend on: the mutated code and the tests run against it.
MEASURES = ("rekv_core/plan", "rekv_core/handoff", "rekv_core/engine", "tests/unit/plan",
            "tests/unit/handoff", "tests/unit/engine")
# The columns, in order: mutmut's statuses (stats.status_by_exit_code); killed and timeout count
# as caught, as in mutmut's own score.
STATUSES = ("killed", "survived", "timeout", "no tests", "skipped", "suspicious", "segfault",
            "caught by type check", "check was interrupted by user", "not checked")
CAUGHT = ("killed", "timeout", "caught by type check")
# Listed one by one: what no test killed (skipped: `# pragma: no mutate`; not checked: not yet run).
LISTED = ("survived", "no tests", "suspicious", "segfault")
VERDICT = re.compile(r"^(killed by \S.*|equivalent: \S.*)$")


def machine() -> dict:
    """The CPU, cores, memory and the versions that run the tests."""
    cpu = next((line.split(":", 1)[1].strip() for line in _lines("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) // 1024 ** 2 for line in _lines("/proc/meminfo")
                if line.startswith("MemTotal")), None)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem,
            "python": platform.python_version(), "platform": platform.platform(),
            "mutmut": importlib.metadata.version("mutmut"),
            "torch": importlib.metadata.version("torch")}


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def begin(report_json: Path) -> None:
    """Appends this run's provenance (commit, clean tree, start) to mutants/rekv-runs.json, first
    restoring `report_json`'s results into mutants/ where it holds none (`restore`)."""
    recorded = json.loads(report_json.read_text(encoding="utf-8")) if report_json.exists() else {}
    if not RUNS.exists() and "state" in recorded:
        restored = restore(recorded, read_triage(TRIAGE))
        print(f"restored {restored} mutants' results from {report_json}")
    MUTANTS.mkdir(exist_ok=True)
    runs = json.loads(RUNS.read_text()) if RUNS.exists() else []
    runs.append(provenance(ROOT, measures=MEASURES))
    RUNS.write_text(json.dumps(runs, indent=1) + "\n")


def state() -> dict[str, dict]:
    """mutmut's own records, enough to resume: {source file: {"hashes": {function: hash},
    "exit_codes": {mutant name less its module: exit code}}}, checked mutants only."""
    out = {}
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        prefix = _module(path) + "."
        out[path.as_posix()] = {
            "hashes": dict(sorted(data.hash_by_function_name.items())),
            "exit_codes": {name.removeprefix(prefix): code
                           for name, code in sorted(data.exit_code_by_key.items())
                           if code is not None}}
    return out


def restore(report_data: dict, verdicts: dict[str, str]) -> int:
    """Writes `report_data`'s runs and `state` into mutants/ as mutmut's `.meta` files; returns
    how many mutants' results it restored. mutmut keeps a result only while its function's hash
    is the one recorded (it drops the rest when it generates the mutants). A mutant whose verdict
    says a test kills it but that is recorded otherwise than killed (it survived, or timed out
    under a limit since found too short) is left out, so the run tests it again and the report
    shows whether the test kills it."""
    MUTANTS.mkdir(exist_ok=True)
    RUNS.write_text(json.dumps(report_data.get("runs", []), indent=1) + "\n")
    restored = 0
    for path, recorded in report_data.get("state", {}).items():
        data = SourceFileMutationData(path=path)
        prefix = _module(Path(path)) + "."
        data.hash_by_function_name = dict(recorded["hashes"])
        data.exit_code_by_key = {
            prefix + name: code for name, code in recorded["exit_codes"].items()
            if status_by_exit_code[code] == "killed"
            or not verdicts.get(prefix + name, "").startswith("killed by")}
        data.meta_path.parent.mkdir(parents=True, exist_ok=True)
        data.save()
        restored += len(data.exit_code_by_key)
    return restored


def _module(path: Path) -> str:
    return ".".join(path.with_suffix("").parts).removesuffix(".__init__")


def read_results() -> list[dict]:
    """One record per mutant: name, source file, module, package and status."""
    records = []
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        module = _module(path)
        for name, exit_code in data.exit_code_by_key.items():
            records.append({"name": name, "file": path.as_posix(), "module": module,
                            "package": "/".join(path.parts[:2]),
                            "status": status_by_exit_code[exit_code]})
    return records


def counts(records: list[dict], key: str) -> dict[str, dict[str, int]]:
    """{value of `key`: {status: count, total, score}}, in sorted order, and an "all" row."""
    groups: dict[str, Counter] = {}
    for record in records:
        groups.setdefault(record[key], Counter())[record["status"]] += 1
    groups = dict(sorted(groups.items()))
    groups["all"] = sum(groups.values(), Counter())
    return {name: _row(counter) for name, counter in groups.items()}


def _row(counter: Counter) -> dict:
    row = {status: counter.get(status, 0) for status in STATUSES}
    row["total"] = sum(counter.values())
    tested = row["total"] - row["skipped"] - row["not checked"]
    row["score"] = round(100 * sum(row[s] for s in CAUGHT) / tested, 1) if tested else None
    return row


def read_triage(path: Path) -> dict[str, str]:
    """The hand-written verdicts; SystemExit naming any that is neither form."""
    if not path.exists():
        return {}
    verdicts = json.loads(path.read_text()).get("verdicts", {})
    wrong = [f"{name}: {verdict!r}" for name, verdict in verdicts.items()
             if not isinstance(verdict, str) or not VERDICT.match(verdict)]
    if wrong:
        raise SystemExit(f"{path}: a verdict is 'killed by <test>' or 'equivalent: <why>':\n"
                         + "\n".join(wrong))
    return verdicts


def mutated_line(path: str, name: str, diff: str) -> int | None:
    """The line of `path` that the mutant changes: the diff's first removed line, counted in the
    unmutated function as mutmut prints it (from its comments and decorators on) and placed by
    the function's `def` line in the file."""
    function, cls = orig_function_and_class_names_from_key(name)
    tree = ast.parse(Path(path).read_text())
    scope = tree.body if cls is None else next(
        (n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), [])
    node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == function), None)
    changed = _first_changed(diff)
    original = _original_function(name, path).splitlines()
    def_at = next((i for i, line in enumerate(original, 1) if _DEF.match(line)), None)
    if node is None or changed is None or def_at is None:
        return None
    return node.lineno + changed - def_at


_DEF = re.compile(r"\s*(async\s+)?def\s")


def _first_changed(diff: str) -> int | None:
    """The line number, in the diff's `---` side, of its first removed (or else added) line."""
    number = None
    for line in diff.splitlines():
        hunk = re.match(r"@@ -(\d+)", line)
        if hunk:
            number = int(hunk.group(1))
        elif number is not None and line.startswith(("-", "+")):
            return number
        elif number is not None:
            number += 1
    return None


def _original_function(name: str, path: str) -> str:
    """The unmutated function as `mutmut show` diffs it (mutmut.mutation.diff_apply)."""
    functions = read_functions_from_index(name, path)
    if functions is None:
        functions = (read_original_function(read_mutants_module(path), name),)
    return cst.Module([functions[0]]).code.strip()


def listed(records: list[dict], verdicts: dict[str, str]) -> list[dict]:
    """Every mutant no test killed and every triaged one, with its line, diff and verdict."""
    rows = []
    for record in records:
        if record["status"] not in LISTED and record["name"] not in verdicts:
            continue
        diff = get_diff_for_mutant(record["name"], path=record["file"])
        verdict = verdicts.get(record["name"], "untriaged")
        rows.append({**record, "line": mutated_line(record["file"], record["name"], diff),
                     "diff": diff, "verdict": verdict,
                     "note": _note(record["status"], verdict, record["name"])})
    return rows


def _note(status: str, verdict: str, name: str) -> str:
    if verdict.startswith("killed by") and status == "timeout":
        return "caught: the test waits out its hang limit under this mutant, past mutmut's"
    if verdict.startswith("killed by") and status not in CAUGHT:
        return f"not rerun since: mutmut run '{name}'"
    if verdict.startswith("equivalent") and status == "killed":
        return "killed although triaged equivalent"
    return ""


def report(records: list[dict], verdicts: dict[str, str]) -> dict:
    """The JSON report (what the Markdown shows)."""
    runs = json.loads(RUNS.read_text()) if RUNS.exists() else []
    rows = listed(records, verdicts)
    known = {record["name"] for record in records}
    cfg = config()
    return {
        "meta": {**provenance(ROOT, measures=MEASURES), "machine": machine(), "command": COMMAND,
                 "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "mutated": [p.as_posix() for p in cfg.source_paths],
                 "tests": cfg.pytest_add_cli_args_test_selection,
                 "process_isolation": cfg.process_isolation.value},
        "runs": runs,
        "packages": counts(records, "package"),
        "modules": counts(records, "module"),
        "listed": rows,
        "triage_of_unknown_mutants": sorted(set(verdicts) - known),
        "state": state(),
    }


def markdown(data: dict) -> str:
    meta, machine_ = data["meta"], data["meta"]["machine"]
    clean = {True: "a clean tree", False: "uncommitted changes in tracked files",
             None: "tree state unknown"}[meta["tree_clean"]]
    out = [
        "# Mutation testing of rekv_core/plan, rekv_core/handoff, rekv_core/engine", "",
        f"Written by `tools/mutation_report.py` at {meta['written']}, commit {meta['commit']} "
        f"({clean}). Command: `{meta['command']}`; mutmut {machine_['mutmut']} "
        f"([tool.mutmut] in pyproject.toml, process isolation `{meta['process_isolation']}`) "
        f"mutating {', '.join(f'`{p}`' for p in meta['mutated'])} against "
        f"{', '.join(f'`{t}`' for t in meta['tests'])}. Machine: {machine_['cpu']}, "
        f"{machine_['cores']} cores, {machine_['memory_gib']} GiB, Python {machine_['python']}, "
        f"torch {machine_['torch']}.", "",
        "Runs that made these results (each resumes the last: a result stands until its "
        "function's source changes):", "",
        *[f"- {run['started']}: commit {run['commit']}, "
          f"{'clean' if run['tree_clean'] else 'not clean'}" for run in data["runs"]], "",
        "Score: (killed + timeout + caught by type check) / (total - skipped - not checked).", "",
        "## Per package", "", *_table(data["packages"], "package"), "",
        "## Per module", "", *_table(data["modules"], "module"), "",
        "## Not killed, and triaged", "",
        "Every mutant no test killed (survived, no tests, suspicious, segfault) and every one "
        "`tools/mutation_triage.json` names; `verdict` comes from that file.", "",
        "| mutant | where | status | verdict |", "| --- | --- | --- | --- |",
        *[f"| `{r['name']}` | `{r['file']}:{r['line']}` | {r['status']} | "
          f"{_cell(r['verdict'])}{' (' + r['note'] + ')' if r['note'] else ''} |"
          for r in data["listed"]], "",
    ]
    for row in data["listed"]:
        out += [f"### `{row['name']}`", "", f"`{row['file']}:{row['line']}`, {row['status']}, "
                f"verdict: {row['verdict']}", "", "```diff", row["diff"], "```", ""]
    if data["triage_of_unknown_mutants"]:
        out += ["## Triage of mutants mutmut no longer has", "",
                *[f"- `{name}`" for name in data["triage_of_unknown_mutants"]], ""]
    return "\n".join(out)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(groups: dict[str, dict], key: str) -> list[str]:
    shown = [s for s in STATUSES if s in ("killed", "survived", "timeout", "no tests", "skipped",
                                          "suspicious") or groups["all"][s]]
    head = [key, *shown, "total", "score %"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, row in groups.items():
        cells = [f"**{name}**" if name == "all" else f"`{name}`",
                 *[str(row[s]) for s in shown], str(row["total"]),
                 "" if row["score"] is None else f"{row['score']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", nargs="?", choices=["begin", "report"], default="report")
    parser.add_argument("--out", type=Path, default=OUT, help="STEM of STEM.md and STEM.json")
    parser.add_argument("--triage", type=Path, default=TRIAGE)
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    os.environ.setdefault("GIT_OPTIONAL_LOCKS", "0")  # git status reads, never refreshes the index
    if args.step == "begin":
        begin(Path(f"{args.out}.json"))
        return 0
    records = read_results()
    if not records:
        print("no mutants under mutants/: run `make mutate` first", file=sys.stderr)
        return 1
    data = report(records, read_triage(args.triage))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n",
                                       encoding="utf-8")
    Path(f"{args.out}.md").write_text(markdown(data), encoding="utf-8")
    total = data["packages"]["all"]
    print(f"{args.out}.md, .json: {total['total']} mutants, {total['killed']} killed, "
          f"{total['survived']} survived, {total['not checked']} not checked; "
          f"{sum(r['verdict'] == 'untriaged' for r in data['listed'])} untriaged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
