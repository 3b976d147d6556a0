"""Composing delta-rule contexts: each context is the affine map S ↦ M S + S_C (reference.py), so composing
contexts in an order composes their maps, and a mean over orders is the mean of the composed maps (its state is
the mean map applied to the empty state, its transition the mean of the products).

    compose_in_order(states, transitions)     S = M_n(⋯(M_2 S_1 + S_2)⋯) + S_n, M = M_n⋯M_1: n − 1 steps
    mean_over_rotations(states, transitions)  the mean over the n cyclic orders: 3n steps (prefix / suffix folds)
    mean_over_orders(states, transitions)     the mean over all n! orders, exactly, by a recursion over subsets:
                                              n·2^(n−1) steps; the maps of two subset sizes at a time,
                                              at most C(n, ⌊n/2⌋) + C(n, ⌊n/2⌋ + 1)

Over a subset T, Ḡ(T) = (1/|T|) Σ_{j∈T} [S_j + M_j Ḡ(T∖{j})] and P̄(T) = (1/|T|) Σ_{j∈T} M_j P̄(T∖{j}), with
Ḡ(∅) = 0, P̄(∅) = I: the orders of T that end with j are j after an order of T∖{j}. A "step" is one
``[k, k] @ [k, v + k]`` product per batch row and head.

states ``[n, ..., k, v]``, transitions ``[n, ..., k, k]`` (any leading dims between, e.g. batch and heads) ->
(state ``[..., k, v]``, transition ``[..., k, k]``), in the inputs' dtype. Each matches the reference fold over
the same orders (tests/test_delta_rule_ops.py, float64).
"""

from __future__ import annotations

import torch

# mean_over_orders keeps up to C(n, n/2) + C(n, n/2 + 1) maps of the inputs' size: at n = 12, 1716 of them
MAX_ALL_ORDERS = 12


def _check(states: torch.Tensor, transitions: torch.Tensor) -> int:
    if states.dim() < 3 or transitions.dim() != states.dim():
        raise ValueError(f"states [n, ..., k, v] and transitions [n, ..., k, k]: got {tuple(states.shape)}, "
                         f"{tuple(transitions.shape)}")  # fmt: skip
    k = states.shape[-2]
    if transitions.shape[:-2] != states.shape[:-2] or transitions.shape[-2:] != (k, k):
        raise ValueError(f"transitions {tuple(transitions.shape)} do not fit states {tuple(states.shape)}")
    if states.shape[0] == 0:
        raise ValueError("nothing to compose: no states")
    return states.shape[0]


def compose_in_order(states: torch.Tensor, transitions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The contexts encoded one after the other, in the order of dim 0."""
    n = _check(states, transitions)
    state, transition = states[0], transitions[0]
    for i in range(1, n):
        state = torch.matmul(transitions[i], state) + states[i]
        transition = torch.matmul(transitions[i], transition)
    return state, transition


def _then(first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]):
    """The map `first` followed by `second`: (M₂M₁, M₂S₁ + S₂)."""
    (s1, m1), (s2, m2) = first, second
    return torch.matmul(m2, s1) + s2, torch.matmul(m2, m1)


def mean_over_rotations(states: torch.Tensor, transitions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean over the n cyclic orders (r, r+1, …, n−1, 0, …, r−1): each is the suffix r.. then the prefix ..r−1,
    and all prefixes and suffixes come from one fold each way."""
    n = _check(states, transitions)
    maps = [(states[i], transitions[i]) for i in range(n)]
    prefixes = [maps[0]]  # prefixes[r] = maps 0..r in order
    for i in range(1, n):
        prefixes.append(_then(prefixes[-1], maps[i]))
    suffixes = [maps[n - 1]]  # suffixes[j] = maps n−1−j..n−1 in order
    for i in range(n - 2, -1, -1):
        suffixes.append(_then(maps[i], suffixes[-1]))
    suffixes.reverse()  # suffixes[r] = maps r..n−1 in order
    total_s, total_m = suffixes[0]  # rotation 0 is the list order
    total_s, total_m = total_s.clone(), total_m.clone()
    for r in range(1, n):
        s, m = _then(suffixes[r], prefixes[r - 1])
        total_s, total_m = total_s + s, total_m + m
    return total_s / n, total_m / n


def mean_over_orders(states: torch.Tensor, transitions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact mean over all n! orders, by the recursion over subsets (module docstring); subsets of one size at
    a time, all of them in one batched product per element."""
    n = _check(states, transitions)
    if n > MAX_ALL_ORDERS:
        raise ValueError(
            f"the mean over all orders of {n} contexts needs 2^{n} intermediate states (at most "
            f"{MAX_ALL_ORDERS} contexts: 2^{MAX_ALL_ORDERS} = {2**MAX_ALL_ORDERS}); use the mean over cyclic "
            "orders (picaso_r), which is linear in n"
        )
    # one combined [k, v + k] block per subset: the mean state beside the mean transition
    k = states.shape[-2]
    blocks = torch.cat([states, transitions], dim=-1)  # [n, ..., k, v + k]
    empty = torch.zeros_like(blocks[0])
    empty[..., :, states.shape[-1] :] = torch.eye(k, dtype=blocks.dtype, device=blocks.device)
    offsets = torch.zeros_like(blocks)  # S_j in the state columns, 0 in the transition columns
    offsets[..., : states.shape[-1]] = states
    means = {0: empty}
    level = [0]
    for _ in range(n):  # subsets of size 1, 2, …, n
        nxt = sorted({mask | (1 << j) for mask in level for j in range(n) if not mask >> j & 1})
        for mask in nxt:
            # one term at a time into one accumulator: two maps beside the levels kept (stacking the |T| terms
            # held 3·|T| maps at once, and the peak grew as 2^n maps, measured)
            total = None
            for j in range(n):
                if mask >> j & 1:
                    term = torch.matmul(transitions[j], means[mask & ~(1 << j)]).add_(offsets[j])
                    total = term if total is None else total.add_(term)
            assert total is not None
            means[mask] = total.div_(mask.bit_count())
        for mask in level:
            if mask:  # maps of size − 1 are needed no more
                del means[mask]
        level = nxt
    full = means[(1 << n) - 1]
    return full[..., : states.shape[-1]].contiguous(), full[..., states.shape[-1] :].contiguous()
