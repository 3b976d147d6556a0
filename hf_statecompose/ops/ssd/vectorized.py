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

from .reference import _check_shapes, discretize_dt


def _segment_sums(log_a):
    """log_a [..., L] -> [..., L, L]: out[..., l, s] = Σ_{s<k<=l} log_a[..., k] for s <= l, -inf above.

    Each entry is summed directly (a cumsum over k of the masked terms), never as a difference of prefix sums."""
    length = log_a.shape[-1]
    ones = torch.ones(length, length, dtype=torch.bool, device=log_a.device)
    terms = log_a[..., :, None].expand(*log_a.shape, length)  # [..., k, s]
    terms = terms.masked_fill(~ones.tril(-1), 0.0)  # keep k > s
    sums = torch.cumsum(terms, dim=-2)  # [..., l, s] = Σ_{s<k<=l}
    return sums.masked_fill(~ones.tril(), float("-inf"))


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
    """Chunked SSD scan; same signature and results as :func:`ssd_scan_ref`.

    Every contraction is a batched matmul over the heads of one group, which share B and C: the
    ``C Bᵀ`` scores are formed once per group (not per head), and the chunk states and their read-out
    are ``[L, heads·P]ᵀ @ [L, N]`` and ``[L, N] @ [N, heads·P]`` products. Differentiable (plain torch).
    """
    _check_shapes(x, dt, A, B, C, initial_state, mask)
    compute_dtype = torch.promote_types(torch.promote_types(x.dtype, A.dtype), torch.float32)
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2], B.shape[3]
    per_group = heads // groups
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
    x_dt = xc * dt[..., None]
    log_a = dt * A.to(compute_dtype)  # [B, T, H], every entry <= 0
    Bc, Cc = B.to(compute_dtype), C.to(compute_dtype)
    if pad:  # padded positions: log_a = 0 (decay 1) and no input, so they change nothing
        x_dt = F.pad(x_dt, (0, 0, 0, 0, 0, pad))
        log_a = F.pad(log_a, (0, 0, 0, pad))
        Bc = F.pad(Bc, (0, 0, 0, 0, 0, pad))
        Cc = F.pad(Cc, (0, 0, 0, 0, 0, pad))
    # b batch, c chunk, g group, j head in group, l/s position in chunk, p head channel, n state
    L, G, J, P, N = chunk_size, groups, per_group, head_dim, state_size
    Bg = Bc.view(batch, n_chunks, L, G, N).transpose(2, 3)  # [b, c, g, s, n]
    Cg = Cc.view(batch, n_chunks, L, G, N).transpose(2, 3)  # [b, c, g, l, n]
    log_a = log_a.view(batch, n_chunks, L, G, J).permute(0, 1, 3, 4, 2)  # [b, c, g, j, l]
    log_a_cum = torch.cumsum(log_a, dim=-1)
    x_dt = x_dt.view(batch, n_chunks, L, G, J, P).permute(0, 1, 3, 4, 2, 5)  # [b, c, g, j, s, p]

    # 1. within each chunk: y[l] = Σ_{s<=l} (C_l · B_s) exp(cum_l - cum_s) (xΔ)_s, per head
    scores = torch.matmul(Cg, Bg.transpose(-1, -2))  # [b, c, g, l, s], once per group
    # exponents as sums of the log decays between s and l, summed directly: the difference of two prefix
    # sums (cum_l - cum_s) would lose ulp(|cum|) of absolute accuracy in every exponent
    decay_within = torch.exp(_segment_sums(log_a))  # [b, c, g, j, l, s]
    y = torch.matmul(scores[:, :, :, None] * decay_within, x_dt)  # [b, c, g, j, l, p]

    # 2. state contributed by each chunk alone, as seen at its end: Σ_s exp(cum_end - cum_s) (xΔ)_s ⊗ B_s
    # Σ_{k>s} log a_k, a suffix sum taken directly (not cum_end - cum_s, for the same reason)
    suffix = torch.flip(torch.cumsum(torch.flip(log_a, [-1]), -1), [-1])
    decay_to_end = torch.exp(F.pad(suffix[..., 1:], (0, 1)))  # [b, c, g, j, s]
    weighted_x = (x_dt * decay_to_end[..., None]).permute(0, 1, 2, 3, 5, 4).reshape(batch, n_chunks, G, J * P, L)
    chunk_states = torch.matmul(weighted_x, Bg).view(batch, n_chunks, heads, P, N)

    # 3. chain chunk states from the initial state (decay of a whole chunk: exp(sum of its log_a))
    chunk_decay = torch.exp(log_a_cum[..., -1]).reshape(batch, n_chunks, heads)  # [b, c, h]
    states_in = []
    state = h0
    for c in range(n_chunks):
        states_in.append(state)
        state = torch.addcmul(chunk_states[:, c], chunk_decay[:, c, :, None, None], state)
    entering = torch.stack(states_in, dim=1)  # [b, c, h, p, n]

    # 4. each position reads the state that entered its chunk, decayed up to that position
    carried = torch.matmul(Cg, entering.view(batch, n_chunks, G, J * P, N).transpose(-1, -2))  # [b, c, g, l, j·p]
    carried = carried.view(batch, n_chunks, G, L, J, P).transpose(3, 4)  # [b, c, g, j, l, p]
    y = y + carried * torch.exp(log_a_cum)[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(batch, n_chunks * L, heads, head_dim)[:, :length]
    if D is not None:
        y = y + xc * D.to(compute_dtype)[:, None]
    return y, state, delta_sum
