"""ops.delta_rule: the gated delta rule / KDA recurrence with transitions against transformers' own torch paths,
the affine identity S_AB = M_B S_A + S_B, and each composition against the fold over the same orders (float64)."""

import importlib
import itertools
import math

import pytest
import torch

from hf_statecompose.ops.delta_rule import (
    MAX_ALL_ORDERS,
    compose_in_order,
    compose_in_order_reference,
    delta_rule_reference,
    mean_over_orders,
    mean_over_orders_reference,
    mean_over_rotations,
    rotations,
)


def _inputs(seed, batch=2, length=7, key_heads=2, heads=4, k_dim=5, v_dim=3, kda=False, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = rand(batch, length, key_heads, k_dim), rand(batch, length, key_heads, k_dim)
    v = rand(batch, length, heads, v_dim)
    beta = torch.rand(batch, length, heads, generator=gen, dtype=dtype)
    g_shape = (batch, length, heads, k_dim) if kda else (batch, length, heads)
    g = -torch.rand(*g_shape, generator=gen, dtype=dtype)  # log-decays in (−1, 0]
    return q, k, v, g, beta


def _split(x, at):
    return x[:, :at], x[:, at:]


def _stock(module, function):
    try:
        return getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), function)
    except (ImportError, AttributeError) as error:  # pragma: no cover - both tested transformers ends have them
        pytest.fail(f"transformers lacks {module}.{function}: {error}")


