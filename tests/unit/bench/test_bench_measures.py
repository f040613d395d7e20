"""Every writer of a result declares the code it measures (`provenance(measures=...)`, read by
`rekv_cli.bench.staleness`), and every path it names is in the tree; checked on the source."""

import ast
from pathlib import Path

from tests.support.paths import ROOT

SOURCES = ("rekv_cli", "bench")
SHARED = ("SERVICES", "LINK", "IN_PROCESS")  # the shared sets in rekv_cli/bench/provenance.py


def _trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for top in SOURCES
            for path in sorted((ROOT / top).rglob("*.py"))}


def _called(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")


def undeclared_calls(tree: ast.Module) -> list[int]:
    """Lines where `provenance(...)` is called without `measures=`."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and _called(node) == "provenance" and "measures" not in {k.arg for k in node.keywords}]


def declared_paths(tree: ast.Module) -> set[str]:
    """Every string in a `measures=` argument or in a module-level `*MEASURES` or shared set."""
    values = [k.value for node in ast.walk(tree) if isinstance(node, ast.Call)
              for k in node.keywords if k.arg == "measures"]
    values += [node.value for node in tree.body if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Name)
               and (target.id.endswith("MEASURES") or target.id in SHARED)]
    return {node.value for value in values for node in ast.walk(value)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_every_provenance_call_declares_what_it_measures():
    wrong = [f"{path.relative_to(ROOT)}:{line}" for path, tree in _trees().items()
             for line in undeclared_calls(tree)]
    assert not wrong, "provenance() without measures=: " + ", ".join(wrong)


def test_every_declared_path_is_in_the_tree():
    declared = {p for tree in _trees().values() for p in declared_paths(tree)}
    assert {"rekv_core", "services", "bench/decode_engine.py"} <= declared
    missing = sorted(p for p in declared if not (ROOT / p).exists())
    assert not missing, f"declared as measured, not in the tree: {missing}"


def test_the_checks_catch_an_undeclared_call_and_collect_every_declared_path():
    tree = ast.parse("MEASURES = (*SERVICES, 'bench/x.py')\nSERVICES = ('rekv_core',)\n"
                     "def run():\n    a = provenance()\n"
                     "    b = module.provenance(measures=MEASURES)\n"
                     "    return sweep(args, measures=('bench/y.py',))\n")
    assert undeclared_calls(tree) == [4]
    assert declared_paths(tree) == {"bench/x.py", "rekv_core", "bench/y.py"}
