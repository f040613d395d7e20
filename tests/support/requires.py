"""Optional packages in tests: a test that needs one is skipped where this machine lacks it,
except on a lent GPU's run (`bench/gpu/run.sh` sets REKV_DEVICE_RUN=1), where every package was
carried and installed on purpose: there a missing one fails the test loudly, by name, instead of
turning it into a skip that reads like a pass."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

DEVICE_RUN_ENV = "REKV_DEVICE_RUN"


def require(name: str) -> ModuleType:
    """`name` imported; a skip if it is missing, a failure if it is missing on a device run."""
    if os.environ.get(DEVICE_RUN_ENV) != "1":
        return pytest.importorskip(name)
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is missing on a device run ({DEVICE_RUN_ENV}=1): its carried wheel "
                    f"did not install (see install.log beside the results): {exc}",
                    pytrace=False)
