"""The gated delta rule (GDN) and Kimi delta attention (KDA), chunked: the same recurrence, initial state,
transition and padding mask as :func:`~hf_statecompose.ops.delta_rule.reference.delta_rule_reference` (the oracle;
tests/test_delta_rule_chunked.py checks the two agree to ~1e-10 in float64), with a Python loop over chunks only.

Per value head, S_t = (I − β_t k_t k_tᵀ) D_t S_{t-1} + β_t k_t v_tᵀ with D_t = exp(g_t) (GDN, a scalar) or
Diag(exp g_t) (KDA, one per key channel), and o_t = S_tᵀ q_t / sqrt(k_dim). Shapes (transformers' layout)::

    query, key [B, T, Hk, k_dim]   value [B, T, H, v_dim]   beta [B, T, H]   g [B, T, H] (GDN) | [B, T, H, k_dim] (KDA)
    initial_state [B, H, k_dim, v_dim] | None (zeros)   initial_transition [B, H, k_dim, k_dim] | None (identity)
    mask [B, T] | None: 0 marks padding, whose steps leave S and M unchanged (g = 0, β = 0 there: the identity step)
    -> out [B, T, H, v_dim] (query's dtype), state [B, H, k_dim, v_dim], transition [B, H, k_dim, k_dim] | None

Within a chunk of C tokens, with Γ_i = exp(G_i) and G_i = Σ_{t≤i} g_t the log decay since the chunk's start (≤ 0),
the state after token i is ``Γ_i S_0 + Σ_{j≤i} (Γ_i/Γ_j) k_j u_jᵀ`` (Γ a row scaling for KDA), where the
corrections u solve the unit lower-triangular system (I + A) U = diag(β) V − diag(β) (K ⊙ Γ) S_0 with
A_ij = β_i Σ_c k_ic k_jc exp(G_ic − G_jc) (j < i): one ``solve_triangular`` for all chunks at once. Then
``O = (Q ⊙ Γ) S_0 + P U`` with P_ij = Σ_c q_ic k_jc exp(G_ic − G_jc) (j ≤ i), and the chunk's final state is
``Γ_C S_0 + (K ⊙ Γ_C/Γ)ᵀ U``. Every exp has an exponent ≤ 0 (a decay between two tokens of one chunk), so long
sequences and strong decays (g = −20) neither overflow nor lose the state.

For KDA the per-channel P and A would need a [C, C, k_dim] tensor of pairwise decays; instead the chunk is split
into sub-chunks of s tokens: pairs within a sub-chunk use the pairwise decays ([C, s, k_dim]), and a pair (i, j)
with j in an earlier sub-chunk b factors through b's last token r as exp(G_i − G_r) · exp(G_r − G_j), both ≤ 1,
so the block is a matmul of decayed queries / keys ([C / s, C, k_dim]).

The transition M (latest step on the left, started from the identity or ``initial_transition``) follows the same
recurrence as the state with zero values, so when ``output_transition`` is set the scan runs on the block
``[S | M]`` (``[k_dim, v_dim + k_dim]``) with values ``[v | 0]``: one chunked pass gives both, and the output
reads the first v_dim columns only. (Without ``output_transition`` the transition cannot change anything
returned, so ``initial_transition`` alone costs nothing.)

Computed in float32 (float64 for float64 values), as the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .reference import compute_dtype, l2norm


def chunk_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    initial_transition: torch.Tensor | None = None,
    output_transition: bool = False,
    use_qk_l2norm: bool = False,
    mask: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The recurrence by chunks of `chunk_size` tokens; see the module docstring for shapes and maths.
    Returns (out, state, transition if output_transition else None)."""
    batch, length, key_heads, k_dim = key.shape
    heads, v_dim = value.shape[-2:]
    if heads % key_heads:
        raise ValueError(f"{heads} value heads are not a multiple of {key_heads} key heads")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    kda = g.dim() == 4
    dtype = compute_dtype(value.dtype)
    q, k, v, b, decay = (x.to(dtype) for x in (query, key, value, beta, g))
    if use_qk_l2norm:  # per vector, so before repeating the key heads
        q, k = l2norm(q), l2norm(k)
    if heads != key_heads:
        q = q.repeat_interleave(heads // key_heads, dim=2)
        k = k.repeat_interleave(heads // key_heads, dim=2)
    q = q / k_dim**0.5
    if mask is not None:  # a padded step with g = 0 and β = 0 is the identity on S and M
        keep = mask.to(device=b.device, dtype=torch.bool)[:, :, None]
        b = torch.where(keep, b, torch.zeros((), dtype=dtype, device=b.device))
        decay = torch.where(keep[..., None] if kda else keep, decay, torch.zeros((), dtype=dtype, device=b.device))
    if not kda:
        decay = decay[..., None]  # [B, T, H, 1]: the same decay for every key channel

    # [B, H, n, C, ...], the tail padded with identity steps (g = 0, β = 0, k = 0)
    pad = (-length) % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x.transpose(1, 2), (0, 0, 0, pad))
        return x.reshape(batch, heads, chunks, chunk_size, x.shape[-1])

    q, k, v, b, decay = (chunked(x) for x in (q, k, v, b[..., None], decay))
    cum = decay.cumsum(dim=-2)  # G_i: [B, H, n, C, 1 | k_dim], ≤ 0
    last = cum[..., -1:, :]  # G_C

    # P (queries against keys) and the keys' gram, decayed within the chunk
    attn, gram = (_kda_grams if kda else _gdn_grams)(q, k, cum)
    system = (b * gram).tril(-1)  # A_ij = β_i (k_i · k_j decayed), j < i
    # (I + A) [U_v | W] = [diag(β) V | diag(β) (K ⊙ Γ)]: unitriangular takes the diagonal as 1
    rhs = torch.cat((v * b, k * b * cum.exp()), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_values, k_cumdecay = solved[..., :v_dim], solved[..., v_dim:]
    q_decayed = q * cum.exp()  # reads S_0 decayed to each token
    k_decayed = k * (last - cum).exp()  # writes each token's correction decayed to the chunk's end
    chunk_decay = last.exp().transpose(-1, -2)  # [B, H, n, 1 | k_dim, 1]: rows of S

    state = v.new_zeros((batch, heads, k_dim, v_dim)) if initial_state is None else initial_state.to(v.device, dtype)
    if output_transition:
        if initial_transition is None:
            transition = torch.eye(k_dim, dtype=dtype, device=v.device).expand(batch, heads, k_dim, k_dim)
        else:
            transition = initial_transition.to(v.device, dtype)
        state = torch.cat((state, transition), dim=-1)  # [S | M], values [v | 0]
        new_values = F.pad(new_values, (0, k_dim))

    # the scan over chunks: only the state's path is sequential; the outputs are read afterwards, batched
    befores, corrections = [], []
    for i in range(chunks):
        correction = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        befores.append(state[..., :v_dim])
        corrections.append(correction[..., :v_dim])
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ correction
    if chunks:
        before, u = torch.stack(befores, dim=2), torch.stack(corrections, dim=2)
        out = q_decayed @ before + attn @ u
    else:
        out = v.new_zeros((batch, heads, 0, chunk_size, v_dim))
    out = out.reshape(batch, heads, chunks * chunk_size, v_dim)[:, :, :length].transpose(1, 2)
    final_state = state[..., :v_dim].contiguous()
    final_transition = state[..., v_dim:].contiguous() if output_transition else None
    return out.to(query.dtype), final_state, final_transition


def _gdn_grams(q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_c x_ic k_jc exp(G_i − G_j) for j ≤ i (0 above), x = q and x = k: q, k [..., C, d], cum [..., C, 1]."""
    size = cum.shape[-2]
    upper = torch.ones(size, size, dtype=torch.bool, device=cum.device).triu(1)
    decays = (cum - cum.transpose(-1, -2)).masked_fill(upper, -math.inf).exp()
    grams = (torch.cat((q, k), dim=-2) @ k.transpose(-1, -2)).unflatten(-2, (2, size)) * decays[..., None, :, :]
    return grams[..., 0, :, :], grams[..., 1, :, :]


def _kda_grams(q: torch.Tensor, k: torch.Tensor, cum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_c x_ic k_jc exp(G_ic − G_jc) for j ≤ i (0 above), x = q and x = k, per-channel G: q, k, cum [..., C, d].

    By sub-chunks of s tokens, with E_b = G at the last token of sub-chunk b (E_{-1} = 0, the chunk's start):
    within a sub-chunk from the pairwise decays ([C / s, s, s, d]); for i in sub-chunk a and j in an earlier one b,
    exp(G_i − G_j) = exp(G_i − E_{a−1}) · exp(E_{a−1} − E_b) · exp(E_b − G_j), three factors ≤ 1, so the block is
    a matmul of decayed queries / keys (the keys of every b < a decayed to E_{a−1}: [C / s, C, d])."""
    size = cum.shape[-2]
    sub = _sub_chunk(size)
    blocks = size // sub
    qs, ks, gs = (t.unflatten(-2, (blocks, sub)) for t in (q, k, cum))  # [..., blocks, s, d]
    ends = gs[..., -1, :]  # E_b: [..., blocks, d]
    starts = F.pad(ends[..., :-1, :], (0, 0, 1, 0))  # E_{a−1}
    # within a sub-chunk, laid out [..., blocks, s (i), d, s (j)] for the matmul; above the diagonal exp(−inf) = 0
    lower = torch.ones(sub, sub, dtype=torch.bool, device=cum.device).tril()[:, None, :]
    within = torch.where(lower, gs[..., :, :, None] - gs.mT[..., None, :, :], -math.inf).exp()
    diagonal = torch.stack((qs, ks), dim=-2) @ (ks.mT[..., None, :, :] * within)  # [..., blocks, s (i), 2, s (j)]
    # across sub-chunks: row block a against the keys of every sub-chunk b < a (0 for b ≥ a), laid out [d, (b, j)]
    earlier = torch.ones(blocks, blocks, dtype=torch.bool, device=cum.device).tril(-1)[:, None, :]  # [a, 1, b]
    between = torch.where(earlier, starts[..., :, :, None] - ends.mT[..., None, :, :], -math.inf).exp()  # [.., a, d, b]
    k_to_end = (ks * (ends[..., None, :] - gs).exp()).mT.transpose(-3, -2)  # keys decayed to E_b: [..., d, b, s]
    keys = between[..., None] * k_to_end[..., None, :, :, :]  # [..., a, d, b, s]
    rows = torch.stack((qs, ks), dim=-3) * (gs - starts[..., None, :]).exp()[..., None, :, :]  # [.., a, 2, s, d]
    off = rows.flatten(-3, -2) @ keys.flatten(-2, -1)  # [..., blocks (a), 2 s, C]
    eye = torch.eye(blocks, dtype=torch.bool, device=cum.device)[:, None, None, :, None]  # [a, 1, 1, b, 1]
    grams = off.unflatten(-2, (2, sub)).movedim(-3, -2).unflatten(-1, (blocks, sub))  # [..., a, s, 2, b, s]
    grams = grams + torch.where(eye, diagonal.unsqueeze(-2), 0.0)
    grams = grams.movedim(-3, -5).flatten(-4, -3).flatten(-2, -1)  # [..., 2, C, C]
    return grams[..., 0, :, :], grams[..., 1, :, :]


def _sub_chunk(size: int) -> int:
    """The sub-chunk length for KDA: the largest divisor of `size` not above sqrt(size), at least 1 (balances the
    [C, s, d] pairwise decays against the [C / s, C, d] decayed keys)."""
    return max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
