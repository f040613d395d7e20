"""Conversions of a model file kept on disk, so that a process start skips them.

Reading a GGUF file costs every process seconds on a small CPU: `gguf.GGUFReader` parses all its
metadata (the embedded model's 49,152 vocabulary strings and its merges) and numpy dequantizes the
tensors. What a process takes from the file, the dequantized weights in its working dtype and the
tokenizer, is written to the cache directory (env `REKV_MODEL_CACHE`, default
`~/.cache/rekv/models`) the first time and read from there after.

`cached(source, kind, suffix, convert, write, read)` is the whole contract: the entry of `source`'s
conversion `kind` is `read` when there is one, else `convert()`ed, `write`n and returned. An entry's
name carries a hash of what it was made from and by (the source's resolved path, size and
modification time, the `kind`, `FORMAT` and the converting code's `code_version`), so a changed
file, a new format or an upgraded converter never reads an old entry. An entry is written to a
temporary file and renamed into place: processes that start together never read a partial one
(each may convert once). An entry that cannot be read is converted again and replaced; a directory
that cannot be written (or a disk that fills up) only logs a warning. Delete the directory to drop
the entries.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from rekv_core import env

log = logging.getLogger("rekv.model.conversion_cache")

CACHE_ENV = "REKV_MODEL_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/rekv/models")
FORMAT = 1  # bump when what an entry holds changes

T = TypeVar("T")


def cache_dir() -> Path:
    """Where entries are kept: `REKV_MODEL_CACHE`, else `~/.cache/rekv/models`."""
    return Path(env.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def entry_path(source: str | Path, kind: str, suffix: str, made_by: str = "") -> Path:
    """The entry of `source`'s conversion `kind`, named after what it is made from and by
    (`made_by`: the converting code's version, see `code_version`)."""
    source = Path(source).resolve()
    stat = source.stat()
    made_from = f"{source}|{stat.st_size}|{stat.st_mtime_ns}|{kind}|{FORMAT}|{made_by}"
    digest = hashlib.sha256(made_from.encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{kind}-{digest}{suffix}"


def code_version(modules: tuple[ModuleType, ...], packages: tuple[str, ...]) -> str:
    """A fingerprint of the code a conversion runs: the source of `modules` and the installed
    versions of `packages`, so an upgrade or a fix never reads an entry the old code made."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(inspect.getsource(module).encode())
    for package in packages:
        digest.update(f"|{package} {importlib.metadata.version(package)}".encode())
    return digest.hexdigest()[:16]


def cached(source: str | Path, kind: str, suffix: str, convert: Callable[[], T],
           write: Callable[[T, Path], None], read: Callable[[Path], T], made_by: str = "") -> T:
    path = entry_path(source, kind, suffix, made_by)
    if path.is_file():
        try:
            return read(path)
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is made again
            log.warning("model cache: %s cannot be read (%r); converting %s again", path, exc,
                        source)
    value = convert()
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.close(handle)
        os.chmod(temporary, 0o644)  # readable by other users sharing the directory
        write(value, Path(temporary))
        os.replace(temporary, path)
        temporary = None
        log.info("model cache: wrote %s", path)
    except Exception as exc:  # noqa: BLE001 - a full disk or a bad directory costs only the cache
        log.warning("model cache: cannot keep %s's %s in %s (%r); it is converted at every "
                    "start", Path(source).name, kind, path.parent, exc)
    finally:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
    return value
