"""The check-once verdict cannot be fooled (issue 41, F6): a state checked at its first use and then edited by a route
that no version counter sees (``.data``, a NumPy view, ``set_``, another tensor on the same storage, DLPack) is checked
again at its next use, and refused when the edit made it invalid; an unchanged state keeps its verdict (checked once).

Before this issue the verdict was keyed on version counters and storage addresses only: transitions edited to ~2
through ``.data`` were accepted by ``compose``, a NaN written into an SSM state through ``.numpy()`` gave NaN logits."""

from __future__ import annotations

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.state import validation

from architectures import hybrid_model, ids
from helpers import random_ids, tiny_model


def _nan_everywhere(t: torch.Tensor) -> None:
    t.fill_(float("nan"))


ROUTES = {
    # each: (the state's tensor) -> a tensor on its storage that no version counter of the state's tensor follows
    ".data": lambda t: t.data,
    "a NumPy view": lambda t: torch.from_numpy(t.detach().numpy()),
    "a tensor on the same storage": lambda t: torch.empty(0, dtype=t.dtype).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    ),
    "DLPack": lambda t: torch.from_dlpack(t.detach()),
}


@pytest.fixture(scope="module")
def mamba2():
    return tiny_model("mamba2")


@pytest.fixture(scope="module")
def qwen():
    return hybrid_model("qwen3_5_text", dtype=torch.float32)


def _generate(model, states):
    return model.generate(random_ids(3, generator=torch.Generator().manual_seed(5)), past_states=states,
                          max_new_tokens=3, do_sample=False)  # fmt: skip


@pytest.mark.parametrize("where", ["a sampled element", "an element the sample skips"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_nan_written_into_an_ssm_state_after_its_first_use_is_refused(route, where, mamba2, monkeypatch):
    """An SSM state is free-valued (any finite value is a state): its verdict compares a sample of its elements. A NaN
    written into a sampled one voids the verdict (the state is checked again: "layer 0 SSM state contains NaN"); one
    the sample skips is refused by the first forward's output check."""
    monkeypatch.setattr(validation, "DIGEST_SAMPLES", 64)  # the tiny state's 512 elements: every 8th sampled
    state = hsc.encode(mamba2, random_ids(8, generator=torch.Generator().manual_seed(1)))
    _generate(mamba2, [state])  # checked and remembered
    assert validation._verdict(state, validation._snapshot(state)) is not None
    version = state.ssm_states[0]._version
    alias = ROUTES[route](state.ssm_states[0])
    flat_index = 0 if where == "a sampled element" else 1  # the sample: every (numel // DIGEST_SAMPLES)-th from 0
    assert state.ssm_states[0].numel() // validation.DIGEST_SAMPLES > 1
    with torch.no_grad():
        alias.view(-1)[flat_index] = float("nan")  # one element, through the alias
    assert state.ssm_states[0]._version == version  # no counter saw it
    assert torch.isnan(state.ssm_states[0]).any()
    message = "SSM state contains NaN or inf" if where == "a sampled element" else "NaN or inf outputs"
    with pytest.raises(ValueError, match=message):
        _generate(mamba2, [state])


@pytest.mark.parametrize("route", list(ROUTES))
def test_transitions_edited_to_two_after_their_first_use_are_refused_by_compose(route, qwen):
    a, b = (hsc.encode(qwen, ids(8, seed=s)) for s in (1, 2))
    hsc.compose_states([a, b], "caso", model=qwen)  # checked and remembered
    with torch.no_grad():
        ROUTES[route](b.transitions[0]).fill_(2.0)
    with pytest.raises(ValueError, match="transition"):
        hsc.compose_states([a, b], "caso", model=qwen)


def test_set_on_a_checked_tensor_is_refused(mamba2):
    state = hsc.encode(mamba2, random_ids(8, generator=torch.Generator().manual_seed(1)))
    _generate(mamba2, [state])
    bad = state.ssm_states[0].detach().clone()
    bad[0, 0, 0, 0] = float("inf")
    with torch.no_grad():
        state.ssm_states[0].set_(bad)
    with pytest.raises(ValueError, match="NaN or inf"):
        _generate(mamba2, [state])


@pytest.mark.parametrize("route", [".data", "a NumPy view"])
def test_small_tensors_are_compared_exactly(route, mamba2):
    """ΣΔ (a small tensor: kept as a copy) made negative by one element through an alias is refused."""
    state = hsc.encode(mamba2, random_ids(8, generator=torch.Generator().manual_seed(1)))
    _generate(mamba2, [state])
    assert state.delta_sums[0].numel() <= validation.DIGEST_EXACT_NUMEL
    with torch.no_grad():
        ROUTES[route](state.delta_sums[0])[0, 0] = -1.0
    with pytest.raises(ValueError, match="negative"):
        _generate(mamba2, [state])


def test_one_element_of_a_large_tensor_moved_is_seen(qwen):
    """The digest of a large tensor changes with one element's edit, and with two elements swapped."""
    t = torch.randn(4, 4096 + 17, generator=torch.Generator().manual_seed(0))
    base = validation._content_digest(t)
    for index in [(0, 0), (3, 4096 + 16), (2, 100)]:
        edited = t.clone()
        edited[index] += 1e-3
        assert not torch.equal(validation._content_digest(edited), base)
    swapped = t.clone()
    swapped[0, 1], swapped[0, 2] = t[0, 2], t[0, 1]
    assert not torch.equal(validation._content_digest(swapped), base)
    rows = t.clone()
    rows[[0, 1]] = t[[1, 0]]
    assert not torch.equal(validation._content_digest(rows), base)
    assert torch.equal(validation._content_digest(t.clone()), base)


def test_an_unchanged_state_keeps_its_verdict(mamba2, monkeypatch):
    """Checked once: a reused, unchanged state is not checked again (check_state runs for the first use only)."""
    state = hsc.encode(mamba2, random_ids(8, generator=torch.Generator().manual_seed(1)))
    calls = []
    check = validation.check_state
    monkeypatch.setattr(validation, "check_state", lambda *a, **k: calls.append(1) or check(*a, **k))
    first = _generate(mamba2, [state])
    again = _generate(mamba2, [state])
    assert torch.equal(first, again) and len(calls) == 1
    with torch.no_grad():
        state.ssm_states[0].data[0, 0, 0, 0] += 1.0  # a valid edit: checked again, accepted
    _generate(mamba2, [state])
    assert len(calls) == 2
