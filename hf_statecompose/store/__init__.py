"""Stores of context states: :class:`StateStore` (``backend="folder"``, the default, ``"lance"``, or any backend
given to :func:`register_backend`).

The built-in backends are registered by :mod:`~hf_statecompose.store.base` by their module paths, each imported on
first use: ``folder`` (which then registers its class) and ``lance`` (it needs the ``[scale]`` extra, ``lancedb`` and
``pylance``). The names below are imported on first use too (PEP 562), so that the torch-free modules of this
package (:mod:`~hf_statecompose.store.format`, :mod:`~hf_statecompose.store.folder_disk`,
:mod:`~hf_statecompose.store.lance_files`) can be imported without torch: ``hf-statecompose stats`` reads a store's
own files with them (:func:`read_stats`), without a model.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import BACKEND_METHODS, StateStore, register_backend, registered_backends, unregister_backend
    from .folder import FolderStateStore
    from .format import STORAGE_DTYPES, StoreEntry
    from .lance import LanceStateStore
    from .migrate import migrate
    from .summary import read_stats

# public name -> the submodule that defines it
_EXPORTS = {
    "BACKEND_METHODS": "base",
    "StateStore": "base",
    "register_backend": "base",
    "registered_backends": "base",
    "unregister_backend": "base",
    "FolderStateStore": "folder",
    "STORAGE_DTYPES": "format",
    "StoreEntry": "format",
    "LanceStateStore": "lance",
    "migrate": "migrate",
    "read_stats": "summary",
}

__all__ = [
    "BACKEND_METHODS",
    "STORAGE_DTYPES",
    "FolderStateStore",
    "LanceStateStore",
    "StateStore",
    "StoreEntry",
    "migrate",
    "read_stats",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    if name != "migrate":  # ``migrate`` is also the submodule's name: the import above bound that one here
        globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
