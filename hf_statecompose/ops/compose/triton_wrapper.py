"""The package side of the fused Triton composition: argument checks, the method's kernel id and the
Gauss–Legendre table of ``picaso_s`` around the kernel's one-pass composition (``compose`` of the kernel module
chosen by :func:`hf_statecompose.ops._triton.kernel_module`). Contract of ``compose_ssm_ref``.
"""

from __future__ import annotations

import functools
import math

import torch

from .._triton import check_runnable, kernel_module
from .methods import KERNEL_METHODS, METHODS
from .reference import _check_inputs
from .weights import _gauss_legendre_01

__all__ = ["compose_ssm_triton"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _gauss_legendre_table(n: int, device: str) -> torch.Tensor:
    """[2, Q] float32: the ⌈n/2⌉ nodes then weights of ``_gauss_legendre_01``, zero padded to a power of two Q."""
    t, w = _gauss_legendre_01(math.ceil(n / 2))
    table = torch.zeros(2, 1 << (t.numel() - 1).bit_length(), dtype=torch.float64)
    table[0, : t.numel()] = t
    table[1, : w.numel()] = w
    return table.to(device=device, dtype=torch.float32)


def compose_ssm_triton(ssm_states, delta_sums, A, method, weights=None) -> torch.Tensor:
    """Σ_k W_k ⊙ x_k in one Triton pass (contract of ``compose_ssm_ref``); no autograd (use the torch composer
    to train)."""
    states, n, _ = _check_inputs(ssm_states, delta_sums, A, method, weights)
    check_runnable(*states, delta_sums, A)
    tensors = [*states, delta_sums, A] + ([weights] if weights is not None else [])
    if any(t.requires_grad for t in tensors):
        raise RuntimeError(
            "compose_ssm_triton has no backward; an input requires grad: compose with the torch composer "
            "(backend='torch') to train through the composition, or detach the inputs"
        )
    if states[0].dtype not in _KERNEL_DTYPES:
        raise TypeError(
            f"compose_ssm_triton takes float32, bfloat16 or float16 states, got {states[0].dtype}; "
            "use compose_ssm_torch for float64"
        )
    kernel_id = METHODS[method].kernel_id
    if kernel_id is None:
        raise ValueError(f"method {method!r} has no Triton kernel (no kernel_id); compose it with compose_ssm_torch")
    picaso_s = KERNEL_METHODS[kernel_id] == "picaso_s"  # an alias of picaso_s (register) needs the nodes too
    quadrature = _gauss_legendre_table(n, str(states[0].device)) if picaso_s else None
    return kernel_module().compose(states, delta_sums, A, kernel_id, weights, quadrature)
