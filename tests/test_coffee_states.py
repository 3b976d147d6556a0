"""COFFEE states: encode, compose and generate like Mamba (issue 13).

A COFFEE layer's state [B, E, n] lives in a plain ComposableMambaCache, flattened as a Mamba-1 state with one
channel per element ([B, E·n, 1]), an empty conv window, ΣΔ = -Σ_k log(1 + λΔ(k)) and A = -1. What every
architecture's state does (one state + query = context + query, padded batches, files, copies, refusals) is
checked once for all in test_state_contract.py; here what is COFFEE's own: with the input gate (no feedback)
CASO of two states is the state of the concatenation, with the state feedback gate it is not; crafted files."""

import copy

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer
from hf_statecompose.composition.composer import MODEL_FREE_METHODS
from hf_statecompose.ops.compose import native as compose_native
from hf_statecompose.ops.compose.reference import compose_ssm_ref
from hf_statecompose.state.validation import check_state

from architectures import COFFEE_STATE_MATTERS, COFFEE_VOCAB, tiny_coffee
from helpers import craft, relative_error

VOCAB = COFFEE_VOCAB
NEW = 8
STATE_MATTERS = COFFEE_STATE_MATTERS


tiny = tiny_coffee  # the tiny COFFEE LM of tests/architectures.py


def ids_of(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_states_equal(actual, expected, rtol=1e-5, atol=1e-6):
    assert type(actual) is type(expected) and actual.num_layers == expected.num_layers
    for v in range(expected.num_layers):
        for name in ("ssm_states", "conv_states", "delta_sums", "A"):
            torch.testing.assert_close(getattr(actual, name)[v], getattr(expected, name)[v], rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def model():
    return tiny(**STATE_MATTERS)


@pytest.fixture(scope="module")
def context():
    return ids_of(13, seed=11)


@pytest.fixture(scope="module")
def state(model, context):
    with torch.no_grad():
        return ComposableMambaCache.encode(model, context)


@pytest.fixture(scope="module")
def states(model):
    with torch.no_grad():
        return [ComposableMambaCache.encode(model, ids_of(n, seed=20 + n)) for n in (9, 14, 6)]


# ------------------------------------------------------------------------------------------ enable / encode
def test_enable_and_encode_accept_a_coffee_model(model, state, context):
    assert hsc.is_enabled(model) and isinstance(model, hsc.CoffeeForCausalLM)
    assert type(model.backbone.layers[0].mixer).__name__ == "CoffeeSequenceMixer"  # no mixer swap
    assert hsc.get_backend(model) == "auto" and hsc.enable(model) is model
    assert type(state) is ComposableMambaCache and state.architecture == "coffee"
    assert state.num_layers == 2 and state.fingerprint == hsc.model_fingerprint(model)
    assert state.num_tokens.tolist() == [13] and torch.equal(state.token_ids, context)
    E = 32 * 4  # intermediate_size · state_size
    assert state.ssm_states[0].shape == (1, E, 1) and state.conv_states[0].shape == (1, E, 0)
    assert state.delta_sums[1].shape == (1, E) and torch.equal(state.A[1], -torch.ones(E, 1))
    assert state.log_decay(0).shape == (1, E, 1) and (state.log_decay(0) <= 0).all()
    check_state(state, model)
    with torch.no_grad():  # the log decay is the mixer's Σ log(1 + λΔ), the state its final state, flattened
        block = model.backbone.layers[0]
        x = block.mixer.in_proj(block.norm(model.backbone.embeddings(context))).chunk(2, -1)[0]
        _, final, log_decay = block.mixer.ssm(x, return_log_decay=True)
    torch.testing.assert_close(state.ssm_states[0], final.reshape(1, E, 1))
    torch.testing.assert_close(state.log_decay(0), log_decay.reshape(1, E, 1))
    with torch.no_grad():  # a left-padded batch of contexts: counts, ids, each row as encoded alone
        ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids_of(5, seed=3)], 1)
        ids = torch.cat([ids, ids_of(9, seed=4)])
        mask = (torch.arange(9) >= torch.tensor([[4], [0]])).long()
        batch = ComposableMambaCache.encode(model, ids, attention_mask=mask)
        alone = ComposableMambaCache.encode(model, ids[:1, 4:])
    assert batch.num_tokens.tolist() == [5, 9] and batch.token_ids[0, :4].tolist() == [-1] * 4
    assert_states_equal(batch.select(0), alone)


def test_models_whose_states_do_not_compose_are_refused():
    for overrides, message in (
        (dict(mixer_type="s6"), "mixer_type='coffee'"),
        (dict(gate="linear_state"), "gate='state' or 'input'"),
    ):
        torch.manual_seed(0)
        model = hsc.CoffeeForCausalLM(
            hsc.CoffeeConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, state_size=4, **overrides)
        )
        with pytest.raises(TypeError, match=message):
            hsc.enable(model)
        with pytest.raises(TypeError, match=message):
            ComposableMambaCache.encode(model, ids_of(4))


