"""The gated delta rule (GDN) and Kimi delta attention (KDA), token by token, with each context's transition:
the plain reference (the oracle).

Per value head the state S is ``[k_dim, v_dim]`` and a token's step is affine in it::

    GDN:  S_t = A_t S_{t-1} + β_t k_t v_tᵀ,   A_t = α_t (I − β_t k_t k_tᵀ),        α_t = exp(g_t)  (g: [B, T, H])
    KDA:  S_t = A_t S_{t-1} + β_t k_t v_tᵀ,   A_t = (I − β_t k_t k_tᵀ) Diag(exp g_t)              (g: [B, T, H, k_dim])
    o_t = S_tᵀ q_t / sqrt(k_dim)

so a context C of T tokens maps a state S to ``M_C S + S_C``, where ``M_C = A_T ⋯ A_1`` (``[k_dim, k_dim]``,
latest on the left) is its *transition* and ``S_C`` its state from zero: encoding A then B gives
``S_AB = M_B S_A + S_B`` and ``M_AB = M_B M_A``. ``M`` follows the same recurrence with ``k_dim``-wide values set
to zero, started from the identity.

Shapes (transformers' layout: ``torch_recurrent_gated_delta_rule`` / ``recurrent_kimi_delta_attention``)::

    query, key [B, T, Hk, k_dim]   value [B, T, H, v_dim]   beta [B, T, H]   g [B, T, H] (GDN) | [B, T, H, k_dim] (KDA)
    initial_state [B, H, k_dim, v_dim] | None   initial_transition [B, H, k_dim, k_dim] | None (identity)
    mask [B, T] | None: 0 marks (left) padding, whose steps leave S and M unchanged
    -> out [B, T, H, v_dim] (query's dtype), state [B, H, k_dim, v_dim], transition [B, H, k_dim, k_dim] | None

H is a multiple of Hk (each key head serves H // Hk consecutive value heads, as transformers repeats them).
Computed in float32 (float64 for float64 inputs), as transformers' torch paths compute in float32.
"""

from __future__ import annotations

import itertools

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim: the normalisation the models apply to q and k (use_qk_l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_reference(
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The recurrence by a Python loop over tokens; see the module docstring for shapes and maths."""
    batch, length, key_heads, k_dim = key.shape
    heads, v_dim = value.shape[-2:]
    if heads % key_heads:
        raise ValueError(f"{heads} value heads are not a multiple of {key_heads} key heads")
    kda = g.dim() == 4
    dtype = compute_dtype(value.dtype)
    q, k, v, b, decay = (x.to(dtype) for x in (query, key, value, beta, g))
    if heads != key_heads:
        q = q.repeat_interleave(heads // key_heads, dim=2)
        k = k.repeat_interleave(heads // key_heads, dim=2)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q / k_dim**0.5
    if initial_state is None:
        state = v.new_zeros((batch, heads, k_dim, v_dim))
    else:
        state = initial_state.to(dtype).clone()
    transition = None
    if output_transition or initial_transition is not None:
        if initial_transition is None:
            transition = torch.eye(k_dim, dtype=dtype, device=v.device).expand(batch, heads, k_dim, k_dim).clone()
        else:
            transition = initial_transition.to(dtype).clone()
    keep = None if mask is None else mask.to(torch.bool)
    out = v.new_zeros((batch, length, heads, v_dim))
    for t in range(length):
        k_t, v_t, b_t = k[:, t], v[:, t], b[:, t]
        # decay: α_t (GDN, a scalar per head) or Diag(exp g_t) (KDA, one per key channel: the rows of S and M)
        alpha = decay[:, t].exp()[..., None] if kda else decay[:, t].exp()[..., None, None]
        new_state = _step(state * alpha, k_t, b_t, v_t)
        new_transition = None if transition is None else _step(transition * alpha, k_t, b_t, None)
        if keep is not None:
            row = keep[:, t][:, None, None, None]
            new_state = torch.where(row, new_state, state)
            if new_transition is not None and transition is not None:
                new_transition = torch.where(row, new_transition, transition)
        state, transition = new_state, new_transition
        out[:, t] = (state * q[:, t][..., None]).sum(dim=-2)
    return out.to(query.dtype), state, transition if output_transition else None


def _step(decayed: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
    """(I − β k kᵀ) X + β k vᵀ for X = the decayed state (v given) or transition (v None: zero values)."""
    remembered = (decayed * k[..., None]).sum(dim=-2)  # kᵀ X
    delta = -remembered if v is None else v - remembered
    return decayed + k[..., None] * (beta[..., None] * delta)[..., None, :]


def compose_in_order_reference(
    states: list[torch.Tensor], transitions: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contexts encoded one after the other in list order, by folding the affine maps:
    S = M_n(⋯(M_2 S_1 + S_2)⋯) + S_n, M = M_n ⋯ M_1. states [..., k, v], transitions [..., k, k]."""
    state, transition = states[0], transitions[0]
    for s, m in zip(states[1:], transitions[1:], strict=True):
        state = m @ state + s
        transition = m @ transition
    return state, transition


def mean_over_orders_reference(
    states: list[torch.Tensor], transitions: list[torch.Tensor], orders=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of the in-order composition over `orders` (default: all n! permutations), each composed apart."""
    orders = list(itertools.permutations(range(len(states)))) if orders is None else list(orders)
    composed = [compose_in_order_reference([states[i] for i in o], [transitions[i] for i in o]) for o in orders]
    return torch.stack([s for s, _ in composed]).mean(0), torch.stack([m for _, m in composed]).mean(0)


def rotations(n: int) -> list[tuple[int, ...]]:
    """The n cyclic orders of 0..n-1 (rotation r starts at r)."""
    return [tuple((r + i) % n for i in range(n)) for r in range(n)]
