"""The package side of the Triton selective scan: argument checks, Δ discretisation and the D / z terms in
torch (under autograd) around the kernel's recurrence (``selective_scan`` of the kernel module chosen by
:func:`hf_statecompose.ops._triton.kernel_module`: the bundled ``hf_statecompose._kernels`` or a Hub / local
kernel). Contract of :func:`hf_statecompose.ops.selective_scan_ref`.
"""

from __future__ import annotations

import torch

from .._triton import check_runnable, kernel_module
from .reference import _check_shapes, _discretize_delta, _finish

__all__ = ["selective_scan_triton"]


def _selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus=False,
    initial_state=None,
    mask=None,
    *,
    chunk_size: int | None = None,
    block_d: int | None = None,
):
    """:func:`selective_scan_triton` with the checkpoint spacing and the channel block exposed (tests)."""
    check_runnable(u, delta, A, B, C, D, z, delta_bias, initial_state, mask)
    _check_shapes(u, delta, A, B, C, initial_state, mask)
    devices = {t.device for t in (u, delta, A, B, C, D, z, delta_bias, initial_state, mask) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    compute_dtype = torch.promote_types(torch.promote_types(u.dtype, A.dtype), torch.float32)
    if compute_dtype != torch.float32:
        raise TypeError(
            f"the Triton selective scan computes in float32; got u {u.dtype}, A {A.dtype} "
            "(use hf_statecompose.ops.selective_scan for float64)"
        )
    for name, t in (("B", B), ("C", C), ("initial_state", initial_state)):
        if t is not None and not t.is_floating_point():
            raise TypeError(f"{name} must be a floating point tensor, got {t.dtype}")
    if z is not None and tuple(z.shape) != tuple(u.shape):
        raise ValueError(f"z must be [B, D, T] = {tuple(u.shape)}, got {tuple(z.shape)}")
    if D is not None and tuple(D.shape) != (u.shape[1],):
        raise ValueError(f"D must be [D] = {(u.shape[1],)}, got {tuple(D.shape)}")
    if delta_bias is not None and tuple(delta_bias.shape) != (u.shape[1],):
        raise ValueError(f"delta_bias must be [D] = {(u.shape[1],)}, got {tuple(delta_bias.shape)}")

    dt = _discretize_delta(delta, delta_bias, delta_softplus, mask, torch.float32)
    y, h = kernel_module().selective_scan(u, dt, A, B, C, initial_state, chunk_size=chunk_size, block_d=block_d)
    return _finish(y, u, D, z, torch.float32), h, dt.sum(-1)


def selective_scan_triton(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None, mask=None
):
    """Triton selective scan; same signature, results and gradients as ``selective_scan_ref``.

    Returns ``(y [B, D, T], final_state [B, D, N], delta_sum [B, D])``, all float32. Inputs may be float32,
    bfloat16 or float16 (computed in float32); float64 raises ``TypeError``. Differentiable in every input
    (u, delta, A, B, C, D, z, delta_bias, initial_state).
    """
    return _selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, mask)
