"""The house's walls, checked on the source: which layer may import which, and how big a file or
a function may grow. See the README's architecture section for the picture these encode."""

import ast
from pathlib import Path

import pytest

from tests.support.paths import ROOT

PACKAGES = ("rekv_core", "services", "rekv_cli")
GENERATED = ROOT / "services" / "rpc" / "rekv"

# Bottom to top. A module may import its own package (the longest name below that contains it)
# and the packages of lower layers, never a higher layer or another package of its own layer.
LAYERS = (
    ("rekv_core.units", "rekv_core.timing", "rekv_core.streams", "rekv_core.env",
     "rekv_core.cpu_bf16"),
    ("rekv_core.kernels", "rekv_core.transport", "rekv_core.eval"),
    ("rekv_core.model",),
    ("rekv_core.engine",),
    ("rekv_core.codecs",),
    ("rekv_core.handoff",),
    ("rekv_core.plan",),
    ("rekv_core.connector",),
    ("rekv_core.settings",),
    ("services.rpc",),
    ("services",),  # what both services share: serving, settings, metrics, calls, wire_convert
    ("services.prefill", "services.decode"),
    ("rekv_cli",),
)
CORE_NEVER = ("services", "rekv_cli", "grpc", "grpc_health", "grpc_reflection", "google.protobuf")
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80


def _sources(*tops: str) -> list[Path]:
    files = []
    for top in tops:
        files += [p for p in (ROOT / top).rglob("*.py") if GENERATED not in p.parents]
    return sorted(files)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module this file imports, at any depth (lazy imports inside functions count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def _package(module: str) -> tuple[int, str] | None:
    """(layer, package) of a project module: the longest package name in LAYERS containing it."""
    best = None
    for layer, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (
                    best is None or len(name) > len(best[1])):
                best = (layer, name)
    return best


def _within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_every_project_module_has_a_layer():
    missing = [_module(p) for p in _sources(*PACKAGES)
               if _module(p) not in PACKAGES and _package(_module(p)) is None]
    assert not missing, f"modules outside every layer: {missing}"


def test_no_module_imports_above_its_layer():
    wrong = []
    for path in _sources(*PACKAGES):
        mine = _package(_module(path))
        if mine is None:  # a top package's own __init__
            continue
        for imported in _imports(path):
            theirs = _package(imported)
            if theirs is None or theirs[1] == mine[1]:
                continue
            if theirs[0] >= mine[0]:
                wrong.append(f"{_module(path)} (layer {mine[0]}) imports {imported} "
                             f"(layer {theirs[0]})")
    assert not wrong, "\n".join(wrong)


def test_the_core_never_imports_the_services_grpc_or_protobuf():
    wrong = [f"{_module(path)} imports {imported}" for path in _sources("rekv_core")
             for imported in _imports(path) if _within(imported, CORE_NEVER)]
    assert not wrong, "\n".join(wrong)


def test_the_layer_check_catches_a_wrong_import(tmp_path):
    """The walker sees lazy imports and ranks them: a core module importing the CLI is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from rekv_cli.main import main\n    import grpc\n")
    assert _imports(bad) == {"rekv_cli.main", "grpc"}
    assert _package("rekv_cli.main")[0] > _package("rekv_core.plan.planner")[0]
    assert _within("grpc", CORE_NEVER) and _package("services.decode.server") == (
        11, "services.decode")


def _from_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from module import name` in this file, at any depth."""
    return [(node.module, alias.name) for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.ImportFrom) and node.module and not node.level
            for alias in node.names]


def _private_imports(files: dict[str, Path], project: set[str]) -> list[str]:
    """`from x import _y` in `files` (module name -> file) where x is a module of `project` and
    _y is neither a module nor a dunder: a private name taken from another module."""
    return [f"{module}: from {source} import {name}" for module, path in files.items()
            for source, name in _from_imports(path)
            if source in project and name.startswith("_") and not name.endswith("__")
            and f"{source}.{name}" not in project]


