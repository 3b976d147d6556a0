"""Fused composition x = Σ_k W_k ⊙ x_k of SSM states: the method registry, weights, reference, torch, Triton."""

from .methods import METHODS, CompositionMethod, methods_table, register, unregister
from .reference import compose_ssm_ref
from .vectorized import compose_ssm_torch
from .weights import (
    MODEL_FREE_METHODS,
    WEIGHT_FUNCTIONS,
    caso_weights,
    picaso_r_weights,
    picaso_s_weights,
    soup_weights,
)

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
