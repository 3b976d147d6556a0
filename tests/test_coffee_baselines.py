"""S6 and "COFFEE as in (4)" baselines of the COFFEE paper (hf_statecompose/models/coffee/baselines.py)."""

import pytest
import torch

from hf_statecompose.models.coffee import LinearizedS6Mixer, S6Mixer

MIXERS = [S6Mixer, LinearizedS6Mixer, lambda d, n: LinearizedS6Mixer(d, n, token_bc=True)]
IDS = ["s6", "linearized", "linearized-token-bc"]


def count(m):
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("make", MIXERS, ids=IDS)
def test_shapes_and_parameter_count(make):
    torch.manual_seed(0)
    m = make(16, 8)
    # 3 n D + D^2 + D: with a 8 x 16 embedding, the paper's 784 (Tables 1 and 6)
    assert count(m) == 3 * 8 * 16 + 16 * 16 + 16 == 656
    assert count(m) + 8 * 16 == 784
    y, h = m(torch.randn(3, 7, 16), return_final_state=True)
    assert y.shape == (3, 7, 16) and h.shape == (3, 16, 8)
    assert m(torch.randn(2, 5, 16)).shape == (2, 5, 16)


def test_no_delta_bias_matches_mnist_counts():
    # Table 7: S6 n = 16 within four D = 25 layers + the 2785-parameter head: 10085
    assert 4 * count(S6Mixer(25, 16, delta_bias=False)) + 100 * 25 + 25 + 25 * 10 + 10 == 10085


def test_s6_initialisation():
    m = S6Mixer(4, 3)
    assert torch.allclose(m.eigenvalues, -torch.tensor([1.0, 2.0, 3.0]).expand(4, 3))
    assert torch.all(m.W_D.bias == 0)


@pytest.mark.parametrize("make", MIXERS, ids=IDS)
def test_parallel_matches_loop_and_gradients(make):
    torch.manual_seed(1)
    m = make(6, 4).double()
    u = torch.randn(2, 33, 6, dtype=torch.float64, requires_grad=True)
    x0 = torch.randn(2, 6, 4, dtype=torch.float64)
    y1, h1 = m(u, x0, return_final_state=True)
    y2, h2 = m(u, x0, return_final_state=True, method="sequential")
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(h1, h2)
    g1 = torch.autograd.grad(y1.square().sum(), [u, *m.parameters()])
    g2 = torch.autograd.grad(y2.square().sum(), [u, *m.parameters()])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def _zoh_step_reference(m, u_k, x):
    """One S6 step written out per feature and state entry (App. B, eq. (13))."""
    lam = m.eigenvalues
    delta = torch.nn.functional.softplus(m.W_D(u_k))
    Bk, Ck = m.W_B(u_k), m.W_C(u_k)
    out = torch.empty_like(x)
    for i in range(m.hidden_size):
        for j in range(m.state_size):
            e = torch.exp(lam[i, j] * delta[:, i])
            out[:, i, j] = e * x[:, i, j] + (e - 1) / lam[i, j] * Bk[:, j] * u_k[:, i]
    return out, (out * Ck[:, None, :]).sum(-1)


def test_s6_is_zero_order_hold():
    torch.manual_seed(2)
    m = S6Mixer(3, 2).double()
    u = torch.randn(2, 4, 3, dtype=torch.float64)
    x = torch.zeros(2, 3, 2, dtype=torch.float64)
    ys = []
    for k in range(4):
        x, y = _zoh_step_reference(m, u[:, k], x)
        ys.append(y)
    with torch.no_grad():
        torch.testing.assert_close(m(u), torch.stack(ys, 1))


@pytest.mark.parametrize("make", MIXERS, ids=IDS)
def test_state_continuation(make):
    torch.manual_seed(3)
    m = make(5, 3).double()
    u = torch.randn(2, 12, 5, dtype=torch.float64)
    with torch.no_grad():
        y, h = m(u, return_final_state=True)
        y1, h1 = m(u[:, :7], return_final_state=True)
        y2, h2 = m(u[:, 7:], initial_state=h1, return_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    torch.testing.assert_close(h2, h)


@pytest.mark.parametrize("make", MIXERS, ids=IDS)
def test_mask_padding_leaves_state(make):
    torch.manual_seed(4)
    m = make(5, 3).double()
    u = torch.randn(2, 6, 5, dtype=torch.float64)
    padded = torch.cat([torch.randn(2, 3, 5, dtype=torch.float64), u], 1)
    mask = torch.cat([torch.zeros(2, 3), torch.ones(2, 6)], 1)
    with torch.no_grad():
        y, h = m(u, return_final_state=True)
        yp, hp = m(padded, mask=mask, return_final_state=True)
        _ys, hs = m(padded, mask=mask, return_final_state=True, method="sequential")
    torch.testing.assert_close(yp[:, 3:], y)
    torch.testing.assert_close(hp, h)
    torch.testing.assert_close(hs, h)


def test_bad_arguments():
    m = S6Mixer(4, 2)
    with pytest.raises(ValueError):
        m(torch.randn(1, 3, 5))
    with pytest.raises(ValueError):
        m(torch.randn(1, 3, 4), initial_state=torch.zeros(1, 4, 3))
    with pytest.raises(ValueError):
        m(torch.randn(1, 3, 4), mask=torch.ones(1, 2))
    with pytest.raises(ValueError):
        m(torch.randn(1, 3, 4), method="nope")
    with pytest.raises(ValueError):
        S6Mixer(0, 2)
