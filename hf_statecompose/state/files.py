"""Crash-safe file writes shared by state files, the store and the benchmarks' JSON."""

from __future__ import annotations

import os
import tempfile


def atomic_write(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never half:
    a temporary file in the same folder, fsynced, renamed over ``path``, then the folder fsynced."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def fsync_dir(directory) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
