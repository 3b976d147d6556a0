"""Contracts of the state and of composition that the maths fixes, written so that the plausible wrong
implementations fail: ΣΔ of a convex combination is the same combination (not a sum), ΣΔ accumulates over
forwards, generate's in-place batch operations carry ΣΔ and token counts, nested compositions agree with
one flat composition where the algebra says so, and the model-based baselines refuse foreign states."""

import importlib.util

import pytest
import torch

from hf_statecompose import ComposableMambaCache, StateComposer
from hf_statecompose.ops import backends
from hf_statecompose.ops.compose import native as compose_native

from helpers import random_ids, tiny_model


def _encode_all(model, lengths, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return [ComposableMambaCache.encode(model, random_ids(n, batch=batch, generator=g)) for n in lengths]


def _assert_states_close(actual, expected, rtol=1e-5, atol=1e-6, conv_exact=False):
    assert actual.num_layers == expected.num_layers
    for i in range(expected.num_layers):
        torch.testing.assert_close(actual.ssm_states[i], expected.ssm_states[i], rtol=rtol, atol=atol)
        torch.testing.assert_close(actual.delta_sums[i], expected.delta_sums[i], rtol=rtol, atol=atol)
        if conv_exact:
            assert torch.equal(actual.conv_states[i], expected.conv_states[i])
        else:
            torch.testing.assert_close(actual.conv_states[i], expected.conv_states[i], rtol=rtol, atol=atol)
    assert torch.equal(actual.num_tokens, expected.num_tokens)


# ------------------------------------------------------------------ ΣΔ of each method
def _composition_paths():
    """Every path StateComposer can take on this machine: the native C kernel (all layers in one pass), the
    blockwise torch path with native kernels off, and Triton (its CPU interpreter without a GPU, see
    conftest.py) where it is installed."""
    paths = [
        pytest.param(
            "native",
            marks=pytest.mark.skipif(not compose_native.available(), reason="no C compiler for the native kernel"),
        ),
        "torch",
    ]
    if importlib.util.find_spec("triton") is not None:
        paths.append("triton")
    return paths


@pytest.mark.parametrize("path", _composition_paths())
def test_delta_sum_of_each_method(model, path, monkeypatch):
    """soup / weighted are convex combinations: their ΣΔ is the same combination of the inputs' ΣΔ (a sum
    would claim a context n times as long). The order-based methods stand for a concatenation: the total.
    On every composition path, each checked to be the one that ran."""
    states = _encode_all(model, (5, 9, 3), batch=2)
    if path == "triton" and torch.cuda.is_available():  # compiled kernels (the interpreter runs CPU tensors)
        states = [s.to("cuda") for s in states]
    ran = []
    if path == "native":
        monkeypatch.setattr(compose_native, "compose_native", _spy(compose_native.compose_native, ran))
    else:
        monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", "0")  # the native kernel would take precedence
        for name, runs_on in (("compose_ssm_torch", "torch"), ("_triton_op", "triton")):
            monkeypatch.setattr(backends, name, _spy(getattr(backends, name), ran if path == runs_on else []))
    backend = "triton" if path == "triton" else "torch"
    w = [0.5, 0.3, 0.2]
    soup = StateComposer("soup", backend=backend).compose(states)
    weighted = StateComposer("weighted", weights=w, backend=backend).compose(states)
    for method in ("caso", "picaso_s", "picaso_r"):
        total = StateComposer(method, backend=backend).compose(states)
        for i in range(model.config.num_hidden_layers):
            torch.testing.assert_close(total.delta_sums[i], sum(s.delta_sums[i] for s in states))
        assert total.num_tokens.tolist() == [17, 17]
    for i in range(model.config.num_hidden_layers):
        torch.testing.assert_close(soup.delta_sums[i], sum(s.delta_sums[i] for s in states) / 3)
        torch.testing.assert_close(weighted.delta_sums[i], sum(wk * s.delta_sums[i] for wk, s in zip(w, states)))
        # and visibly not the total: every ΣΔ is positive, so the mean is strictly below the sum
        assert (soup.delta_sums[i] < sum(s.delta_sums[i] for s in states)).all()
    # the path under test composed every one of the 5 methods (native, and Triton's compose_layers: once for all
    # layers; torch: per layer)
    assert len(ran) == 5 * (model.config.num_hidden_layers if path == "torch" else 1), path


def _spy(function, calls):
    def spy(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return spy


# ------------------------------------------------------------------ forwards accumulate the state
def test_continuing_a_state_equals_encoding_the_concatenation(arch):
    """encode(c1), then a forward of c2 with cache_params=that state, is encode(c1 + c2) in every tensor,
    ΣΔ (accumulated over both forwards) and the token count included."""
    model = tiny_model(arch, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    c1, c2 = random_ids(7, batch=2, generator=g), random_ids(5, batch=2, generator=g)
    with torch.no_grad():
        first = ComposableMambaCache.encode(model, c1)
        continued = first.clone()
        model(c2, cache_params=continued, use_cache=True)
        whole = ComposableMambaCache.encode(model, torch.cat([c1, c2], 1))
    # SSM states and ΣΔ are kept in float32 whatever the model's dtype: float32 rounding
    _assert_states_close(continued, whole, rtol=1e-6, atol=1e-6)
    for i in range(whole.num_layers):  # ΣΔ of c2 alone would be far off
        assert not torch.allclose(continued.delta_sums[i] - first.delta_sums[i], whole.delta_sums[i])
    assert continued.num_tokens.tolist() == [12, 12]
    assert continued.token_ids is None  # the ids of c1 no longer describe the state


# ------------------------------------------------------------------ generate's in-place batch operations
def test_in_place_batch_operations_carry_delta_sums_and_token_counts(model):
    """reorder_cache (beam search), batch_select_indices and batch_repeat_interleave act on every row
    tensor, ΣΔ and token counts included, exactly like the functional select / repeat_interleave."""
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        state = ComposableMambaCache.stack(
            [ComposableMambaCache.encode(model, random_ids(n, generator=g)) for n in (4, 6, 9)]
        )
    index = torch.tensor([2, 0, 2])
    for op in ("reorder_cache", "batch_select_indices"):
        inplace = state.clone()
        getattr(inplace, op)(index)
        _assert_states_close(inplace, state.select(index), rtol=0, atol=0, conv_exact=True)
        assert torch.equal(inplace.token_ids, state.select(index).token_ids)
    repeated = state.clone()
    repeated.batch_repeat_interleave(2)
    _assert_states_close(repeated, state.repeat_interleave(2), rtol=0, atol=0, conv_exact=True)
    assert repeated.num_tokens.tolist() == [4, 4, 6, 6, 9, 9]


# ------------------------------------------------------------------ nested vs flat composition
def test_caso_of_caso_states_is_caso_of_all(model):
    """CASO folds the states in order, so folding two folded halves is folding everything: SSM state, ΣΔ
    (the total), conv window (the last context's) and token count agree."""
    a, b, c, d, e = _encode_all(model, (4, 7, 3, 6, 5), batch=2)
    caso = StateComposer("caso")
    nested = caso.compose([caso.compose([a, b]), caso.compose([c, d, e])])
    _assert_states_close(nested, caso.compose([a, b, c, d, e]), conv_exact=True)


def test_weighted_of_weighted_states_is_one_weighted_composition(model):
    """Convex combinations nest: w(w(a, b; p, 1-p), c; q, 1-q) = w(a, b, c; qp, q(1-p), 1-q), the SSM
    state, ΣΔ and conv window alike (the token count is the total either way)."""
    a, b, c = _encode_all(model, (4, 7, 3))
    p, q = 0.3, 0.6
    inner = StateComposer("weighted", weights=[p, 1 - p]).compose([a, b])
    nested = StateComposer("weighted", weights=[q, 1 - q]).compose([inner, c])
    flat = StateComposer("weighted", weights=[q * p, q * (1 - p), 1 - q]).compose([a, b, c])
    _assert_states_close(nested, flat)
    soup = StateComposer("soup")
    _assert_states_close(soup.compose([soup.compose([a, b]), soup.compose([c, a])]), soup.compose([a, b, c, a]))


# ------------------------------------------------------------------ model-based baselines refuse foreign states
@pytest.mark.parametrize("method", ["concat", "piconcat_r"])
def test_model_based_methods_refuse_states_of_another_model(arch, method):
    other_arch = "mamba2" if arch == "mamba" else "mamba"
    model = tiny_model(arch)
    states = _encode_all(model, (4, 5))
    composer = StateComposer(method)
    with pytest.raises(ValueError, match="re-encode the contexts with this model"):
        composer.compose(states, model=tiny_model(arch, seed=1))  # same architecture, other weights
    with pytest.raises(ValueError, match=r"another model|re-encode"):
        composer.compose(states, model=tiny_model(other_arch))
    composer.compose(states, model=model)  # the encoding model is accepted


# ------------------------------------------------------------------ weights of the wrong type
@pytest.mark.parametrize(
    "weights,error,match",
    [
        ([[0.5, 0.5]], TypeError, r"weights\[0\] is \[0.5, 0.5\]"),
        (torch.tensor([[0.5, 0.5]]), ValueError, "must be 1-D"),
        ([True, False], TypeError, r"weights\[0\] is True \(bool\)"),
        (torch.tensor([True, False]), TypeError, "torch.bool"),
        ("0.5,0.5", TypeError, "got str"),
        ([0.5, "0.5"], TypeError, r"weights\[1\] is '0.5'"),
        ([0.5 + 0j, 0.5], TypeError, r"weights\[0\] is \(0.5\+0j\)"),
        (torch.tensor([0.5, 0.5], dtype=torch.complex64), TypeError, "complex64"),
        ({0: 0.5, 1: 0.5}, TypeError, "got dict"),
        ({0.5, 0.25}, TypeError, "got set"),
        ([0.5, None], TypeError, r"weights\[1\] is None"),
        ([], ValueError, "empty"),
        ([0.5, 0.6], ValueError, "sum to 1"),
        ([1.5, -0.5], ValueError, "non-negative"),
    ],
)
def test_weighted_refuses_weights_that_are_not_n_real_numbers(weights, error, match):
    with pytest.raises(error, match=match):
        StateComposer("weighted", weights=weights)
    with pytest.raises(error, match=match):
        StateComposer("soup", conv="weighted", weights=weights)


def test_weighted_accepts_real_numbers_in_any_container():
    import numpy as np

    expected = torch.tensor([0.25, 0.75], dtype=torch.float64)
    for weights in (
        [0.25, 0.75],
        (1 / 4, 3 / 4),
        [np.float32(0.25), 0.75],
        np.array([0.25, 0.75]),
        torch.tensor([0.25, 0.75]),
        [torch.tensor(0.25), 0.75],
    ):
        assert torch.equal(StateComposer("weighted", weights=weights).weights, expected)
    with pytest.raises(ValueError, match="needs weights"):
        StateComposer("weighted", weights=None)
