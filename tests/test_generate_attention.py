"""``attention=`` beside ``composition=`` in ``generate`` / ``forward`` (issue 29, item 8): the placement of the states'
attention keys passed as users first try it, equal to ``StateComposer(method, attention=...)``."""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import StateComposer

from architectures import hybrid_model, ids
from helpers import relative_error


@pytest.fixture(scope="module")
def bamba():
    """A float64 Bamba (partial RoPE) with sharper attention than a random init's near-uniform one, so that where the
    keys sit moves the logits; two states of different lengths (``concat`` and ``shared`` place them differently)."""
    model = hybrid_model("bamba")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(4.0)
    states = [hsc.encode(model, ids(5, seed=1)), hsc.encode(model, ids(9, seed=2))]
    return model, states, ids(4, seed=3)


def generated_logits(model, query, states, **kwargs):
    out = model.generate(
        query,
        past_states=states,
        max_new_tokens=3,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    return out.sequences, torch.stack(out.logits, 1)


@torch.no_grad()
def test_generate_attention_equals_the_composers_placement_and_differs_from_the_default(bamba):
    model, states, query = bamba
    default_ids, default = generated_logits(model, query, states, composition="soup")
    composer_ids, composer = generated_logits(
        model, query, states, composition=StateComposer("soup", attention="shared")
    )
    # first: the placement matters here, so the comparison below can fail
    assert relative_error(composer, default) > 1e-4
    kwarg_ids, kwarg = generated_logits(model, query, states, composition="soup", attention="shared")
    assert torch.equal(kwarg_ids, composer_ids)
    torch.testing.assert_close(kwarg, composer, rtol=0, atol=0)
    # attention="concat" is the default placement; an equal StateComposer with the same attention= is accepted
    concat_ids, concat = generated_logits(model, query, states, composition="soup", attention="concat")
    assert torch.equal(concat_ids, default_ids)
    torch.testing.assert_close(concat, default, rtol=0, atol=0)
    same_ids, _ = generated_logits(
        model, query, states, composition=StateComposer("soup", attention="shared"), attention="shared"
    )
    assert torch.equal(same_ids, composer_ids)


@torch.no_grad()
def test_forward_attention_equals_the_composers_placement(bamba):
    model, states, query = bamba
    default = model(query, past_states=states, composition="picaso_s").logits
    composer = model(query, past_states=states, composition=StateComposer("picaso_s", attention="none")).logits
    assert relative_error(composer, default) > 1e-4
    kwarg = model(query, past_states=states, composition="picaso_s", attention="none").logits
    torch.testing.assert_close(kwarg, composer, rtol=0, atol=0)


@pytest.mark.parametrize("bad", ["shard", "", "SHARED", 1, ["shared"]])
def test_an_unknown_placement_is_refused(bamba, bad):
    model, states, query = bamba
    for call in (model.generate, model):
        with pytest.raises(ValueError, match=r"attention=.*choose one of concat, shared, none"):
            call(query, past_states=states, composition="soup", attention=bad)


def test_a_composer_with_another_placement_is_refused(bamba):
    model, states, query = bamba
    composer = StateComposer("soup", attention="concat")
    for call in (model.generate, model):
        with pytest.raises(ValueError, match=r"attention='shared' conflicts with .*whose attention is 'concat'"):
            call(query, past_states=states, composition=composer, attention="shared")


def test_attention_without_past_states_is_refused(bamba):
    model, _, query = bamba
    for call in (model.generate, model):
        with pytest.raises(ValueError, match="attention= places the keys of past_states"):
            call(query, attention="shared")
    # without it, the stock call runs
    assert model(query).logits.shape[:2] == query.shape


def test_the_signature_shows_attention(bamba):
    import inspect

    model, _, _ = bamba
    for method in (type(model).forward, type(model).generate):
        parameter = inspect.signature(method).parameters["attention"]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None
