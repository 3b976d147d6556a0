"""Mamba-2 (SSD) scan that starts from an initial state and returns the final state and ΣΔ.

Layout follows transformers' ``Mamba2Mixer`` and mamba-ssm's ``mamba_chunk_scan_combined``:

    x           : [B, T, H, P]   (H heads of P channels)
    dt          : [B, T, H]      (raw; bias, softplus and the time_step_limit clamp applied here)
    A           : [H]            (negative scalar per head)
    B, C        : [B, T, G, N]   (G groups, H % G == 0)
    D           : [H]
    initial_state, final_state : [B, H, P, N]
    delta_sum   : [B, H]
    mask        : [B, T]         (padding gets Δ = 0: decay 1, no input)

Recurrence (Mamba-2 paper, SSD with scalar decay per head):
    h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t,     y_t = h_t C_t + D x_t

``ssd_scan_ref`` is the per-token recurrence; ``ssd_scan`` is the chunked form of the paper's
``ssd_minimal_discrete`` listing (intra-chunk quadratic form, inter-chunk recurrence) extended with
the initial state, the padding mask and ΣΔ.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def discretize_dt(dt, dt_bias, dt_softplus, dt_limit, mask, compute_dtype):
    """Δ exactly as the Mamba-2 mixer computes it: softplus(dt + bias), clamped to ``time_step_limit``."""
    dt = dt.to(compute_dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(compute_dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit is not None:
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    if mask is not None:
        dt = dt * mask[:, :, None].to(compute_dtype)
    return dt


def _check_shapes(x, dt, A, B, C, initial_state, mask):
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, P], got {tuple(x.shape)}")
    batch, length, heads, head_dim = x.shape
    if tuple(dt.shape) != (batch, length, heads):
        raise ValueError(f"dt must be [B, T, H] = {(batch, length, heads)}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (heads,):
        raise ValueError(f"A must be [H] = ({heads},), got {tuple(A.shape)}")
    if B.dim() != 4 or B.shape[:2] != (batch, length) or B.shape != C.shape or heads % B.shape[2]:
        raise ValueError(f"B and C must be [B, T, G, N] with H % G == 0, got {tuple(B.shape)}, {tuple(C.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (batch, heads, head_dim, B.shape[-1]):
        raise ValueError(
            f"initial_state must be [B, H, P, N] = {(batch, heads, head_dim, B.shape[-1])}, got {tuple(initial_state.shape)}"
        )
    if mask is not None and tuple(mask.shape) != (batch, length):
        raise ValueError(f"mask must be [B, T] = {(batch, length)}, got {tuple(mask.shape)}")


def ssd_scan_ref(
    x, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, dt_limit=None, initial_state=None, mask=None
):
    """Plain per-token recurrence. Returns ``(y [B, T, H, P], final_state [B, H, P, N], delta_sum [B, H])``."""
    _check_shapes(x, dt, A, B, C, initial_state, mask)
    compute_dtype = torch.promote_types(torch.promote_types(x.dtype, A.dtype), torch.float32)
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, mask, compute_dtype)
    A = A.to(compute_dtype)
    xc = x.to(compute_dtype)
    Bh = B.to(compute_dtype).repeat_interleave(heads // groups, dim=2)  # [B, T, H, N]
    Ch = C.to(compute_dtype).repeat_interleave(heads // groups, dim=2)
    h = (
        initial_state.to(compute_dtype)
        if initial_state is not None
        else xc.new_zeros((batch, heads, head_dim, state_size))
    )
    ys = []
    for t in range(length):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]  # [B, H, 1, 1]
        h = decay * h + (dt[:, t, :, None] * xc[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((h * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1) if ys else xc.new_zeros((batch, 0, heads, head_dim))
    if D is not None:
        y = y + xc * D.to(compute_dtype)[:, None]
    return y, h, dt.sum(1)


def _segment_sum(x):
    """x [..., L] -> [..., L, L] with out[..., i, j] = sum(x[..., j+1 : i+1]) for j <= i, -inf above."""
    length = x.shape[-1]
    cumsum = torch.cumsum(x, dim=-1)
    seg = cumsum[..., :, None] - cumsum[..., None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    return seg.masked_fill(~causal, float("-inf"))


def ssd_scan(
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
    """Chunked SSD scan; same signature and results as :func:`ssd_scan_ref`."""
    _check_shapes(x, dt, A, B, C, initial_state, mask)
    compute_dtype = torch.promote_types(torch.promote_types(x.dtype, A.dtype), torch.float32)
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    dt = discretize_dt(dt, dt_bias, dt_softplus, dt_limit, mask, compute_dtype)
    delta_sum = dt.sum(1)
    xc = x.to(compute_dtype)
    h0 = (
        initial_state.to(compute_dtype)
        if initial_state is not None
        else xc.new_zeros((batch, heads, head_dim, state_size))
    )
    if length == 0:
        return xc.clone(), h0, delta_sum
    chunk_size = min(chunk_size, length)
    n_chunks = -(-length // chunk_size)
    pad = n_chunks * chunk_size - length
    Bh = B.to(compute_dtype).repeat_interleave(heads // groups, dim=2)
    Ch = C.to(compute_dtype).repeat_interleave(heads // groups, dim=2)
    x_dt = xc * dt[..., None]
    log_a = dt * A.to(compute_dtype)  # [B, T, H], every entry <= 0
    if pad:
        x_dt = F.pad(x_dt, (0, 0, 0, 0, 0, pad))
        log_a = F.pad(log_a, (0, 0, 0, pad))
        Bh = F.pad(Bh, (0, 0, 0, 0, 0, pad))
        Ch = F.pad(Ch, (0, 0, 0, 0, 0, pad))
    # b = batch, c = chunk, l/s = position in chunk, h = head, p = head channel, n = state
    x_dt = x_dt.view(batch, n_chunks, chunk_size, heads, head_dim)
    Bh = Bh.view(batch, n_chunks, chunk_size, heads, state_size)
    Ch = Ch.view(batch, n_chunks, chunk_size, heads, state_size)
    log_a = log_a.view(batch, n_chunks, chunk_size, heads).permute(0, 3, 1, 2)  # [b, h, c, l]
    log_a_cum = torch.cumsum(log_a, dim=-1)

    # 1. within each chunk: a masked, decayed "attention" of C against B
    decay_within = torch.exp(_segment_sum(log_a))  # [b, h, c, l, s]
    y = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Ch, Bh, decay_within, x_dt)

    # 2. state contributed by each chunk alone, as seen at the chunk's end
    decay_to_end = torch.exp(log_a_cum[..., -1:] - log_a_cum)  # [b, h, c, l]
    chunk_states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bh, decay_to_end, x_dt)

    # 3. chain chunk states from the initial state (decay of a whole chunk: exp(sum of its log_a))
    chunk_decay = torch.exp(log_a_cum[..., -1])  # [b, h, c]
    entering = []
    state = h0
    for c in range(n_chunks):
        entering.append(state)
        state = chunk_decay[:, :, c, None, None] * state + chunk_states[:, c]
    entering = torch.stack(entering, dim=1)  # [b, c, h, p, n]

    # 4. each position reads the state that entered its chunk, decayed up to that position
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", Ch, entering, torch.exp(log_a_cum))
    y = y.reshape(batch, n_chunks * chunk_size, heads, head_dim)[:, :length]
    if D is not None:
        y = y + xc * D.to(compute_dtype)[:, None]
    return y, state, delta_sum
