"""The state layer: caches, state files, validation, fingerprints, and the architecture table
(:mod:`.architectures`).

The names below are imported on first use (PEP 562): the root package reads the architecture table on
``import hf_statecompose`` (to guard transformers' classes), which must not import torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cache import ComposableMambaCache
    from .fingerprint import model_fingerprint, refresh_fingerprint
    from .serpent_cache import ComposableSeRpEntCache

# public name -> the submodule that defines it
_EXPORTS = {
    "ComposableMambaCache": "cache",
    "model_fingerprint": "fingerprint",
    "refresh_fingerprint": "fingerprint",
    "ComposableSeRpEntCache": "serpent_cache",
}

__all__ = ["ComposableMambaCache", "ComposableSeRpEntCache", "model_fingerprint", "refresh_fingerprint"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
