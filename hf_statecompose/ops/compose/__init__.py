"""Fused composition x = Σ_k W_k ⊙ x_k of SSM states: the method registry, weights, reference, torch, Triton.

The registry (:mod:`.methods`) imports no torch and is imported here at once; the torch parts on first use
(PEP 562)."""

import importlib

from .methods import METHODS, CompositionMethod, methods_table, register, unregister

# public name -> the module (in this folder) that defines it
_EXPORTS = {
    "MODEL_FREE_METHODS": "weights",
    "WEIGHT_FUNCTIONS": "weights",
    "caso_weights": "weights",
    "picaso_r_weights": "weights",
    "picaso_s_weights": "weights",
    "soup_weights": "weights",
    "compose_ssm_ref": "reference",
    "compose_ssm_torch": "vectorized",
}

__all__ = [
    "METHODS",
    "MODEL_FREE_METHODS",
    "WEIGHT_FUNCTIONS",
    "CompositionMethod",
    "caso_weights",
    "compose_ssm_ref",
    "compose_ssm_torch",
    "methods_table",
    "picaso_r_weights",
    "picaso_s_weights",
    "register",
    "soup_weights",
    "unregister",
]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
