"""Stores of context states: :class:`StateStore` (``backend="folder"``, the default, or ``"lance"``).

``LanceStateStore`` is importable from here but loaded only on first use (it needs the ``[scale]``
extra: ``lancedb``, ``pylance``); ``migrate`` (folder -> Lance) likewise.
"""

from .base import StateStore
from .folder import FolderStateStore
from .format import STORAGE_DTYPES, StoreEntry

__all__ = ["STORAGE_DTYPES", "FolderStateStore", "LanceStateStore", "StateStore", "StoreEntry", "migrate"]


def __getattr__(name):
    if name == "LanceStateStore":
        from .lance import LanceStateStore

        return LanceStateStore
    if name == "migrate":
        from .migrate import migrate

        return migrate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
