"""``read_stats(path)``: a store's :meth:`StateStore.stats <hf_statecompose.store.StateStore.stats>` read from its own
files, read-only, without its model (nor torch): what ``hf-statecompose stats`` prints."""

from __future__ import annotations

import os

from .folder_index import read_folder_stats
from .lance_files import HEADER_TABLE, read_lance_stats


def is_lance_store(path) -> bool:
    """Whether ``path`` names a Lance store: an object-storage URI, or a folder holding its header table."""
    path = os.fspath(path)
    return "://" in path or os.path.isdir(os.path.join(path, f"{HEADER_TABLE}.lance"))


def read_stats(path, storage_options: dict | None = None) -> dict:
    """The stats of the store at ``path`` (a folder store, or a Lance store: a folder or an object-storage URI),
    as its ``stats()`` returns them, read without a model: the headers and manifests are verified, the states
    are not read. A ``ValueError`` if ``path`` holds no store; an ``ImportError`` for a Lance store without the
    ``[scale]`` extra."""
    if is_lance_store(path):
        return read_lance_stats(os.fspath(path), storage_options=storage_options)
    return read_folder_stats(path)