def test_backend_and_disable(model):
    other = copy.deepcopy(model)
    hsc.set_backend(other, "torch")
    assert hsc.get_backend(other) == "torch"
    hsc.disable(other)
    assert not hsc.is_enabled(other) and type(other) is hsc.CoffeeForCausalLM
    with pytest.raises(ValueError, match=r"past_states needs hf_statecompose\.enable"):
        other(ids_of(2), past_states=[object()])
    hsc.enable(other)
    assert hsc.is_enabled(other)


# ------------------------------------------------------------------------------------------ n > 1
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("method", MODEL_FREE_METHODS)
@torch.no_grad()
def test_states_compose_per_element_with_empty_conv_windows(states, method, native, monkeypatch):
    """Per layer: the composed state is the plain reference's composition of the flattened states with their
    per-element decays (soup / weighted: exactly the weighted mean), ΣΔ the total (mean / weighted mean), the
    conv windows stay empty; on the native CPU kernel and on the torch path."""
    if not native:
        monkeypatch.setattr(compose_native, "enabled", lambda: False)
    elif not compose_native.enabled():
        pytest.skip("no native compose kernel here")
    weights = [0.2, 0.5, 0.3] if method == "weighted" else None
    composed = StateComposer(method, weights=weights).compose(states)
    assert type(composed) is ComposableMambaCache and composed.num_tokens.tolist() == [9 + 14 + 6]
    w = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    for v in range(composed.num_layers):
        deltas = torch.stack([s.delta_sums[v] for s in states])
        expected = compose_ssm_ref(
            [s.ssm_states[v].double() for s in states], deltas.double(), states[0].A[v].double(), method, weights=w
        )
        torch.testing.assert_close(composed.ssm_states[v].double(), expected, rtol=1e-5, atol=1e-6)
        if method in ("soup", "weighted"):  # the weighted mean of the states, as defined
            mean = sum((1 / 3 if w is None else float(w[k])) * s.ssm_states[v].double() for k, s in enumerate(states))
            torch.testing.assert_close(composed.ssm_states[v].double(), mean, rtol=1e-6, atol=1e-7)
        if method == "soup":
            total = deltas.mean(0)
        elif method == "weighted":
            total = (w.float()[:, None, None] * deltas).sum(0)
        else:
            total = deltas.sum(0)
        torch.testing.assert_close(composed.delta_sums[v], total)
        assert torch.equal(composed.A[v], states[0].A[v])
        assert composed.conv_states[v].shape == (1, 128, 0)
    check_state(composed)


def _core(gate: str) -> hsc.CoffeeForCausalLM:
    return tiny(head="core", num_hidden_layers=1, hidden_size=16, state_size=4, gate=gate)


@torch.no_grad()
def test_caso_is_the_concatenation_without_feedback_and_not_with_it():
    """A 1-layer core model is linear time-varying in its state when its gate reads the input only: the
    state after c1 + c2 is Π(1 + λΔ) over c2 times the state after c1, plus the state of c2 alone, which is
    CASO. With the state feedback gate, c2's gates depend on the state it starts from: CASO differs."""
    c1, c2 = ids_of(12, seed=100), ids_of(9, seed=101)
    query = ids_of(3, seed=102)
    differences = {}
    for gate in ("input", "state"):
        model = _core(gate)
        s1, s2 = (ComposableMambaCache.encode(model, c) for c in (c1, c2))
        caso = StateComposer("caso").compose([s1, s2])
        whole = ComposableMambaCache.encode(model, torch.cat([c1, c2], 1))
        differences[gate] = relative_error(caso.ssm_states[0], whole.ssm_states[0])
        if gate == "input":
            torch.testing.assert_close(caso.delta_sums[0], whole.delta_sums[0], rtol=1e-5, atol=1e-5)  # decays add
            torch.testing.assert_close(caso.ssm_states[0], whole.ssm_states[0], rtol=1e-5, atol=1e-6)
            expected = model(torch.cat([c1, c2, query], 1)).logits[:, -3:]
            assert relative_error(model(query, past_states=[s1, s2], composition="caso").logits, expected) < 1e-4
    assert differences["input"] < 1e-5 and differences["state"] > 1e-3, differences  # CASO vs concat, relative


