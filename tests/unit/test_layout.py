"""The tests' own map, checked: every test file is under tests/unit or tests/system, every helper
under tests/support, and nothing under tests/unit starts a process, a network namespace or an
external tool (itself or through a support module it imports), so `pytest tests/unit` stays the
fast subset. The `system` marker follows the folder."""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import pytest_collection_modifyitems
from tests.support.paths import ROOT

TESTS = ROOT / "tests"
# modules whose import means starting processes: subprocess and its kin, the services' launcher,
# the emulated link's network namespaces
STARTERS = ("subprocess", "multiprocessing", "pty", "rekv_cli.launcher",
            "rekv_cli.bench.link.netns")
# and the same in the text, however it is reached: a Popen, an os-level start, `ip netns`, the
# deployment tools under .tools/
STARTS = re.compile(r"\bPopen\b|\bos\.(system|fork|spawn\w*|exec\w*|posix_spawn\w*)\b"
                    r"|create_subprocess_\w+|\bip netns\b|\bnetns\b|[\"'/]\.tools\b")


def _imported(path: Path) -> set[str]:
    """Every module this file imports, at any depth; `from a import b` names both a and a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def process_starts(path: Path, root: Path = ROOT) -> list[str]:
    """What in this file, or in a tests.support module it imports, starts a process."""
    found = []
    for module in sorted(_imported(path)):
        if any(module == s or module.startswith(s + ".") for s in STARTERS):
            found.append(f"imports {module}")
        elif module.startswith("tests.support."):
            helper = root.joinpath(*module.split(".")).with_suffix(".py")
            if helper.is_file():
                found += [f"through {module}: {why}" for why in process_starts(helper, root)]
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if match := STARTS.search(line):
            found.append(f"line {number}: {match.group(0)}")
    return found


def misplaced(tests: Path) -> list[str]:
    """Test files outside tests/unit and tests/system, other modules outside tests/support."""
    wrong = []
    for path in sorted(tests.rglob("*.py")):
        relative = path.relative_to(tests)
        top = relative.parts[0] if len(relative.parts) > 1 else ""
        if path.name in ("__init__.py",) or relative == Path("conftest.py"):
            continue
        if path.name.startswith("test_") and top not in ("unit", "system"):
            wrong.append(f"{relative}: a test file outside unit/ and system/")
        elif not path.name.startswith("test_") and top != "support":
            wrong.append(f"{relative}: a helper outside support/")
    return wrong


def test_no_unit_test_starts_a_process():
    wrong = [f"{path.relative_to(ROOT)}: {why}" for path in sorted((TESTS / "unit").rglob("*.py"))
             if path != Path(__file__).resolve() for why in process_starts(path)]
    assert not wrong, "move these tests to tests/system:\n" + "\n".join(wrong)


def test_every_file_is_on_the_map():
    assert not misplaced(TESTS), "\n".join(misplaced(TESTS))
    assert (TESTS / "unit").is_dir() and (TESTS / "system").is_dir()


def test_the_process_check_catches_a_start_direct_or_through_a_helper(tmp_path):
    support = tmp_path / "tests" / "support"
    support.mkdir(parents=True)
    (support / "runner.py").write_text("import subprocess\n")
    (support / "quiet.py").write_text("def add(a, b):\n    return a + b\n")
    clean = tmp_path / "test_clean.py"
    clean.write_text("from tests.support.quiet import add\n\n\ndef test_add():\n"
                     "    assert add(1, 2) == 3\n")
    assert process_starts(clean, tmp_path) == []
    cases = {"import subprocess\n": "imports subprocess",
             "def f():\n    from rekv_cli.launcher import ServicePair\n":
                 "imports rekv_cli.launcher",
             "from tests.support.runner import run\n":
                 "through tests.support.runner: imports subprocess",
             "import os\nos.system('true')\n": "line 2: os.system",
             "RUN = ['ip', 'netns', 'exec']\nCMD = 'ip netns add x'\n": "line 1: netns",
             "TOOL = ROOT / '.tools' / 'bin' / 'helm'\n": "line 1: '.tools",
             "p = sp.Popen(['ls'])\n": "line 1: Popen"}
    for source, why in cases.items():
        bad = tmp_path / "test_bad.py"
        bad.write_text(source)
        assert why in process_starts(bad, tmp_path), source


def test_the_map_check_catches_a_stray_file(tmp_path):
    for relative in ("conftest.py", "unit/codecs/test_a.py", "system/test_b.py",
                     "support/helper.py", "unit/__init__.py"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("")
    assert misplaced(tmp_path) == []
    (tmp_path / "test_flat.py").write_text("")
    (tmp_path / "support" / "test_helper.py").write_text("")
    (tmp_path / "unit" / "builders.py").write_text("")
    assert misplaced(tmp_path) == ["support/test_helper.py: a test file outside unit/ and system/",
                                   "test_flat.py: a test file outside unit/ and system/",
                                   "unit/builders.py: a helper outside support/"]


@pytest.mark.parametrize("where, marked", [("system/test_cli.py", True),
                                           ("system/deeper/test_x.py", True),
                                           ("unit/test_docs.py", False),
                                           ("unit/system/test_x.py", False)])
def test_the_system_marker_follows_the_folder(where, marked):
    added = []
    item = SimpleNamespace(path=TESTS / where, nodeid=f"tests/{where}::test",
                           add_marker=added.append)
    pytest_collection_modifyitems([item])
    assert [m.name for m in added] == (["system"] if marked else [])
