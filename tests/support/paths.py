"""Where the tests find the repository: its root, for the files they read and the scripts they run
by path, and the hostile peer the fault tests start; `load_script(path)` imports a script that is
not in a package (`bench/*.py`) as a module."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
ROGUE_PEER = ROOT / "tests" / "support" / "rogue_peer.py"


def load_script(path: Path, name: str) -> ModuleType:
    """The script at `path` run as the module `name` (registered, so its dataclasses find it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
