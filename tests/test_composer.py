"""StateComposer on real encoded states: definitions, invariances, conv policies, model baselines."""

import itertools

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer

from helpers import random_ids, tiny_model


@pytest.fixture
def states(model):
    with torch.no_grad():
        return [ComposableMambaCache.encode(model, random_ids(n, batch=2)) for n in (6, 11, 3, 8)]


def _caso_reference(states, order, layer):
    """CASO written directly: fold the states in order, decaying what came before."""
    x = torch.zeros_like(states[0].ssm_states[layer], dtype=torch.float64)
    for k in order:
        x = torch.exp(states[k].log_decay(layer).double()) * x + states[k].ssm_states[layer].double()
    return x


def test_methods_match_their_definitions(states):
    n = len(states)
    for layer in range(states[0].num_layers):
        caso = StateComposer("caso").compose(states).ssm_states[layer]
        torch.testing.assert_close(caso.double(), _caso_reference(states, range(n), layer), rtol=1e-5, atol=1e-6)
        perms = list(itertools.permutations(range(n)))
        expected_s = sum(_caso_reference(states, p, layer) for p in perms) / len(perms)
        torch.testing.assert_close(
            StateComposer("picaso_s").compose(states).ssm_states[layer].double(), expected_s, rtol=1e-5, atol=1e-6
        )
        rots = [[(k + j) % n for j in range(n)] for k in range(n)]
        expected_r = sum(_caso_reference(states, r, layer) for r in rots) / n
        torch.testing.assert_close(
            StateComposer("picaso_r").compose(states).ssm_states[layer].double(), expected_r, rtol=1e-5, atol=1e-6
        )
        soup = sum(s.ssm_states[layer] for s in states) / n
        torch.testing.assert_close(StateComposer("soup").compose(states).ssm_states[layer], soup)
        w = [0.1, 0.2, 0.3, 0.4]
        weighted = sum(wk * s.ssm_states[layer] for wk, s in zip(w, states))
        torch.testing.assert_close(StateComposer("weighted", weights=w).compose(states).ssm_states[layer], weighted)


