"""A state whose finite values overflow the forward is refused at the first step (issue 41, F4): an Olmo-Hybrid state
filled with 3e38 (finite: it passes every value check) gave NaN logits without an error. The first forward from
composed states, or from a state handed to ``generate`` as its cache, now checks its output (one reduction)."""

from __future__ import annotations

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import compat
from hf_statecompose.generation import integration

from architectures import hybrid_model, ids


def _overflowing(model, query_ids):
    state = hsc.encode(model, query_ids)
    with torch.no_grad():
        for s in state.ssm_states:
            s.fill_(3e38)
    return state


@pytest.fixture(scope="module")
def olmo():
    return hybrid_model("olmo_hybrid", dtype=torch.float32)


def test_the_overflowing_state_gives_nan_logits_unchecked(olmo, monkeypatch):
    state = _overflowing(olmo, ids(6, seed=1))
    monkeypatch.setattr(integration, "check_output_finite", lambda out, cache: None)
    with torch.no_grad():
        logits = olmo(ids(3, seed=2), past_states=[state]).logits
    assert not torch.isfinite(logits).all()


@pytest.mark.parametrize("how", ["forward", "generate", "generate, the state as its cache"])
def test_an_overflowing_state_is_refused_at_the_first_step(how, olmo):
    state = _overflowing(olmo, ids(6, seed=1))
    query = ids(3, seed=2)
    with pytest.raises(ValueError, match="overflow this model's forward"):
        if how == "forward":
            olmo(query, past_states=[state])
        elif how == "generate":
            olmo.generate(query, past_states=[state], max_new_tokens=2, do_sample=False)
        else:
            mask = torch.ones(1, state.attention_layers[0].keys.shape[2] + query.shape[1], dtype=torch.long)
            name = compat.cache_parameter(type(olmo).forward) or compat.CACHE_ARG  # `cache` from 5.24
            olmo.generate(query, attention_mask=mask, max_new_tokens=2, do_sample=False, **{name: state})


def test_a_genuine_state_is_checked_at_the_first_step_only(olmo, monkeypatch):
    calls = []
    check = integration.check_output_finite
    monkeypatch.setattr(integration, "check_output_finite", lambda out, cache: calls.append(1) or check(out, cache))
    state = hsc.encode(olmo, ids(6, seed=1))
    olmo.generate(ids(3, seed=2), past_states=[state], max_new_tokens=4, do_sample=False)
    assert calls == [1]