def test_training_through_compositions_reaches_the_mixer():
    """hsc.composition_loss on a COFFEE model: gradients through the composed states (bp2c) and on into the
    context encodings (bptc, a different gradient), finite, at the feedback weights w_D."""
    model = tiny(seed=4).train()
    examples = [
        hsc.CompositionExample(
            contexts=[ids_of(7, seed=120)[0], ids_of(5, seed=121)[0]],
            query=ids_of(3, seed=122)[0],
            target=ids_of(4, seed=123)[0],
        ),
        hsc.CompositionExample(
            contexts=[ids_of(6, seed=124)[0]], query=ids_of(2, seed=125)[0], target=ids_of(3, seed=126)[0]
        ),
    ]
    grads = {}
    for objective in ("bptc", "bp2c"):
        model.zero_grad()
        hsc.composition_loss(model, examples, objective=objective).backward()
        grad = model.backbone.layers[0].mixer.ssm.w_D.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, objective
        grads[objective] = grad.clone()
    assert not torch.allclose(grads["bptc"], grads["bp2c"])


# ------------------------------------------------------------------------------------------ bad input
def _set_layer(state, v, **tensors):
    current = dict(
        ssm_state=state.ssm_states[v], conv_state=state.conv_states[v], delta_sum=state.delta_sums[v], A=state.A[v]
    )
    current.update(tensors)
    state.set_layer(v, **current)


BAD_STATES = [
    (lambda s: _set_layer(s, 1, ssm_state=s.ssm_states[1] * float("nan")), "layer 1 SSM state contains NaN", True),
    (lambda s: _set_layer(s, 0, delta_sum=-s.delta_sums[0] - 1), "layer 0 ΣΔ has negative entries", False),
    (lambda s: _set_layer(s, 1, A=s.A[1] * 2), "layer 1 A is not this model's", True),
    (
        lambda s: _set_layer(s, 0, conv_state=torch.zeros(1, 128, 1)),
        r"layer 0 conv window has shape \(1, 128, 1\)",
        True,
    ),
    (
        lambda s: _set_layer(s, 0, ssm_state=s.ssm_states[0].view(1, 32, 4)),
        r"layer 0 SSM state has shape \(1, 32, 4\)",
        True,
    ),
]


@pytest.mark.parametrize("edit, message, on_past_states", BAD_STATES)
@torch.no_grad()
def test_bad_in_memory_states_are_refused(model, state, edit, message, on_past_states):
    """check_state refuses each; past_states= refuses those its checks cover (shapes, A, NaN; ΣΔ's sign is
    checked by check_state and on loading files, not on every past_states call, as for Mamba)."""
    bad = state.clone()
    edit(bad)
    with pytest.raises(ValueError, match=message):
        check_state(bad, model)
    if on_past_states:
        with pytest.raises(ValueError):
            model(ids_of(2), past_states=[bad])


# ------------------------------------------------------------------------------------------ files
@pytest.fixture
def saved(state, tmp_path):
    path = tmp_path / "coffee.safetensors"
    state.save(path)
    return path


def _set(name, fn):
    def edit(tensors, meta):
        tensors[name] = fn(tensors[name])

    return edit


CRAFTED = [
    ("missing conv", lambda t, m: t.pop("conv.1"), r"missing tensors \['conv.1'\]"),
    (
        "conv not empty",
        _set("conv.0", lambda t: torch.zeros(1, 128, 2)),
        r"layer 0 conv window has (per-row )?shape \(1?,? ?128, 2\)",
    ),
    (
        "ssm unflattened",
        _set("ssm.1", lambda t: t.reshape(1, 32, 4).contiguous()),
        r"layer 1 SSM state has (per-row )?shape",
    ),
    ("negative ΣΔ", _set("delta_sum.0", lambda t: -t - 1), "ΣΔ has negative entries"),
    ("A positive", _set("A.1", lambda t: -t), "layer 1 A (must be finite and <= 0|is not this model's)"),
    ("nan state", _set("ssm.0", lambda t: t * float("nan")), "SSM state contains NaN"),
    ("architecture mamba", lambda t, m: m.update(architecture="mamba"), "metadata says 'mamba'"),
    ("layers", lambda t, m: m.update(num_layers=3), "config has 2 layers, the metadata says 3"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_crafted_files_are_refused(model, saved, edit, message):
    path = craft(saved, saved.parent / "crafted.safetensors", edit)
    for kwargs in ({}, {"model": model}):
        with pytest.raises(ValueError, match=message):
            ComposableMambaCache.load(path, **kwargs)


@torch.no_grad()
def test_core_module_states_round_trip(tmp_path):
    """The core head's states (E = hidden_size) through a file and back, generating the same."""
    model = _core("state")
    context, query = ids_of(10, seed=110), ids_of(3, seed=111)
    state = ComposableMambaCache.encode(model, context)
    assert state.ssm_states[0].shape == (1, 16 * 4, 1)
    state.save(tmp_path / "core.safetensors")
    loaded = ComposableMambaCache.load(tmp_path / "core.safetensors", model=model)
    expected = model.generate(torch.cat([context, query], 1), max_new_tokens=NEW, do_sample=False)[:, 10:]
    assert torch.equal(model.generate(query, past_states=[loaded], max_new_tokens=NEW, do_sample=False), expected)
