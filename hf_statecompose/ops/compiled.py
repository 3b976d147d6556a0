"""Mamba-1 selective scan fused by ``torch.compile`` (inductor) for CPU inference.

The eager chunked scan in ``selective_scan.py`` is memory-bound: every step of it streams a
``[T, D, N]`` tensor (decays, inputs, states) through memory, several times. Here the recurrence over a
block of ``BLOCK`` tokens is written as plain tensor code, unrolled, and handed to inductor, which fuses
it into one loop nest that keeps the ``[D, N]`` state in registers / cache and never materialises a
``[T, D, N]`` tensor:

    for t in block:  h = exp(Δ_t A) ⊙ h + (Δ_t u_t) B_t,   y_t = Σ_n C_t[n] h[:, n]

Blocks are chained in Python (T / BLOCK calls). The sequence is padded to a multiple of BLOCK with
Δ = 0 (decay 1, no input), which leaves the state exactly unchanged. Same signature and results as
:func:`hf_statecompose.ops.selective_scan_ref`; used only without autograd, on float32, for inputs of at
least ``MIN_TOKENS`` tokens (the eager scan is used otherwise). The first call per process compiles
(seconds; inductor caches the result on disk); if compiling fails, a warning is logged once and the
eager scan is used from then on.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from .selective_scan import _check_shapes, _discretize_delta, _finish

logger = logging.getLogger("hf_statecompose")

BLOCK = 16
MIN_TOKENS = 64
_state = {"fn": None, "failed": None}


def _recurrence(dt, x, B, C, A, h):
    """dt, x [B, L, D]; B, C [B, L, N]; A [D, N]; h [B, D, N] -> (y [B, L, D], h [B, D, N]). Unrolled over L."""
    ys = []
    for t in range(dt.shape[1]):
        d_t = dt[:, t]
        h = torch.exp(d_t[..., None] * A) * h + (d_t * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    return torch.stack(ys, 1), h


def compile_enabled() -> bool:
    """``HF_STATECOMPOSE_COMPILE=0`` turns the compiled path off (the eager chunked scan is used)."""
    return os.environ.get("HF_STATECOMPOSE_COMPILE", "1") not in ("0", "false", "False") and _state["failed"] is None


def applicable(u, A, initial_state, length: int) -> bool:
    """Whether :func:`selective_scan_compiled` will be used for these inputs (no autograd, float32, long enough)."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (u, A, initial_state)
    )
    return (
        compile_enabled()
        and not needs_grad
        and length >= MIN_TOKENS
        and u.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and A.dtype == torch.float32
    )


def _compiled():
    if _state["fn"] is None:
        _state["fn"] = torch.compile(_recurrence, dynamic=True, fullgraph=True)
    return _state["fn"]


def selective_scan_compiled(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None, mask=None
):
    """Same contract as :func:`hf_statecompose.ops.selective_scan_ref` (float32 compute, no autograd)."""
    _check_shapes(u, delta, A, B, C, initial_state, mask)
    batch, channels, length = u.shape
    dt = _discretize_delta(delta, delta_bias, delta_softplus, mask, torch.float32)
    h = (
        initial_state.to(torch.float32).contiguous()
        if initial_state is not None
        else u.new_zeros((batch, channels, A.shape[1]), dtype=torch.float32)
    )
    pad = (-length) % BLOCK

    def tokens_first(t):  # [B, X, T] -> [B, T + pad, X], padded positions zero (Δ = 0 there)
        t = t.to(torch.float32)
        return (F.pad(t, (0, pad)) if pad else t).transpose(1, 2).contiguous()

    dt_t, u_t, B_t, C_t = tokens_first(dt), tokens_first(u), tokens_first(B), tokens_first(C)
    A = A.contiguous()
    fn = _compiled()
    ys = []
    try:
        for start in range(0, length + pad, BLOCK):
            stop = start + BLOCK
            y, h = fn(dt_t[:, start:stop], u_t[:, start:stop], B_t[:, start:stop], C_t[:, start:stop], A, h)
            ys.append(y)
    except Exception as error:  # no C++ compiler, unsupported platform, ...: eager from now on
        _state["failed"] = repr(error)
        logger.warning("hf_statecompose: torch.compile of the selective scan failed (%s); using the eager scan", error)
        raise _CompileFailed from error
    y = torch.cat(ys, 1)[:, :length].transpose(1, 2)  # [B, D, T]
    return _finish(y, u, D, z, torch.float32), h, dt.sum(-1)


class _CompileFailed(RuntimeError):
    """Raised once when compiling fails; the caller falls back to the eager scan."""
