"""Composition weights vs a float64 brute force over orders; stability; gradients."""

import itertools
import math

import pytest
import torch

from hf_statecompose.ops.compose.weights import caso_weights, picaso_r_weights, picaso_s_weights, soup_weights


def brute_force(decays: torch.Tensor, orders) -> torch.Tensor:
    """Mean over ``orders`` of the CASO weights: context at position p gets Π of the decays after it."""
    W = torch.zeros_like(decays)
    for order in orders:
        for pos, k in enumerate(order):
            after = list(order[pos + 1 :])
            W[k] += torch.prod(decays[after], 0) if after else torch.ones_like(decays[0])
    return W / len(orders)


def _decays(n, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(n, 8, generator=g, dtype=torch.float64)
    a[:, 0] = 0.0  # vanishing
    a[:, 1] = 1.0  # no decay
    a[:, 2] = 1e-300  # tiny but not zero
    a[0, 3] = 0.0  # one context fully decayed
    a[:, 4] = 1 - 1e-12  # almost no decay
    a[:, 5] = torch.rand(n, generator=g, dtype=torch.float64) ** 50  # long contexts
    return a


@pytest.mark.parametrize("n", range(1, 7))
def test_picaso_s_equals_mean_over_all_permutations(n):
    a = _decays(n, seed=n)
    expected = brute_force(a, list(itertools.permutations(range(n))))
    torch.testing.assert_close(picaso_s_weights(torch.log(a)), expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("n", range(1, 7))
def test_picaso_r_equals_mean_over_rotations(n):
    a = _decays(n, seed=10 + n)
    rotations = [tuple((k + j) % n for j in range(n)) for k in range(n)]
    torch.testing.assert_close(picaso_r_weights(torch.log(a)), brute_force(a, rotations), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("n", range(1, 7))
def test_caso_equals_single_order(n):
    a = _decays(n, seed=20 + n)
    torch.testing.assert_close(caso_weights(torch.log(a)), brute_force(a, [tuple(range(n))]), rtol=1e-12, atol=1e-14)


def test_soup_is_uniform():
    w = soup_weights(torch.zeros(4, 3))
    assert torch.all(w == 0.25)


def test_picaso_s_is_invariant_to_any_reordering():
    a = _decays(6, seed=3)
    w = picaso_s_weights(torch.log(a))
    for perm in ([5, 4, 3, 2, 1, 0], [2, 0, 5, 1, 3, 4]):
        torch.testing.assert_close(picaso_s_weights(torch.log(a[perm])), w[perm], rtol=1e-12, atol=1e-15)


def test_picaso_r_is_invariant_to_rotation():
    a = _decays(5, seed=4)
    w = picaso_r_weights(torch.log(a))
    rolled = torch.roll(a, 2, 0)
    torch.testing.assert_close(picaso_r_weights(torch.log(rolled)), torch.roll(w, 2, 0), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("fn", [picaso_s_weights, picaso_r_weights, caso_weights])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stable_for_64_states_and_extreme_decays(fn, dtype):
    g = torch.Generator().manual_seed(0)
    log_a = -torch.rand(64, 200, generator=g, dtype=torch.float64) * 2000  # decays down to e^-2000
    log_a[:, :10] = float("-inf")  # exactly 0
    log_a[:, 10:20] = 0.0  # exactly 1
    log_a[:, 20:30] = math.log(1e-300)
    w = fn(log_a.to(dtype))
    assert torch.isfinite(w).all() and (w >= 0).all()
    # with every decay 1 each order puts weight 1 on every context (sum = n); with decays 0 only the last counts
    ones = fn(torch.zeros(64, 1, dtype=dtype))
    torch.testing.assert_close(ones, torch.ones_like(ones))


def test_n_equals_64_against_brute_force_over_rotations():
    a = _decays(64, seed=7)
    rotations = [tuple((k + j) % 64 for j in range(64)) for k in range(64)]
    torch.testing.assert_close(picaso_r_weights(torch.log(a)), brute_force(a, rotations), rtol=1e-10, atol=1e-14)


def test_picaso_s_large_n_against_symmetric_polynomial_form():
    """n = 20 is out of reach of n! but not of Prop. 2's e_m form, computed here by DP in float64."""
    n = 20
    a = torch.rand(n, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    expected = torch.zeros_like(a)
    for k in range(n):
        others = torch.cat([a[:k], a[k + 1 :]])
        e = [torch.ones(3, dtype=torch.float64)] + [torch.zeros(3, dtype=torch.float64)] * (n - 1)
        for value in others:
            e = [e[0]] + [e[m] + value * e[m - 1] for m in range(1, n)]
        expected[k] = sum(e[m] / math.comb(n - 1, m) for m in range(n)) / n
    torch.testing.assert_close(picaso_s_weights(torch.log(a)), expected, rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("fn", [picaso_s_weights, picaso_r_weights, caso_weights])
def test_gradcheck_float64(fn):
    log_a = (-torch.rand(4, 3, dtype=torch.float64) * 3).requires_grad_(True)
    assert torch.autograd.gradcheck(fn, (log_a,))
