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


def compose_ssm_layers_triton(layer_states, delta_sums, A, method, weights=None) -> list[torch.Tensor]:
    """All L layers in one Triton launch (contract of ``compose_ssm_layers_ref``) when every layer's states have
    one shape / dtype / device, else (or with a Hub kernel that has no ``compose_layers``) one launch per layer.
    On a GPU the per-layer launches from Python cost more than the composition itself (``benchmarks/gpu.py``)."""
    if len(layer_states) == 0 or len(delta_sums) != len(layer_states) or len(A) != len(layer_states):
        raise ValueError(
            f"compose L >= 1 layers with one delta_sums and one A each, got {len(layer_states)} layers of states, "
            f"{len(delta_sums)} delta_sums and {len(A)} A"
        )
    # the first layer gets every check; the others must match it (then the same checks hold for them)
    states0, n, _ = _check_inputs(layer_states[0], delta_sums[0], A[0], method, weights)
    first = states0[0]
    key = (first.shape, first.dtype, first.device)
    uniform = all(
        len(states) == n
        and all((s.shape, s.dtype, s.device) == key for s in states)
        and d.shape == delta_sums[0].shape
        and a.shape == A[0].shape
        and d.device == delta_sums[0].device
        and a.device == A[0].device
        for states, d, a in zip(layer_states, delta_sums, A, strict=True)
    )
    module = kernel_module()
    if not uniform or not hasattr(module, "compose_layers") or len(layer_states) == 1:
        return [
            compose_ssm_triton(s, d, a, method, weights) for s, d, a in zip(layer_states, delta_sums, A, strict=True)
        ]
    check_runnable(first, delta_sums[0], A[0])
    if any(t.requires_grad for t in (*(s for states in layer_states for s in states), *delta_sums, *A)):
        raise RuntimeError(
            "compose_ssm_triton has no backward; an input requires grad: compose with the torch composer "
            "(backend='torch') to train through the composition, or detach the inputs"
        )
    if first.dtype not in _KERNEL_DTYPES:
        raise TypeError(
            f"compose_ssm_triton takes float32, bfloat16 or float16 states, got {first.dtype}; "
            "use compose_ssm_torch for float64"
        )
    kernel_id = METHODS[method].kernel_id
    if kernel_id is None:
        raise ValueError(f"method {method!r} has no Triton kernel (no kernel_id); compose it with compose_ssm_torch")
    picaso_s = KERNEL_METHODS[kernel_id] == "picaso_s"  # an alias of picaso_s (register) needs the nodes too
    quadrature = _gauss_legendre_table(n, str(first.device)) if picaso_s else None
    return module.compose_layers(
        layer_states,
        torch.stack(list(delta_sums)),
        torch.stack(list(A)),
        kernel_id,
        weights,
        quadrature,
    )
