"""Fused composition x = Σ_k W_k ⊙ x_k of SSM states: weights, reference, torch, Triton."""

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
    "MODEL_FREE_METHODS",
    "WEIGHT_FUNCTIONS",
    "caso_weights",
    "compose_ssm_ref",
    "compose_ssm_torch",
    "picaso_r_weights",
    "picaso_s_weights",
    "soup_weights",
]
