from .store import STORAGE_DTYPES, StateStore, StoreEntry

__all__ = ["STORAGE_DTYPES", "StateStore", "StoreEntry"]