@pytest.mark.parametrize(
    ("module", "function", "kda"),
    [
        ("qwen3_next", "torch_recurrent_gated_delta_rule", False),
        ("qwen3_5", "torch_recurrent_gated_delta_rule", False),
        ("olmo_hybrid", "torch_recurrent_gated_delta_rule", False),
        ("kimi_linear", "recurrent_kimi_delta_attention", True),
    ],
)
@pytest.mark.parametrize("l2norm", [False, True])
def test_the_reference_is_transformers_own_recurrence(module, function, kda, l2norm):
    stock = _stock(module, function)
    # kimi's recurrence has one key head per value head; the GDN ones repeat key heads
    q, k, v, g, beta = _inputs(0, key_heads=4 if kda else 2, kda=kda, dtype=torch.float32)
    initial = torch.randn(2, 4, 5, 3)
    out, state, _ = delta_rule_reference(q, k, v, g, beta, initial_state=initial, use_qk_l2norm=l2norm)
    expected_out, expected_state = stock(
        q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=l2norm
    )
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, expected_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kda", [False, True])
def test_the_transition_is_the_product_of_the_token_steps(kda):
    q, k, v, g, beta = _inputs(1, key_heads=4, kda=kda)
    _, _, transition = delta_rule_reference(q, k, v, g, beta, output_transition=True)
    eye = torch.eye(5, dtype=torch.float64)
    expected = eye.expand(2, 4, 5, 5).clone()
    for t in range(k.shape[1]):
        kt, bt = k[:, t], beta[:, t]
        reflect = eye - bt[..., None, None] * kt[..., :, None] * kt[..., None, :]
        decay = torch.diag_embed(g[:, t].exp()) if kda else g[:, t].exp()[..., None, None] * eye
        expected = reflect @ decay @ expected
    torch.testing.assert_close(transition, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("at", [1, 3, 6])
def test_encoding_a_then_b_is_the_affine_map_of_b_applied_to_a(kda, at):
    q, k, v, g, beta = _inputs(2 + at, kda=kda)
    _, whole, whole_m = delta_rule_reference(q, k, v, g, beta, output_transition=True)
    parts = [_split(x, at) for x in (q, k, v, g, beta)]
    _, s_a, m_a = delta_rule_reference(*(p[0] for p in parts), output_transition=True)
    _, s_b, m_b = delta_rule_reference(*(p[1] for p in parts), output_transition=True)
    torch.testing.assert_close(m_b @ s_a + s_b, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m_b @ m_a, whole_m, rtol=1e-12, atol=1e-12)
    # the layout matters: the transposed transition does not compose (one GDN token's step is symmetric: from two on,
    # the product is not)
    if kda or k.shape[1] - at > 1:
        assert (m_b.transpose(-1, -2) @ s_a + s_b - whole).abs().max() > 1e-3
    # and continuing from A's state and transition is encoding B with them as the start
    _, cont, cont_m = delta_rule_reference(
        *(p[1] for p in parts), initial_state=s_a, initial_transition=m_a, output_transition=True
    )
    torch.testing.assert_close(cont, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cont_m, whole_m, rtol=1e-12, atol=1e-12)


def test_padded_steps_leave_state_and_transition_unchanged():
    q, k, v, g, beta = _inputs(9)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # row 1 left-padded by 3
    _, state, transition = delta_rule_reference(q, k, v, g, beta, mask=mask, output_transition=True)
    _, row, row_m = delta_rule_reference(*(x[1:, 3:] for x in (q, k, v, g, beta)), output_transition=True)
    torch.testing.assert_close(state[1:], row, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(transition[1:], row_m, rtol=1e-12, atol=1e-12)


def _contexts(seed, n, kda=False):
    """n contexts of different lengths encoded apart: their (state, transition), and the concatenation's."""
    q, k, v, g, beta = _inputs(seed, length=3 * n + 1, kda=kda)
    cuts = [0, *sorted(torch.randperm(3 * n, generator=torch.Generator().manual_seed(seed))[: n - 1].add(1).tolist()),
            3 * n + 1]  # fmt: skip
    states, transitions = [], []
    for lo, hi in itertools.pairwise(cuts):
        _, s, m = delta_rule_reference(*(x[:, lo:hi] for x in (q, k, v, g, beta)), output_transition=True)
        states.append(s)
        transitions.append(m)
    _, whole, whole_m = delta_rule_reference(q, k, v, g, beta, output_transition=True)
    return states, transitions, whole, whole_m


@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("n", [1, 2, 5])
def test_composing_in_order_is_encoding_the_concatenation(kda, n):
    states, transitions, whole, whole_m = _contexts(10 + n, n, kda)
    s, m = compose_in_order(torch.stack(states), torch.stack(transitions))
    torch.testing.assert_close(s, whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(m, whole_m, rtol=1e-10, atol=1e-10)
    s_ref, m_ref = compose_in_order_reference(states, transitions)
    torch.testing.assert_close(s, s_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m, m_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_the_mean_over_all_orders_is_the_mean_of_every_permutation(n):
    states, transitions, _, _ = _contexts(20 + n, n)
    s, m = mean_over_orders(torch.stack(states), torch.stack(transitions))
    s_ref, m_ref = mean_over_orders_reference(states, transitions)
    assert math.factorial(n) == len(list(itertools.permutations(range(n))))
    torch.testing.assert_close(s, s_ref, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(m, m_ref, rtol=1e-11, atol=1e-11)
    if n > 1:  # not the list order's composition: the orders differ (the maps do not commute)
        in_order, _ = compose_in_order(torch.stack(states), torch.stack(transitions))
        assert (s - in_order).abs().max() > 1e-4


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_the_mean_over_rotations_is_the_mean_of_the_cyclic_orders(n):
    states, transitions, _, _ = _contexts(30 + n, n, kda=True)
    s, m = mean_over_rotations(torch.stack(states), torch.stack(transitions))
    s_ref, m_ref = mean_over_orders_reference(states, transitions, orders=rotations(n))
    torch.testing.assert_close(s, s_ref, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(m, m_ref, rtol=1e-11, atol=1e-11)
    assert rotations(3) == [(0, 1, 2), (1, 2, 0), (2, 0, 1)]


def test_compositions_refuse_what_does_not_fit():
    states, transitions, _, _ = _contexts(40, 2)
    s, m = torch.stack(states), torch.stack(transitions)
    for compose in (compose_in_order, mean_over_rotations, mean_over_orders):
        with pytest.raises(ValueError, match="no states"):
            compose(s[:0], m[:0])
        with pytest.raises(ValueError, match="do not fit"):
            compose(s, m[..., :-1, :-1])
        with pytest.raises(ValueError, match="do not fit"):
            compose(s, m[:, :1])
    big = MAX_ALL_ORDERS + 1
    with pytest.raises(ValueError, match="picaso_r"):
        mean_over_orders(s[:1].expand(big, *s.shape[1:]), m[:1].expand(big, *m.shape[1:]))
