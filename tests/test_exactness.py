"""Mamba / Mamba-2 maths: CASO equals the concatenated state where it must (one layer, no conv window) and not
otherwise, encode equals transformers' states, the log decay is the context's. (One state + query = context +
query, for every architecture: test_state_contract.py.)"""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache

from helpers import random_ids, relative_error, tiny_model


@pytest.mark.parametrize("arch_", ["mamba", "mamba2"])
@torch.no_grad()
def test_caso_equals_concatenation_for_one_layer_without_conv_leakage(arch_):
    model = tiny_model(arch_, layers=1, conv_kernel=1)
    contexts = [random_ids(n) for n in (9, 4, 13)]
    states = [ComposableMambaCache.encode(model, c) for c in contexts]
    concatenated = ComposableMambaCache.encode(model, torch.cat(contexts, 1))
    composed = hsc.StateComposer("caso").compose(states)
    torch.testing.assert_close(composed.ssm_states[0], concatenated.ssm_states[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(composed.log_decay(0), concatenated.log_decay(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(composed.conv_states[0], concatenated.conv_states[0])
    # and so the continuation is the continuation of the concatenation
    query = random_ids(6)
    expected = model(torch.cat(contexts + [query], 1)).logits[:, -6:]
    assert relative_error(model(query, past_states=states, composition="caso").logits, expected) < 1e-4
    # the model-based concat baseline is the same thing by construction
    via_concat = hsc.StateComposer("concat").compose(states, model=model)
    torch.testing.assert_close(via_concat.ssm_states[0], concatenated.ssm_states[0])


@torch.no_grad()
def test_conv_leakage_is_real_with_a_conv_window(arch):
    """With conv_kernel > 1, independently encoded states are not the concatenated one (hf_statecompose/ops/compose/README.md): the
    test above is exact because of conv_kernel=1, not because the comparison is loose."""
    model = tiny_model(arch, layers=1, conv_kernel=4)
    contexts = [random_ids(n) for n in (9, 13)]
    states = [ComposableMambaCache.encode(model, c) for c in contexts]
    concatenated = ComposableMambaCache.encode(model, torch.cat(contexts, 1))
    composed = hsc.StateComposer("caso").compose(states)
    assert relative_error(composed.ssm_states[0], concatenated.ssm_states[0]) > 1e-3


@torch.no_grad()
def test_encode_matches_transformers_states(model):
    """The states we encode are the states stock transformers computes for the same prefill."""
    ids = random_ids(37)
    stock = model(ids, use_cache=True).cache_params
    ours = ComposableMambaCache.encode(model, ids)
    for i in range(ours.num_layers):
        torch.testing.assert_close(
            ours.ssm_states[i], stock.layers[i].recurrent_states[0].float(), rtol=1e-4, atol=1e-5
        )
        torch.testing.assert_close(ours.conv_states[i], stock.layers[i].conv_states[0], rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_log_decay_is_the_decay_of_the_context(model):
    """Running zero input through the decay gives exactly exp(log_decay) ⊙ h0: check via the composition
    identity x(c1 + c2) = a(c2) ⊙ x(c1) + x(c2) on a 1-layer, conv_kernel=1 model."""
    m = tiny_model(model.config.model_type, layers=1, conv_kernel=1)
    c1, c2 = random_ids(7), random_ids(5)
    s1, s2 = ComposableMambaCache.encode(m, c1), ComposableMambaCache.encode(m, c2)
    both = ComposableMambaCache.encode(m, torch.cat([c1, c2], 1))
    expected = torch.exp(s2.log_decay(0)) * s1.ssm_states[0] + s2.ssm_states[0]
    torch.testing.assert_close(both.ssm_states[0], expected, rtol=1e-5, atol=1e-6)
    assert torch.broadcast_shapes(s1.log_decay(0).shape, s1.ssm_states[0].shape) == s1.ssm_states[0].shape
