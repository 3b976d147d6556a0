"""Mamba-1 selective scan fused by ``torch.compile`` (inductor) for CPU inference.

The eager chunked scan in ``selective_scan.py`` is memory-bound: every step of it streams a
``[T, D, N]`` tensor (decays, inputs, states) through memory, several times. Here the recurrence over a
block of ``BLOCK`` tokens is written as plain tensor code, unrolled, and handed to inductor, which fuses
it into one loop nest that keeps the ``[D, N]`` state in registers / cache and never materialises a
``[T, D, N]`` tensor:

    for t in block:  h = exp(Δ_t A) ⊙ h + (Δ_t u_t) B_t,   y_t = Σ_n C_t[n] h[:, n]

Blocks are chained in Python (T / BLOCK calls); a last partial block is padded with Δ = 0 (decay 1,
no input), which leaves the state exactly unchanged. Everything around the recurrence works tokens-first
([B, T, X], the layout of the mixers' projections), so transposed [B, D, T] arguments cost no copies.

Same signature and results as :func:`hf_statecompose.ops.selective_scan_ref`; used only without
autograd, on float32, for inputs of at least ``MIN_TOKENS`` tokens (the eager scan is used otherwise). The first call per process compiles
(seconds; inductor caches the result on disk); if compiling fails, a warning is logged once and the
eager scan is used from then on.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from ... import compat
from .reference import _check_shapes

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
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (u, A, initial_state))
    return (
        compile_enabled()
        and not needs_grad
        and not compat.is_tracing(u)  # inside torch.compile / torch.export the caller's graph holds the scan
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
    h = (
        initial_state.to(torch.float32).contiguous()
        if initial_state is not None
        else u.new_zeros((batch, channels, A.shape[1]), dtype=torch.float32)
    )

    # Work tokens-first ([B, T, X]), the layout the mixers' projections produce: a [B, D, T] argument that
    # is a transposed view (delta, z, B, C in the Mamba-1 mixer) costs nothing here, and every elementwise
    # pass below runs over contiguous rows.
    def tokens_first(t):
        return t.transpose(1, 2).to(torch.float32).contiguous()

    u_t = tokens_first(u)
    dt = tokens_first(delta)  # may be the caller's own tensor: no in-place ops on it below
    if delta_bias is not None:
        dt = dt + delta_bias.to(torch.float32)
    if delta_softplus:
        dt = F.softplus(dt)
    if mask is not None:
        dt = dt * mask.to(torch.float32)[:, :, None]
    B_t, C_t = tokens_first(B), tokens_first(C)
    A = A.contiguous()
    recurrence = _compiled()
    ys = []
    full = length - length % BLOCK
    try:
        for start in range(0, full, BLOCK):
            stop = start + BLOCK
            y, h = recurrence(dt[:, start:stop], u_t[:, start:stop], B_t[:, start:stop], C_t[:, start:stop], A, h)
            ys.append(y)
        if full < length:  # the last partial block, padded with Δ = 0 (decay 1, no input): state unchanged
            pad = BLOCK - (length - full)

            def tail(t):
                return F.pad(t[:, full:], (0, 0, 0, pad))

            y, h = recurrence(tail(dt), tail(u_t), tail(B_t), tail(C_t), A, h)
            ys.append(y[:, : length - full])
    except Exception as error:  # no C++ compiler, unsupported platform, ...: eager from now on
        _state["failed"] = repr(error)
        logger.warning("hf_statecompose: torch.compile of the selective scan failed (%s); using the eager scan", error)
        raise _CompileFailed from error
    y = torch.cat(ys, 1)  # [B, T, D]
    if D is not None:
        y += u_t * D.to(torch.float32)
    if z is not None:
        y *= F.silu(z.transpose(1, 2).to(torch.float32))
    # a [B, D, T] view of the tokens-first result: the mixer's transpose back for out_proj is free
    return y.transpose(1, 2), h, dt.sum(1)


class _CompileFailed(RuntimeError):
    """Raised once when compiling fails; the caller falls back to the eager scan."""
