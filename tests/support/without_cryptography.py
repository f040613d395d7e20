"""This process as the GPU machine's image is: `cryptography` cannot be imported (the import
refused, and the seal's cached probe told so)."""

import builtins

from rekv_core.handoff import bulk_mac
from rekv_core.handoff import seal as seal_module


def without_cryptography(monkeypatch) -> None:
    """This process as the device image is: `cryptography` cannot be imported."""
    real_import = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name.partition(".")[0] == "cryptography":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    monkeypatch.setattr(bulk_mac, "has_poly1305", lambda: False)
    monkeypatch.setattr(seal_module, "has_poly1305", lambda: False)
