"""The on-disk caches (binaries, plans, calibrations): one directory, one
atomic write, and entry names a person can read.

An entry's name says what it is (``recurrence-lstm-h256-float32-cluster8-...``)
and ends in a digest of everything that determines it, as flashinfer's kernel
URIs do: ``ls`` shows what is cached, and a change to any input is a new name.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterator

__all__ = ["CACHE_ENV", "atomic_write", "cache_dir", "digest", "entry_name", "key_lock"]

CACHE_ENV = "PERSISTRNN_CACHE_DIR"
NAME_LIMIT = 120  # characters of the readable part; file systems allow 255 in all


def cache_dir() -> Path:
    """The disk cache: ``$PERSISTRNN_CACHE_DIR`` or ``~/.cache/persistrnn``."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "persistrnn"


def digest(payload: Any, length: int = 24) -> str:
    """A hex digest of a JSON-able value (keys sorted)."""
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:length]


def entry_name(*parts: Any, key: str) -> str:
    """``part1-part2-...-key``: the readable parts (sanitised, shortened) and the digest."""
    readable = "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", str(p)) for p in parts if p not in (None, ""))
    return f"{readable[:NAME_LIMIT]}-{key}" if readable else key


def atomic_write(path: Path, data: bytes | str) -> bool:
    """Write ``data`` to ``path`` so that no reader ever sees half of it, even
    with several threads or processes writing: a unique temp file in the same
    directory, then a rename over the target. A cache that cannot be written
    (a read-only or missing directory, a full disk) costs the entry only:
    a warning, once per directory, and False; the caller goes on uncached."""
    blob = data.encode() if isinstance(data, str) else data
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    except OSError as exc:
        _unwritable(path.parent, exc)
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if not isinstance(exc, OSError):
            raise
        _unwritable(path.parent, exc)
        return False
    return True


@contextlib.contextmanager
def key_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes (a ``.lock`` file beside it):
    one process compiles an entry while the others wait and then read it.
    Where the lock file cannot be made (an unwritable cache) the work runs
    unlocked: at worst two processes do it both."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a")
    except OSError as exc:
        _unwritable(path.parent, exc)
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


_WARNED: set[Path] = set()


def _unwritable(folder: Path, exc: OSError) -> None:
    if folder not in _WARNED:
        _WARNED.add(folder)
        logging.getLogger("persistrnn").warning(
            "the cache folder %s cannot be written (%s): results are not kept (set %s to a writable folder)",
            folder, exc, CACHE_ENV)
