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
from .reference import _check_inputs, _check_layer_counts
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
    kernel_id, quadrature = _kernel_arguments(states[0], n, [*states, delta_sums, A, weights], method)
    return kernel_module().compose(states, delta_sums, A, kernel_id, weights, quadrature)


def _kernel_arguments(first: torch.Tensor, n: int, tensors, method):
    """What both entry points refuse before a launch (autograd, float64, a method without a kernel), and the
    kernel's method id and PICASO-S quadrature table."""
    if any(t is not None and t.requires_grad for t in tensors):
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
    return kernel_id, (_gauss_legendre_table(n, str(first.device)) if picaso_s else None)


def compose_ssm_layers_triton(layer_states, delta_sums, A, method, weights=None) -> list[torch.Tensor]:
    """All L layers in one Triton launch (contract of ``compose_ssm_layers_ref``) when every layer's states have
    one shape / dtype / device, else (or with a Hub kernel that has no ``compose_layers``) one launch per layer.
    On a GPU the per-layer launches from Python cost more than the composition itself (``benchmarks/gpu.py``)."""
    _check_layer_counts(layer_states, delta_sums, A)
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
    tensors = [*(t for states in layer_states for t in states), *delta_sums, *A, weights]
    kernel_id, quadrature = _kernel_arguments(first, n, tensors, method)
    return module.compose_layers(
        layer_states,
        torch.stack(list(delta_sums)),
        torch.stack(list(A)),
        kernel_id,
        weights,
        quadrature,
    )