def test_order_invariance(states):
    a = StateComposer("picaso_s").compose(states)
    b = StateComposer("picaso_s").compose([states[2], states[0], states[3], states[1]])
    c = StateComposer("picaso_r").compose(states)
    d = StateComposer("picaso_r").compose(states[1:] + states[:1])
    for i in range(a.num_layers):
        torch.testing.assert_close(a.ssm_states[i], b.ssm_states[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c.ssm_states[i], d.ssm_states[i], rtol=1e-5, atol=1e-6)


def test_one_state_composes_to_itself_exactly(states):
    for method in ("soup", "caso", "picaso_s", "picaso_r"):
        out = StateComposer(method).compose(states[:1])
        for i in range(out.num_layers):
            assert torch.equal(out.ssm_states[i], states[0].ssm_states[i])
            assert torch.equal(out.conv_states[i], states[0].conv_states[i])
            assert torch.equal(out.log_decay(i), states[0].log_decay(i))


def test_conv_policies_and_decay_bookkeeping(states):
    last = StateComposer("caso").compose(states)
    mean = StateComposer("picaso_r").compose(states)
    w = [0.4, 0.3, 0.2, 0.1]
    weighted = StateComposer("weighted", weights=w).compose(states)
    for i in range(last.num_layers):
        assert torch.equal(last.conv_states[i], states[-1].conv_states[i])
        torch.testing.assert_close(mean.conv_states[i], sum(s.conv_states[i] for s in states) / 4)
        torch.testing.assert_close(weighted.conv_states[i], sum(wk * s.conv_states[i] for wk, s in zip(w, states)))
        torch.testing.assert_close(last.delta_sums[i], sum(s.delta_sums[i] for s in states))
    assert last.num_tokens.tolist() == [28, 28]
    assert StateComposer("picaso_s", conv="last").conv == "last"


def test_many_states_and_long_contexts_match_the_reference(arch):
    """64 states with decays down to e^-1000: every method equals the float64 reference (an isfinite check
    alone could not fail here: compose raises on a non-finite result before any assertion runs)."""
    from hf_statecompose.ops.compose import compose_ssm_ref

    model = tiny_model(arch, layers=1)
    with torch.no_grad():
        base = ComposableMambaCache.encode(model, random_ids(40))
    states = []
    for k in range(64):
        s = base.clone()
        s.layers[0].ssm_state = s.ssm_states[0] * (1 + k % 5)  # the states differ
        s.delta_sums[0] = s.delta_sums[0] * (1 + 500 * (k % 3))  # very long contexts: decays ~ e^-1000s
        states.append(s)
    delta = torch.stack([s.delta_sums[0] for s in states]).double()
    for method in ("soup", "caso", "picaso_s", "picaso_r"):
        out = StateComposer(method).compose(states)
        expected = compose_ssm_ref([s.ssm_states[0].double() for s in states], delta, base.A[0].double(), method)
        torch.testing.assert_close(out.ssm_states[0].double(), expected, rtol=1e-5, atol=1e-6, msg=method)


def test_picaso_s_refuses_work_beyond_its_cap(states, monkeypatch):
    from hf_statecompose.composition import composer as composer_module

    terms = (
        len(states)
        * 2
        * sum(  # n·⌈n/2⌉ per weight, n = 4
            d.numel() * (s.shape[-1] if states[0].architecture == "mamba" else 1)
            for d, s in zip(states[0].delta_sums, states[0].ssm_states)
        )
    )
    monkeypatch.setattr(composer_module, "PICASO_S_MAX_TERMS", terms)
    StateComposer("picaso_s").compose(states)  # exactly at the cap: composed
    monkeypatch.setattr(composer_module, "PICASO_S_MAX_TERMS", terms - 1)
    with pytest.raises(ValueError, match="use method='picaso_r'"):
        StateComposer("picaso_s").compose(states)
    StateComposer("picaso_r").compose(states)  # O(n): no cap


def test_nan_anywhere_is_named_on_every_path(states, monkeypatch):
    """The native kernel checks finiteness in its own pass; a NaN in any input (even a conv window that
    the 'last' policy does not keep) is refused, naming the state, on both CPU paths."""
    bad = states[2].clone()
    bad.layers[1].conv_state[0, 0, 0] = float("nan")
    for native in ("1", "0"):
        monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", native)
        with pytest.raises(ValueError, match=r"states\[2\]: layer 1 conv window contains NaN"):
            StateComposer("soup").compose(states[:2] + [bad])
    monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", "1")
    with pytest.raises(ValueError, match=r"states\[2\]"):
        StateComposer("caso").compose(states[:2] + [bad, states[3]])


def test_composition_is_differentiable(states):
    leaf = states[1].ssm_states[0].clone().requires_grad_(True)
    states[1].layers[0].ssm_state = leaf
    delta = states[2].delta_sums[0].clone().requires_grad_(True)
    states[2].delta_sums[0] = delta
    for method in ("caso", "picaso_s", "picaso_r", "soup"):
        out = StateComposer(method).compose(states)
        grads = torch.autograd.grad(out.ssm_states[0].sum(), [leaf, delta], allow_unused=True)
        assert grads[0] is not None and grads[0].abs().sum() > 0, method
        if method != "soup":
            assert grads[1] is not None and grads[1].abs().sum() > 0, method


@torch.no_grad()
def test_piconcat_r_is_the_mean_over_rotated_concatenations(model):
    contexts = [random_ids(n) for n in (5, 7, 4)]
    states = [ComposableMambaCache.encode(model, c) for c in contexts]
    out = StateComposer("piconcat_r").compose(states, model=model)
    rotations = [torch.cat(contexts[k:] + contexts[:k], 1) for k in range(3)]
    encoded = [ComposableMambaCache.encode(model, r) for r in rotations]
    for i in range(out.num_layers):
        torch.testing.assert_close(out.ssm_states[i], sum(e.ssm_states[i] for e in encoded) / 3, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.conv_states[i], sum(e.conv_states[i] for e in encoded) / 3, rtol=1e-5, atol=1e-6)
    assert out.num_tokens.tolist() == [16]


@torch.no_grad()
def test_compose_states_function(states):
    a = hsc.compose_states(states, "picaso_s")
    b = StateComposer("picaso_s").compose(states)
    assert torch.equal(a.ssm_states[0], b.ssm_states[0])


def test_native_path_matches_the_torch_path_with_many_layers_and_odd_sizes(arch, monkeypatch):
    """One call of the native kernel composes every layer's SSM state, conv window and ΣΔ: on states of
    a model with more layers and rows not a multiple of 16 it equals the per-layer torch path (native
    kernels off), for every method and conv policy; a non-contiguous input or one that needs gradients
    takes the torch path and still composes."""
    model = tiny_model(arch, layers=5)  # Mamba-1: rows of N = 8 elements, half the kernel's 16 lanes
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        states = [ComposableMambaCache.encode(model, random_ids(5 + k, batch=2, generator=g)) for k in range(7)]
    w = [1 / 7] * 7
    cases = [
        ("soup", {}),
        ("weighted", {"weights": w}),
        ("caso", {}),
        ("picaso_s", {}),
        ("picaso_r", {}),
        ("caso", {"conv": "mean"}),
        ("soup", {"conv": "weighted", "weights": w}),
    ]
    for method, kwargs in cases:
        native = StateComposer(method, **kwargs).compose(states)
        monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", "0")
        torch_path = StateComposer(method, **kwargs).compose(states)
        monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", "1")
        for i in range(native.num_layers):
            for a, b in (
                (native.ssm_states[i], torch_path.ssm_states[i]),
                (native.conv_states[i], torch_path.conv_states[i]),
                (native.delta_sums[i], torch_path.delta_sums[i]),
            ):
                torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
            # the composed state owns its A (an in-place edit of it leaves the inputs alone)
            assert torch.equal(native.A[i], states[0].A[i]) and native.A[i].data_ptr() != states[0].A[i].data_ptr()
        assert torch.equal(native.num_tokens, torch_path.num_tokens)
    # a transposed-back (non-contiguous) SSM state, and a state that needs gradients: the torch path
    odd = states[1].clone()
    odd.layers[0].ssm_state = odd.ssm_states[0].transpose(1, 2).contiguous().transpose(1, 2)
    assert not odd.ssm_states[0].is_contiguous()
    ref = StateComposer("caso").compose(states)
    got = StateComposer("caso").compose([states[0], odd] + states[2:])
    torch.testing.assert_close(got.ssm_states[0], ref.ssm_states[0], rtol=2e-5, atol=1e-6)
    leaf = states[3].clone()
    leaf.layers[1].ssm_state.requires_grad_(True)
    out = StateComposer("picaso_r").compose(states[:3] + [leaf])
    assert out.ssm_states[1].requires_grad


def test_composed_state_is_a_full_cache_that_saves_loads_and_generates(model, tmp_path):
    """The native path builds its output cache without re-deriving the layers from the config: it is the
    same object as _empty_like() + set_layer gives (every attribute), every tensor its own storage, and it
    saves, loads and continues generation like any state."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        states = [ComposableMambaCache.encode(model, random_ids(4 + k, generator=g)) for k in range(3)]
    composed = StateComposer("picaso_r").compose(states)
    built = states[0]._empty_like()
    for i in range(composed.num_layers):
        built.set_layer(
            i,
            ssm_state=composed.ssm_states[i],
            conv_state=composed.conv_states[i],
            delta_sum=composed.delta_sums[i],
            A=composed.A[i],
        )
    built.num_tokens = composed.num_tokens
    assert vars(composed).keys() == vars(built).keys()
    for key, value in vars(built).items():
        if key != "layers":
            assert getattr(composed, key) is value or getattr(composed, key) == value, key
    for a, b in zip(composed.layers, built.layers):
        assert type(a) is type(b) and vars(a).keys() == vars(b).keys()
        for key, value in vars(b).items():
            other = vars(a)[key]
            if isinstance(value, dict):
                assert value.keys() == other.keys() and all(
                    (x is y) or (x == y) for x, y in zip(value.values(), other.values())
                ), key
            elif key == "cumulative_length_linear":  # transformers 5.25's token counter: each layer's own copy
                assert other is not value and torch.equal(other, value), key
            else:  # the layer's own tensors (ΣΔ, A) are the very ones set, other attributes equal
                assert other is value or (not torch.is_tensor(value) and other == value), key
    storages = {
        t.untyped_storage().data_ptr()
        for i in range(composed.num_layers)
        for t in (composed.ssm_states[i], composed.conv_states[i], composed.delta_sums[i])
    }
    assert len(storages) == 3 * composed.num_layers
    composed.save(tmp_path / "c.safetensors")
    loaded = ComposableMambaCache.load(tmp_path / "c.safetensors", model=model)
    for i in range(composed.num_layers):
        assert torch.equal(loaded.ssm_states[i], composed.ssm_states[i])
        assert torch.equal(loaded.conv_states[i], composed.conv_states[i])
    query = random_ids(3, generator=g)
    with torch.no_grad():
        first = model.generate(query, past_states=[composed], max_new_tokens=4, do_sample=False)
        again = model.generate(query, past_states=[loaded], max_new_tokens=4, do_sample=False)
    assert torch.equal(first, again)