def _project_imports(path: Path, project: set[str]) -> set[str]:
    """The modules of `project` this file imports, at any depth; `from pkg import mod` imports
    the module pkg.mod (not pkg), `from pkg import name` the package pkg."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in project}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in project:
                    found.add(f"{node.module}.{alias.name}")
                elif node.module in project:
                    found.add(node.module)
    return found


def _mutual_imports(files: dict[str, Path]) -> list[str]:
    """Pairs of modules of `files` (module name -> file) that import each other, lazily or not."""
    imports = {module: _project_imports(path, set(files)) for module, path in files.items()}
    return sorted(f"{a} <-> {b}" for a, targets in imports.items() for b in targets
                  if a < b and a in imports[b])


def _files(*tops: str) -> dict[str, Path]:
    return {_module(p): p for p in _sources(*tops)}


def test_no_module_imports_a_private_name_of_another():
    wrong = _private_imports(_files(*PACKAGES, "bench"), set(_files(*PACKAGES)))
    assert not wrong, "private names taken from another module:\n" + "\n".join(wrong)


def test_no_two_modules_import_each_other():
    wrong = _mutual_imports(_files(*PACKAGES))
    assert not wrong, "modules that import each other:\n" + "\n".join(wrong)


def test_the_private_and_mutual_checks_catch_a_circle(tmp_path):
    """A lazy import back and a private name taken from another module are caught; taking a
    sibling module through its package (`from pkg import c`) is no import of the package."""
    names = ("pkg", "pkg.a", "pkg.b", "pkg.c")
    files = {name: tmp_path / f"{name}.py" for name in names}
    files["pkg"].write_text("from pkg.a import f\n")
    files["pkg.a"].write_text("from pkg.b import _g\nfrom pkg import c\n\n\ndef f():\n"
                              "    return _g()\n")
    files["pkg.b"].write_text("def _g():\n    from pkg.a import f\n    return f\n")
    files["pkg.c"].write_text("import pkg.b\nfrom pkg import __name__ as name\n")
    assert _private_imports(files, set(names)) == ["pkg.a: from pkg.b import _g"]
    assert _project_imports(files["pkg.a"], set(names)) == {"pkg.b", "pkg.c"}
    assert _project_imports(files["pkg.c"], set(names)) == {"pkg", "pkg.b"}
    assert _mutual_imports(files) == ["pkg.a <-> pkg.b"]


@pytest.mark.parametrize("top", ["rekv_core", "services", "rekv_cli", "bench", "tests"])
def test_files_and_functions_stay_small(top):
    too_long = []
    for path in _sources(top):
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                                    f"{length} lines")
    assert not too_long, "\n".join(too_long)


# What the services may take from the planning package: the values that cross the control plane.
# Calibration, load bookkeeping, cost model and planner are the connector's (`rekv_core.connector`).
SERVICES_MAY_IMPORT_FROM_PLAN = ("rekv_core.plan.evidence",)
HANDOFF_ENTRY_POINTS = ("send_handoff", "receive_handoff")


def _imported_names(path: Path) -> set[tuple[str, str]]:
    """(module, name) of every `from module import name` in the file, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {(node.module, alias.name) for alias in node.names}
    return found


def test_the_services_hold_no_load_or_calibration_arithmetic():
    """A server parses, calls its connector and replies: it imports no calibration, estimate,
    load book, cost model or planner, and never runs a handoff itself."""
    wrong = []
    for path in _sources("services"):
        for imported in _imports(path):
            if _within(imported, ("rekv_core.plan",)) and not _within(
                    imported, SERVICES_MAY_IMPORT_FROM_PLAN):
                wrong.append(f"{_module(path)} imports {imported}")
        for module, name in _imported_names(path):
            if name in HANDOFF_ENTRY_POINTS:
                wrong.append(f"{_module(path)} imports {module}.{name}")
    assert not wrong, "\n".join(wrong)


def test_the_services_check_catches_a_server_doing_the_connectors_work(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from rekv_core.plan.calibration import DecodeCalibration\n"
                   "from rekv_core.handoff import receive_handoff\n")
    assert "rekv_core.plan.calibration" in _imports(bad)
    assert not _within("rekv_core.plan.calibration", SERVICES_MAY_IMPORT_FROM_PLAN)
    assert ("rekv_core.handoff", "receive_handoff") in _imported_names(bad)


def test_the_handoff_takes_a_plan_and_a_handful_of_arguments():
    import inspect

    from rekv_core.handoff import HandoffPlan, receive_handoff, send_handoff

    sender = inspect.signature(send_handoff).parameters
    assert sender["plan"].annotation in (HandoffPlan, "HandoffPlan") and len(sender) - 1 <= 5
    assert len(inspect.signature(receive_handoff).parameters) <= 5  # the plan comes in-band


def test_no_order_or_schedule_travels_as_a_string():
    """Orders, deliveries and receive modes are enums and dataclasses: no parameter or field is
    annotated `str` under those names, and the old order strings appear nowhere."""
    wrong = []
    for path in _sources("rekv_core", "services", "rekv_cli"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.arg, ast.AnnAssign)):
                name = node.arg if isinstance(node, ast.arg) else getattr(node.target, "id", "")
                annotation = node.annotation
                if (name in ("order", "orders", "schedule", "mode", "delivery")
                        and isinstance(annotation, ast.Name) and annotation.id == "str"):
                    wrong.append(f"{_module(path)}:{node.lineno} {name}: str")
            if isinstance(node, ast.Constant) and node.value == "either":
                wrong.append(f"{_module(path)}:{node.lineno} the string 'either'")
    assert not wrong, "\n".join(wrong)
