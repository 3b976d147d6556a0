"""The package side of the Triton SSD scan: argument checks, Δ discretisation, ΣΔ and the D term in torch (under
autograd) around the kernel's chunked scan (``ssd_scan`` of the kernel module chosen by
:func:`hf_statecompose.ops._triton.kernel_module`). Contract of :func:`hf_statecompose.ops.ssd_scan_ref`.
"""

from __future__ import annotations

import torch

from .._triton import check_runnable, kernel_module
from .reference import _check_shapes, discretize_dt

__all__ = ["ssd_scan_triton"]


def ssd_scan_triton(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=None,
    initial_state=None,
    mask=None,
    chunk_size: int = 64,
):
    """Chunked SSD scan in Triton; same signature and results as :func:`hf_statecompose.ops.ssd.ssd_scan`.

    Returns ``(y [B, T, H, P], final_state [B, H, P, N], delta_sum [B, H])``, all float32; differentiable
    in x, dt, A, B, C, D, dt_bias and initial_state.
    """
    check_runnable(x, dt, A, B, C, D, dt_bias, initial_state, mask)
    _check_shapes(x, dt, A, B, C, initial_state, mask)
    for name, t in (
        ("x", x),
        ("dt", dt),
        ("A", A),
        ("B", B),
        ("C", C),
        ("D", D),
        ("dt_bias", dt_bias),
        ("initial_state", initial_state),
    ):
        if t is not None and t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(
                f"ssd_scan_triton computes in float32 and takes float32/float16/bfloat16 inputs, got {name} of "
                f"dtype {t.dtype}; use hf_statecompose.ops.ssd_scan for float64"
            )
    if D is not None and tuple(D.shape) != (x.shape[2],):
        raise ValueError(f"D must be [H] = ({x.shape[2]},), got {tuple(D.shape)}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    f32 = torch.float32
    delta = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, mask, f32)  # [B, T, H]
    y, final = kernel_module().ssd_scan(x, delta, A, B, C, initial_state, chunk_size=int(chunk_size))
    if D is not None:
        y = y + x.to(f32) * D.to(f32)[:, None]
    return y, final, delta.sum(1)
