"""ops.delta_rule.chunked: chunk_delta_rule (GDN and KDA by chunks, with the transition through the [S | M] block)
against the token-by-token reference in float64 (~1e-10), across lengths around the chunk size, grouped heads,
initial states / transitions, padding masks and chunk sizes; float32 against float64 on a long sequence with strong
decays; the affine identity S_AB = M_B S_A + S_B; and a backward pass."""

import zlib

import pytest
import torch
import torch.nn.functional as F

from hf_statecompose.ops.delta_rule import chunk_delta_rule, delta_rule_reference
from hf_statecompose.ops.delta_rule.reference import l2norm

TOL = 1e-10


def _inputs(
    seed,
    *,
    batch=2,
    length=13,
    key_heads=2,
    heads=2,
    k_dim=5,
    v_dim=3,
    kda=False,
    normalized=True,
    strong=0.05,
    dtype=torch.float64,
):
    """Random q, k, v, g, beta: log decays −softplus(·)/2 with a fraction `strong` of them at −20 (a near reset),
    β in (0.05, 0.95), keys l2-normalised unless `normalized` is False (then use_qk_l2norm does it)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = rand(batch, length, key_heads, k_dim), rand(batch, length, key_heads, k_dim)
    if normalized:
        k = l2norm(k)
    v = rand(batch, length, heads, v_dim)
    beta = 0.05 + 0.9 * torch.rand(batch, length, heads, generator=gen, dtype=dtype)
    g = -F.softplus(rand(*((batch, length, heads, k_dim) if kda else (batch, length, heads)))) / 2
    g = torch.where(torch.rand(g.shape, generator=gen, dtype=dtype) < strong, torch.full_like(g, -20.0), g)
    return q, k, v, g, beta


def _states(seed, batch, heads, k_dim, v_dim, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(batch, heads, k_dim, v_dim, generator=gen, dtype=dtype)
    transition = torch.randn(batch, heads, k_dim, k_dim, generator=gen, dtype=dtype) / k_dim**0.5
    return state, transition


def _assert_close(actual, expected, tol=TOL):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    error = (actual.to(expected.dtype) - expected).abs().max().item() if expected.numel() else 0.0
    assert error <= tol * scale, f"max error {error:.3e} (scale {scale:.3e})"


def _assert_same(chunked, reference, tol=TOL, keep=None):
    (out, state, transition), (ref_out, ref_state, ref_transition) = chunked, reference
    if keep is not None:  # the output at padded steps is not specified
        out, ref_out = out[keep], ref_out[keep]
    _assert_close(out, ref_out, tol)
    _assert_close(state, ref_state, tol)
    assert (transition is None) == (ref_transition is None)
    if transition is not None:
        _assert_close(transition, ref_transition, tol)


# none: zero state, no transition; state: an initial state; transition: the transition out (from the identity);
# both: initial state and transition in, transition out; ignored: an initial transition but none asked for
MODES = ["none", "state", "transition", "both", "ignored"]


def _mode_kwargs(mode, seed, batch, heads, k_dim, v_dim):
    state, transition = _states(seed, batch, heads, k_dim, v_dim)
    return {
        "none": {},
        "state": {"initial_state": state},
        "transition": {"output_transition": True},
        "both": {"initial_state": state, "initial_transition": transition, "output_transition": True},
        "ignored": {"initial_state": state, "initial_transition": transition},
    }[mode]


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize(("key_heads", "heads"), [(2, 2), (2, 4)], ids=["H=Hk", "H=2Hk"])
@pytest.mark.parametrize("length", [1, 3, 8, 13], ids=lambda n: f"T={n}")  # chunk 4: one, under, multiple, not
@pytest.mark.parametrize("use_qk_l2norm", [False, True], ids=["plain", "l2norm"])
@pytest.mark.parametrize("mode", MODES)
def test_matches_the_reference(kda, key_heads, heads, length, use_qk_l2norm, mode):
    seed = zlib.crc32(repr((kda, heads, length, use_qk_l2norm, mode)).encode())
    q, k, v, g, beta = _inputs(
        seed, length=length, key_heads=key_heads, heads=heads, kda=kda, normalized=not use_qk_l2norm
    )
    kwargs = _mode_kwargs(mode, seed + 1, 2, heads, 5, 3) | {"use_qk_l2norm": use_qk_l2norm}
    chunked = chunk_delta_rule(q, k, v, g, beta, chunk_size=4, **kwargs)
    _assert_same(chunked, delta_rule_reference(q, k, v, g, beta, **kwargs))
    assert chunked[0].dtype == torch.float64 and chunked[1].dtype == torch.float64
    assert (chunked[2] is not None) == bool(kwargs.get("output_transition"))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 7, 16, 64])
def test_any_chunk_size(kda, chunk_size):
    q, k, v, g, beta = _inputs(3, length=21, heads=4, kda=kda)
    state, transition = _states(4, 2, 4, 5, 3)
    kwargs = {"initial_state": state, "initial_transition": transition, "output_transition": True}
    chunked = chunk_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, **kwargs)
    _assert_same(chunked, delta_rule_reference(q, k, v, g, beta, **kwargs))


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero", "state"])
def test_padding_mask(kda, with_state):
    """Left padding of different lengths per row, and a row padded in the middle: padded steps are the identity."""
    batch, length, heads = 4, 11, 4
    q, k, v, g, beta = _inputs(5, batch=batch, length=length, heads=heads, kda=kda)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, :6] = 0
    mask[3, 4:7] = 0  # row 2 unpadded
    kwargs = _mode_kwargs("both" if with_state else "transition", 6, batch, heads, 5, 3)
    chunked = chunk_delta_rule(q, k, v, g, beta, mask=mask, chunk_size=4, **kwargs)
    _assert_same(chunked, delta_rule_reference(q, k, v, g, beta, mask=mask, **kwargs), keep=mask.bool())
    # the left-padded row 1 is the same as its last 5 tokens alone
    row = [x[1:2, 6:] for x in (q, k, v, g, beta)]
    alone = chunk_delta_rule(*row, chunk_size=4, **{n: x[1:2] if torch.is_tensor(x) else x for n, x in kwargs.items()})
    _assert_close(chunked[0][1:2, 6:], alone[0])
    _assert_close(chunked[1][1:2], alone[1])
    _assert_close(chunked[2][1:2], alone[2])


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_float32_long_sequence(kda):
    """T = 300 with chunk 64 in float32 (some decays −20, a few −60) against the float64 reference."""
    q, k, v, g, beta = _inputs(7, batch=1, length=300, key_heads=2, heads=4, k_dim=16, v_dim=8, kda=kda)
    g[:, 50::97] = -60.0
    state, transition = _states(8, 1, 4, 16, 8)
    kwargs = {"initial_state": state, "initial_transition": transition, "output_transition": True}
    expected = delta_rule_reference(q, k, v, g, beta, **kwargs)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    chunked = chunk_delta_rule(
        *f32, chunk_size=64, **{n: x.float() if torch.is_tensor(x) else x for n, x in kwargs.items()}
    )
    assert all(x.dtype == torch.float32 for x in chunked if x is not None)
    assert all(torch.isfinite(x).all() for x in chunked if x is not None)
    _assert_same(chunked, expected, tol=1e-4)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_transition_composes(kda):
    """From S, running A then B equals M_B S_A + S_B (S_A from S, S_B from zero), and M_AB = M_B M_A."""
    q, k, v, g, beta = _inputs(9, length=17, heads=4, kda=kda)
    state, _ = _states(10, 2, 4, 5, 3)
    at = 10
    first = [x[:, :at] for x in (q, k, v, g, beta)]
    second = [x[:, at:] for x in (q, k, v, g, beta)]
    _, state_ab, transition_ab = chunk_delta_rule(
        q, k, v, g, beta, initial_state=state, output_transition=True, chunk_size=4
    )
    _, state_a, transition_a = chunk_delta_rule(*first, initial_state=state, output_transition=True, chunk_size=4)
    _, state_b, transition_b = chunk_delta_rule(*second, output_transition=True, chunk_size=4)
    assert transition_a is not None and transition_b is not None and transition_ab is not None
    _assert_close(state_ab, transition_b @ state_a + state_b)
    _assert_close(transition_ab, transition_b @ transition_a)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_backward_runs(kda):
    inputs = [x.float().requires_grad_() for x in _inputs(11, length=10, heads=4, kda=kda)]
    state = _states(12, 2, 4, 5, 3)[0].float().requires_grad_()
    out, final, transition = chunk_delta_rule(*inputs, initial_state=state, output_transition=True, chunk_size=4)
    assert transition is not None
    (out.square().sum() + final.sum() + transition.sum()).backward()
    for x in inputs + [state]:
        assert x.grad is not None and torch.isfinite(x.grad).all()


def test_dtypes_and_errors():
    q, k, v, g, beta = (x.to(torch.bfloat16) for x in _inputs(13, length=6))
    out, state, transition = chunk_delta_rule(q, k, v, g, beta, chunk_size=4)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32 and transition is None
    q, k, v, g, beta = _inputs(14, length=6, key_heads=2, heads=3)
    with pytest.raises(ValueError, match="multiple"):
        chunk_delta_rule(q, k, v, g, beta)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_delta_rule(*_inputs(15, length=6), chunk_size=0)
