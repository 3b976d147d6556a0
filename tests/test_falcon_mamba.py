"""FalconMamba (transformers' ``falcon_mamba``: Mamba-1 with weightless RMS norms on Δ, B and C).

Its stock mixer, like Mamba-1's, ignores a cached SSM state for inputs longer than one token; ``enable`` runs
our initial-state path instead (the norms applied as the mixer applies them). Every claim is checked on logits
or scores, after first showing that the context changes them on this tiny random model."""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache
from hf_statecompose.ops.compose.reference import compose_ssm_ref

from helpers import random_ids, relative_error, tiny_model

NEW = 6


@pytest.fixture(scope="module")
def model():
    return tiny_model("falcon_mamba", seed=3)


def _scores(model, ids, **kwargs):
    out = model.generate(
        ids, max_new_tokens=NEW, do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs
    )
    return out.sequences, torch.stack(out.scores, 1)  # [B, NEW, vocab]


@torch.no_grad()
def test_the_mixer_is_falcons_and_the_context_matters(model):
    mixer = model.backbone.layers[0].mixer
    assert type(mixer).__name__ == "ComposableFalconMambaMixer" and mixer.dt_layernorm is not None
    context, query = random_ids(21), random_ids(5)
    with_context = model(torch.cat([context, query], 1)).logits[:, -5:]
    alone = model(query).logits
    assert relative_error(alone, with_context) > 1e-2  # else the exactness tests below would prove nothing


@pytest.mark.parametrize("query_length", [1, 2, 9, 30])
@torch.no_grad()
def test_one_state_reproduces_context_plus_query(model, query_length):
    context, query = random_ids(23), random_ids(query_length)
    expected = model(torch.cat([context, query], 1)).logits[:, -query_length:]
    state = hsc.encode(model, context)
    assert state.architecture == "falcon_mamba" and state.num_tokens.tolist() == [23]
    for method in ("picaso_r", "picaso_s", "soup", "caso", "concat"):
        logits = model(query, past_states=[state], composition=method).logits
        assert relative_error(logits, expected) < 1e-4, method


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


@torch.no_grad()
def test_generate_greedy_sampling_beams_and_return_sequences(model):
    context, query = random_ids(19), random_ids(4)
    full = torch.cat([context, query], 1)
    state = hsc.encode(model, context)
    tokens, scores = _scores(model, query, past_states=[state])
    expected_tokens, expected_scores = _scores(model, full)
    _, no_context = _scores(model, query)
    assert relative_error(no_context, expected_scores) > 1e-2
    assert relative_error(scores, expected_scores) < 1e-4
    assert torch.equal(tokens, expected_tokens[:, context.shape[1] :])
    torch.manual_seed(7)
    sampled = model.generate(full, max_new_tokens=NEW, do_sample=True, top_k=0, num_return_sequences=3)
    torch.manual_seed(7)
    ours = model.generate(
        query, past_states=[state], max_new_tokens=NEW, do_sample=True, top_k=0, num_return_sequences=3
    )
    assert torch.equal(ours, sampled[:, context.shape[1] :])
    beams = dict(
        max_new_tokens=NEW,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    expected = model.generate(full, **beams)
    out = model.generate(query, past_states=[state], **beams)
    assert torch.equal(out.sequences, expected.sequences[:, context.shape[1] :])
    torch.testing.assert_close(out.sequences_scores, expected.sequences_scores, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_left_padded_batches_and_per_row_contexts(model):
    contexts = [random_ids(n)[0] for n in (5, 16, 11)]
    queries = [random_ids(n)[0] for n in (3, 1, 6)]
    wc, wq = max(map(len, contexts)), max(map(len, queries))
    ids, mask = torch.zeros(3, wc, dtype=torch.long), torch.zeros(3, wc, dtype=torch.long)
    q_ids, q_mask = torch.zeros(3, wq, dtype=torch.long), torch.zeros(3, wq, dtype=torch.long)
    for r, (c, q) in enumerate(zip(contexts, queries)):
        ids[r, wc - len(c) :], mask[r, wc - len(c) :] = c, 1
        q_ids[r, wq - len(q) :], q_mask[r, wq - len(q) :] = q, 1
    states = hsc.encode(model, ids, attention_mask=mask)
    _, scores = _scores(model, q_ids, attention_mask=q_mask, past_states=[states])
    per_row = [[hsc.encode(model, c[None])] for c in contexts]
    _, per_row_scores = _scores(model, q_ids, attention_mask=q_mask, past_states=per_row)
    for r, (c, q) in enumerate(zip(contexts, queries)):
        _, expected = _scores(model, torch.cat([c, q])[None])
        assert relative_error(scores[r], expected[0]) < 1e-4, r
        assert relative_error(per_row_scores[r], expected[0]) < 1e-4, r


@pytest.mark.parametrize("method", ["soup", "caso", "picaso_s", "picaso_r"])
@torch.no_grad()
def test_composition_equals_the_float64_reference(model, method):
    states = [hsc.encode(model, random_ids(n)) for n in (7, 13, 4, 10)]
    composed = hsc.StateComposer(method).compose(states)
    for i in range(composed.num_layers):
        expected = compose_ssm_ref(
            [s.ssm_states[i].double() for s in states],
            torch.stack([s.delta_sums[i] for s in states]).double(),
            states[0].A[i].double(),
            method,
        )
        torch.testing.assert_close(composed.ssm_states[i].double(), expected, rtol=1e-5, atol=1e-7)
    # and the composed state differs from each input: composition did something
    assert all(relative_error(composed.ssm_states[0], s.ssm_states[0]) > 1e-3 for s in states)


def test_never_enabled_falcon_mamba_refuses_past_states():
    model = tiny_model("falcon_mamba", seed=3)
    state = hsc.encode(model, random_ids(8))
    hsc.disable(model)
    query = random_ids(3)
    for call in (lambda: model(query, past_states=[state]), lambda: model.generate(query, past_states=[state])):
        with pytest.raises(ValueError, match=r"past_states needs hf_statecompose.enable"):
            call()


@torch.no_grad()
def test_enable_changes_nothing_without_past_states_and_states_round_trip(model, tmp_path):
    fresh = tiny_model("falcon_mamba", seed=3)
    hsc.disable(fresh)
    ids = random_ids(12)
    torch.testing.assert_close(model(ids).logits, fresh(ids).logits, rtol=0, atol=0)
    assert torch.equal(
        model.generate(ids, max_new_tokens=NEW, do_sample=False),
        fresh.generate(ids, max_new_tokens=NEW, do_sample=False),
    )
    state = hsc.encode(model, random_ids(9))
    state.save(tmp_path / "falcon.safetensors")
    loaded = ComposableMambaCache.load(tmp_path / "falcon.safetensors", model=model)
    assert loaded.architecture == "falcon_mamba"
    for i in range(state.num_layers):
        assert torch.equal(loaded.ssm_states[i], state.ssm_states[i])
        assert torch.equal(loaded.delta_sums[i], state.delta_sums[i])
    mamba = tiny_model("mamba", seed=3)  # same shapes, another architecture: refused
    with pytest.raises(ValueError, match=r"falcon_mamba|fingerprint|encoded by"):
        ComposableMambaCache.load(tmp_path / "falcon.safetensors", model=mamba)
