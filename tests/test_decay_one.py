"""A model with ``A_log = -inf`` somewhere (``A = -exp(A_log) = -0.0``: a decay of exactly 1, the channel never
forgets) composes its own states: the checks accept ``A <= 0`` as the model computes it (issue 29), the weights of
every model-free method stay finite (``exp(0 · ΣΔ) = 1``), and one state + query equals context + query."""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.composition import MODEL_FREE_METHODS, StateComposer
from hf_statecompose.state.cache import ComposableMambaCache
from hf_statecompose.state.fingerprint import model_fingerprint
from hf_statecompose.state.validation import check_against_model, check_state

from helpers import random_ids, tiny_model

# (layer-flat) indices of A_log set to -inf: Mamba-1 A_log [D, N] (channel 0's state 0, channel 5's state 3),
# Mamba-2 A_log [H] (heads 0 and 2)
FOREVER = {"mamba": (0, 5 * 8 + 3), "mamba2": (0, 2)}


def _never_forgets(arch):
    model = tiny_model(arch)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.A_log.view(-1)[list(FOREVER[arch])] = float("-inf")
    return model


@pytest.fixture(scope="module", params=sorted(FOREVER))
def setup(request):
    arch = request.param
    model = _never_forgets(arch)
    generator = torch.Generator().manual_seed(3)
    contexts = [random_ids(n, generator=generator) for n in (7, 5)]
    return arch, model, contexts, [hsc.encode(model, c) for c in contexts]


def _decay_one(arch, state, layer):
    """A bool mask of the SSM state's shape: the elements whose decay is exactly 1."""
    A = state.A[layer]
    assert bool((A == 0).any()) and bool(torch.signbit(A[A == 0]).all())  # -0.0, as -exp(-inf) gives
    mask = (A == 0)[None]  # Mamba-1 [1, D, N] like the state [B, D, N]; Mamba-2 [1, H] of [B, H, P, N]
    return (
        mask.expand_as(state.ssm_states[layer])
        if arch == "mamba"
        else mask[:, :, None, None].expand_as(state.ssm_states[layer])
    )


def test_its_states_pass_every_check(setup, tmp_path):
    _, model, _, states = setup
    for state in states:
        check_state(state, model)
        check_against_model(state, model, model_fingerprint(model))
    states[0].save(tmp_path / "s.safetensors")
    loaded = ComposableMambaCache.load(tmp_path / "s.safetensors", model=model)
    assert all(
        torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b)) for a, b in zip(loaded.A, states[0].A)
    )


def test_a_positive_A_is_still_refused(setup):
    _, _, _, states = setup
    state = states[0].clone()
    state.A[0].view(-1)[1] = 0.5
    with pytest.raises(ValueError, match=r"layer 0 A must be finite and <= 0 \(it is -exp\(A_log\)"):
        check_state(state)


def test_one_state_and_the_query_equal_the_context_and_the_query(setup):
    _, model, contexts, states = setup
    query = random_ids(4, generator=torch.Generator().manual_seed(9))
    full = model(torch.cat([contexts[0], query], dim=-1)).logits[:, -1]
    for backend in ("torch", "auto"):
        composed = model(query, past_states=[states[0]], composition=StateComposer("picaso_r", backend=backend))
        assert torch.allclose(composed.logits[:, -1], full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", MODEL_FREE_METHODS)
def test_every_method_composes_them(setup, method):
    arch, model, _, states = setup
    kwargs = {"weights": [0.25, 0.75]} if method == "weighted" else {}
    out = {b: StateComposer(method, backend=b, **kwargs).compose(states, model=model) for b in ("torch", "auto")}
    for layer in range(states[0].num_layers):
        torch_state, auto_state = out["torch"].ssm_states[layer], out["auto"].ssm_states[layer]
        assert torch.isfinite(torch_state).all() and torch.isfinite(auto_state).all()
        assert torch.allclose(auto_state, torch_state, rtol=1e-5, atol=1e-6)
        forever = _decay_one(arch, states[0], layer)
        x1, x2 = states[0].ssm_states[layer][forever], states[1].ssm_states[layer][forever]
        # where nothing decays, the order-based methods' weights are all 1 (CASO: Π a_j = 1 over any order):
        # the sum of the states, as the concatenation gives; soup and weighted average them
        expected = {"soup": (x1 + x2) / 2, "weighted": 0.25 * x1 + 0.75 * x2}.get(method, x1 + x2)
        assert torch.allclose(torch_state[forever], expected, rtol=1e-5, atol=1e-6), method
