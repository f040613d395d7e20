"""Put on a process's PYTHONPATH, this makes `opentelemetry` unimportable in it: a machine without
the packages (the lent GPU machine), for `tests/system/test_tracing.py`."""

import sys


class _Absent:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
        return None


sys.meta_path.insert(0, _Absent())
