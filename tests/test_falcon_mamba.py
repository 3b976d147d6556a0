"""FalconMamba (transformers' ``falcon_mamba``: Mamba-1 with weightless RMS norms on Δ, B and C).

Its stock mixer, like Mamba-1's, ignores a cached SSM state for inputs longer than one token; ``enable`` runs
our initial-state path instead (the norms applied as the mixer applies them). What every architecture's state
does (state + query = context + query, padded batches, composition, files, refusals) is checked for FalconMamba
in test_state_contract.py; here what is FalconMamba's own."""

import pytest
import torch

import hf_statecompose as hsc

from helpers import random_ids, relative_error, tiny_model

NEW = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model("falcon_mamba", seed=3)


@torch.no_grad()
def test_the_mixer_is_falcons_and_the_context_matters(model):
    mixer = model.backbone.layers[0].mixer
    assert type(mixer).__name__ == "ComposableFalconMambaMixer" and mixer.dt_layernorm is not None
    context, query = random_ids(21), random_ids(5)
    with_context = model(torch.cat([context, query], 1)).logits[:, -5:]
    alone = model(query).logits
    assert relative_error(alone, with_context) > 1e-2  # else the exactness tests below would prove nothing


@torch.no_grad()
def test_the_stock_mixer_ignores_a_cached_state_but_ours_does_not(model):
    """Why the new path exists: transformers' FalconMamba continuing a multi-token input from its own cache."""
    context, query = random_ids(17), random_ids(6)
    expected = model(torch.cat([context, query], 1)).logits[:, -6:]
    hsc.disable(model)
    try:
        stock = model(context, use_cache=True)
        cache = stock.cache if hasattr(stock, "cache") else stock.cache_params
        continued = model(query, use_cache=True, **{hsc.compat.CACHE_ARG: cache}).logits
    finally:
        hsc.enable(model)
    assert relative_error(continued, expected) > 1e-3
    ours = model(query, past_states=[hsc.encode(model, context)]).logits
    assert relative_error(ours, expected) < 1e-4


def test_never_enabled_falcon_mamba_refuses_past_states():
    model = tiny_model("falcon_mamba", seed=3)
    state = hsc.encode(model, random_ids(8))
    hsc.disable(model)
    query = random_ids(3)
    for call in (lambda: model(query, past_states=[state]), lambda: model.generate(query, past_states=[state])):
        with pytest.raises(ValueError, match=r"past_states needs hf_statecompose.enable"):
            call()


@torch.no_grad()
def test_enable_changes_nothing_without_past_states(model):
    fresh = tiny_model("falcon_mamba", seed=3)
    hsc.disable(fresh)
    ids = random_ids(12)
    torch.testing.assert_close(model(ids).logits, fresh(ids).logits, rtol=0, atol=0)
    assert torch.equal(
        model.generate(ids, max_new_tokens=NEW, do_sample=False),
        fresh.generate(ids, max_new_tokens=NEW, do_sample=False),
    )
