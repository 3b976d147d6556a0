"""Composition weights vs a float64 brute force over orders; stability; gradients; the weight rule every method's
weights obey (``CompositionMethod.weights``), which ``check_weights`` enforces on registered weight functions."""

import itertools
import math

import pytest
import torch

from hf_statecompose.ops.compose.methods import METHODS
from hf_statecompose.ops.compose.weights import (
    WEIGHT_FUNCTIONS,
    caso_weights,
    check_weights,
    picaso_r_weights,
    picaso_s_weights,
    soup_weights,
    weight_tolerance,
)


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


def _rule_error(W, log_decays, rule) -> float:
    """How far ``W`` is from the weight rule ``rule``, in float64 (the largest violation of any of its parts)."""
    W, ld = W.double(), log_decays.double()
    if rule != "total":
        return float((W.sum(0) - 1).abs().max())
    zero = torch.zeros_like(ld[:1])
    others = torch.cat([zero, torch.cumsum(ld[:-1], 0)]) + torch.cat(
        [torch.flip(torch.cumsum(torch.flip(ld[1:], [0]), 0), [0]), zero]
    )
    identity = (-torch.expm1(ld) * W).sum(0) + torch.expm1(ld.sum(0))
    return max(float((W - 1).max()), float((torch.exp(others) - W).max()), float(identity.abs().max()))


@pytest.mark.parametrize("name", sorted(WEIGHT_FUNCTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_builtin_weights_obey_the_weight_rule_well_inside_its_tolerance(name, dtype):
    """The rule check_weights applies to registered weight functions holds for the package's own ones (so it does
    not refuse a correct method), at every extreme decay and up to n = 200, within a tenth of the tolerance."""
    rule = METHODS[name].delta_sum
    for n in (1, 2, 3, 5, 16, 64, 200):
        a = torch.cat([_decays(n, seed=30 + n), 1 - torch.rand(n, 2, dtype=torch.float64) * 1e-3], 1)
        log_a = torch.log(a).to(dtype)
        W = WEIGHT_FUNCTIONS[name](log_a)
        check_weights(W, log_a, rule, name)
        assert _rule_error(W, log_a, rule) <= weight_tolerance(n, dtype) / 10, (name, n)


def test_the_rule_for_total_holds_for_any_mixture_of_orders_and_not_beyond():
    """delta_sum='total': every order's fold (and so any mean of orders) passes; a convex mix of states that is no
    concatenation (the soup's 1/n with decays < 1) is refused by the identity."""
    import itertools

    a = torch.rand(4, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 0.9
    orders = list(itertools.permutations(range(4)))
    for order in orders[::5]:
        check_weights(brute_force(a, [order]), torch.log(a), "total")
    check_weights(brute_force(a, orders[3:17]), torch.log(a), "total")
    with pytest.raises(ValueError, match="1 − Π_k a_k"):
        check_weights(torch.full_like(a, 0.25).clamp_min(torch.prod(a, 0) / a), torch.log(a), "total")


def _faults(log_a):
    n = log_a.shape[0]
    return {
        "negative": (-soup_weights(log_a), ValueError, "negative weights"),
        "sum 0": (torch.zeros_like(log_a), ValueError, r"off 1|below Π"),
        "sum 2": (soup_weights(log_a) * 2, ValueError, r"off 1|below Π"),
        "1e30": (torch.full_like(log_a, 1e30), ValueError, r"off 1|above 1"),
        "shape [n]": (torch.full((n,), 1 / n), ValueError, r"shape \(3,\) for log decays of shape \(3, 4\)"),
        "int": (torch.ones_like(log_a, dtype=torch.int64), TypeError, "torch.int64 weights; weights must be floating"),
        "NaN": (torch.full_like(log_a, float("nan")), ValueError, "NaN or inf"),
        "not a tensor": ([1 / n] * n, TypeError, "list, not a tensor"),
    }


@pytest.mark.parametrize("rule", ["uniform", "user", "total"])
@pytest.mark.parametrize("fault", list(_faults(torch.zeros(3, 4))))
def test_check_weights_refuses_each_fault(rule, fault):
    log_a = torch.log(torch.rand(3, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.9 + 0.05)
    W, error, message = _faults(log_a)[fault]
    with pytest.raises(error, match=message):
        check_weights(W, log_a, rule, "toy")
    good = soup_weights(log_a) if rule != "total" else picaso_r_weights(log_a)
    check_weights(good, log_a, rule, "toy")  # the same call without the fault passes
