"""File helpers: atomic writes and inter-process locks for caches shared by many processes.

Simulated clients run in several Ray worker processes and deployed clients may share a
cache directory, so anything written to a cache is written to a temporary file and renamed
(readers never see half a file), under an advisory lock (one process computes, the others
wait and then read).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


@contextlib.contextmanager
def file_lock(target: Path) -> Iterator[None]:
    """Hold an exclusive lock named after ``target`` (``<target>.lock``)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(target.name + ".lock")
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _atomic_write(path: Path, write) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj: Any, path: Path) -> None:
    _atomic_write(path, lambda fh: torch.save(obj, fh))


def atomic_write_json(obj: Any, path: Path) -> None:
    _atomic_write(path, lambda fh: fh.write(json.dumps(obj, indent=2, sort_keys=False).encode()))
