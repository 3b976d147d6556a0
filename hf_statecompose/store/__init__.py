"""Stores of context states: :class:`StateStore` (``backend="folder"``, the default, ``"lance"``, or any backend
given to :func:`register_backend`).

Importing this package registers the built-in backends: ``folder`` (its module registers itself) and ``lance``
(registered here by its module path, imported on first use: it needs the ``[scale]`` extra, ``lancedb`` and
``pylance``). ``LanceStateStore`` is importable from here but loaded only on first use; ``migrate`` (folder ->
Lance) likewise.
"""

from .base import BACKEND_METHODS, StateStore, register_backend, registered_backends, unregister_backend
from .folder import FolderStateStore
from .format import STORAGE_DTYPES, StoreEntry

register_backend("lance", "hf_statecompose.store.lance:LanceStateStore")

__all__ = [
    "BACKEND_METHODS",
    "STORAGE_DTYPES",
    "FolderStateStore",
    "LanceStateStore",
    "StateStore",
    "StoreEntry",
    "migrate",
    "register_backend",
    "registered_backends",
    "unregister_backend",
]


def __getattr__(name):
    if name == "LanceStateStore":
        from .lance import LanceStateStore

        return LanceStateStore
    if name == "migrate":
        from .migrate import migrate

        return migrate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
