"""Hybrid keys the other tests left alone (issue 29, item 11): RoPE with non-default frequencies, where the composer
must take the model's own ``inv_freq`` to re-rotate moved keys, and a hybrid state whose attention layers hold no
keys (``context_length`` 0), which every entry point refuses."""

import re

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import StateComposer
from hf_statecompose.state.architectures import architecture
from hf_statecompose.state.layers import ComposableAttentionLayer

from architectures import hybrid_model, ids
from helpers import relative_error

# the attention layer first, so that its keys depend only on the tokens and their positions
ATTENTION_FIRST = {"bamba": dict(attn_layer_indices=[0]), "falcon_h1": {}}
THETA = 37.0  # far from the default 10000: its frequencies differ from the default ones in every rotated pair
ROPES = {
    "theta": dict(rope_type="default", rope_theta=THETA),
    "linear": dict(rope_type="linear", rope_theta=THETA, factor=3.0),  # inv_freq / 3: no config-only formula
}


def rope_model(arch, rope):
    parameters = dict(ROPES[rope])
    if arch == "bamba":
        parameters["partial_rotary_factor"] = 0.5  # Bamba's partial RoPE (transformers adds it to the default)
    model = hybrid_model(arch, rope_parameters=parameters, **ATTENTION_FIRST[arch])
    layout = architecture(arch)
    assert layout.attention_layer_indices(model.config)[0] == 0
    assert layout.rotary_dims(model.config) > 0
    return model


def rotary_inv_freq(model):
    return next(m.inv_freq for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor))


@pytest.mark.parametrize(
    ("rope", "with_model"),
    [("theta", True), ("theta", False), ("linear", True)],
    ids=["theta", "theta_config", "linear"],
)
@pytest.mark.parametrize("arch", list(ATTENTION_FIRST))
@torch.no_grad()
def test_concat_rerotates_keys_with_the_models_own_frequencies(arch, rope, with_model):
    """Two states composed with ``concat`` placement: the second state's keys, re-rotated by the first's length,
    are the keys of the concatenation. With rope_theta 37 (or a linear scaling) the default frequencies
    (theta 10000) would rotate them to the wrong angles; first shown: they differ from the model's. The frequencies
    come from the model's rotary embedding (``inv_freq``) or, without ``model=``, from the config's rope_theta."""
    model = rope_model(arch, rope)
    rotary = architecture(arch).rotary_dims(model.config)
    default = 1.0 / (10000.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    assert (rotary_inv_freq(model).double() - default).abs().max() > 0.1
    c1, c2 = ids(6, seed=30), ids(9, seed=31)
    s1, s2 = hsc.encode(model, c1), hsc.encode(model, c2)
    whole = hsc.encode(model, torch.cat([c1, c2], 1)).layers[0]
    # the keys were moved: without the re-rotation state 2's keys are not the concatenation's
    assert relative_error(s2.layers[0].keys[..., :rotary], whole.keys[:, :, 6:, :rotary]) > 1e-2
    composed = StateComposer("picaso_r").compose([s1, s2], model=model if with_model else None).layers[0]
    assert composed.positions.tolist() == [list(range(15))]
    torch.testing.assert_close(composed.keys[:, :, :6], whole.keys[:, :, :6], rtol=0, atol=1e-12)
    # float32 RoPE tables in transformers, float64 re-rotation here
    assert relative_error(composed.keys[:, :, 6:], whole.keys[:, :, 6:]) < 1e-6


@pytest.mark.parametrize("arch", list(ATTENTION_FIRST))
@torch.no_grad()
def test_scaled_rope_needs_the_model_and_generate_passes_it(arch):
    """A scaled RoPE has no frequency formula in the config alone: composing without ``model=`` is refused, and
    ``generate`` (which composes with the model) gives the logits of composing with ``model=`` explicitly."""
    model = rope_model(arch, "linear")
    states = [hsc.encode(model, ids(6, seed=40)), hsc.encode(model, ids(9, seed=41))]
    with pytest.raises(ValueError, match=r"'linear' RoPE needs the model: compose with model=model"):
        StateComposer("soup").compose(states)
    query = ids(4, seed=42)
    via_forward = model(query, past_states=states, composition="soup").logits
    composed = StateComposer("soup").compose(states, model=model)
    # the continued positions, as forward passes them
    positions = (composed.attention_layers[0].positions.max() + 1 + torch.arange(4))[None]
    mask = torch.ones(1, composed.context_length + 4, dtype=torch.long)
    by_hand = model(
        query, **hsc.compat.cache_kwargs(composed, hybrid=True), attention_mask=mask, position_ids=positions
    ).logits
    torch.testing.assert_close(via_forward, by_hand, rtol=0, atol=0)


@pytest.mark.parametrize("arch", list(ATTENTION_FIRST))
@torch.no_grad()
def test_one_state_plus_query_equals_context_plus_query_with_non_default_rope(arch):
    """The exactness of one state under a non-default theta: the query continues at the context's positions."""
    model = rope_model(arch, "theta")
    context, query = ids(7, seed=50), ids(5, seed=51)
    state = hsc.encode(model, context)
    with_state = model(query, past_states=[state]).logits
    whole = model(torch.cat([context, query], 1)).logits[:, 7:]
    assert relative_error(with_state, whole) < 1e-6


# ------------------------------------------------------------------------------------------ keyless hybrid states
@pytest.fixture(scope="module")
def bamba_states():
    model = hybrid_model("bamba")
    state = hsc.encode(model, ids(5, seed=1))
    keyless = hsc.encode(model, ids(5, seed=1))
    for i in keyless.attention_layer_indices:  # an attention layer as a fresh cache has it: no keys, no positions
        keyless.layers[i] = ComposableAttentionLayer()
    return model, state, keyless


def test_a_keyless_hybrid_state_reports_no_keys(bamba_states):
    """``context_length`` (and the repr that shows it) and ``key_mask`` of a hybrid state without keys: 0 and None,
    not an AttributeError; with keys, the number of key slots."""
    _, state, keyless = bamba_states
    assert state.context_length == 5 and "keys=5" in repr(state)
    assert keyless.context_length == 0 and "keys=0" in repr(keyless)
    assert keyless.key_mask is None


def test_a_keyless_hybrid_state_is_refused_everywhere(bamba_states, tmp_path):
    """The SSM layers alone are not a hybrid context's state: forward, generate, composing (at either place of the
    list) and saving refuse it by name, where the same calls with the keyed state run."""
    model, state, keyless = bamba_states
    query = ids(3, seed=2)
    calls = [
        ("past_states[0]", lambda s: model(query, past_states=[s])),
        ("past_states[0]", lambda s: model.generate(query, past_states=[s], max_new_tokens=1, do_sample=False)),
        ("states[1]", lambda s: StateComposer("soup").compose([state, s])),
        ("state to save", lambda s: s.save(tmp_path / "x.safetensors")),
    ]
    for where, call in calls:
        call(state)
        with pytest.raises(ValueError, match=rf"^{re.escape(where)}: layer 1 \(attention\) holds no keys"):
            call(keyless)
    with pytest.raises(ValueError, match=r"states\[0\]: layer 1 \(attention\) holds no keys"):
        StateComposer("soup", attention="none").compose([keyless, state])
