"""generate(query, past_states=...) behaves like generate(context + query) for every decoding mode."""
import pytest
import torch
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache

from helpers import random_ids, relative_error, tiny_model

NEW = 8


def _pair(model, context_length=19, query_length=5):
    context, query = random_ids(context_length), random_ids(query_length)
    return context, query, ComposableMambaCache.encode(model, context)


@pytest.mark.parametrize("query_length", [1, 6])
@torch.no_grad()
def test_greedy_equals_generate_on_concatenation(model, query_length):
    context, query, state = _pair(model, query_length=query_length)
    expected = model.generate(torch.cat([context, query], 1), max_new_tokens=NEW, do_sample=False)
    out = model.generate(query, past_states=[state], max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out[:, :query_length], query)  # the query as passed, never the context
    assert torch.equal(out, expected[:, context.shape[1]:])


@torch.no_grad()
def test_sampling_equals_generate_on_concatenation(model):
    context, query, state = _pair(model)
    torch.manual_seed(123)
    expected = model.generate(torch.cat([context, query], 1), max_new_tokens=NEW, do_sample=True, top_k=0)
    torch.manual_seed(123)
    out = model.generate(query, past_states=[state], max_new_tokens=NEW, do_sample=True, top_k=0)
    assert torch.equal(out, expected[:, context.shape[1]:])


@torch.no_grad()
def test_beam_search_and_return_sequences(model):
    context, query, state = _pair(model)
    kwargs = dict(max_new_tokens=NEW, num_beams=3, num_return_sequences=2, do_sample=False)
    expected = model.generate(torch.cat([context, query], 1), **kwargs)
    out = model.generate(query, past_states=[state], **kwargs)
    assert out.shape[0] == 2
    assert torch.equal(out, expected[:, context.shape[1]:])


@torch.no_grad()
def test_sampled_return_sequences(model):
    context, query, state = _pair(model)
    torch.manual_seed(5)
    expected = model.generate(torch.cat([context, query], 1), max_new_tokens=NEW, do_sample=True, num_return_sequences=3)
    torch.manual_seed(5)
    out = model.generate(query, past_states=[state], max_new_tokens=NEW, do_sample=True, num_return_sequences=3)
    assert torch.equal(out, expected[:, context.shape[1]:])


@torch.no_grad()
def test_rows_with_their_own_context_lists_and_padded_queries(model):
    contexts = [[random_ids(7), random_ids(12)], [random_ids(15)]]
    states = [[ComposableMambaCache.encode(model, c) for c in row] for row in contexts]
    queries = [random_ids(4)[0], random_ids(2)[0]]
    q_ids = torch.zeros(2, 4, dtype=torch.long)
    q_mask = torch.zeros(2, 4, dtype=torch.long)
    for r, q in enumerate(queries):
        q_ids[r, 4 - len(q):], q_mask[r, 4 - len(q):] = q, 1
    out = model.generate(q_ids, attention_mask=q_mask, past_states=states, composition="caso", max_new_tokens=NEW, do_sample=False)
    for r in range(2):
        single = model.generate(
            queries[r][None], past_states=states[r], composition="caso", max_new_tokens=NEW, do_sample=False
        )
        assert torch.equal(out[r, 4:], single[0, len(queries[r]):])
    # row 1 has a single context: caso of one state is the state itself, so it matches the concatenation
    expected = model.generate(torch.cat([contexts[1][0][0], queries[1]])[None], max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out[1, 4:], expected[0, 15 + 2:])


@torch.no_grad()
def test_shared_states_for_a_batch_of_queries(model):
    state = ComposableMambaCache.encode(model, random_ids(10))
    queries = random_ids(3, batch=2)
    out = model.generate(queries, past_states=[state, state], max_new_tokens=4, do_sample=False)
    for r in range(2):
        single = model.generate(queries[r : r + 1], past_states=[state, state], max_new_tokens=4, do_sample=False)
        assert torch.equal(out[r], single[0])


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.flatten().tolist())

    def end(self):
        self.chunks.append("end")


class _Tokenizer:
    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)


@torch.no_grad()
def test_streamers_and_return_dict(model, capsys):
    context, query, state = _pair(model)
    streamer = _Collect()
    out = model.generate(
        query, past_states=[state], max_new_tokens=NEW, do_sample=False, streamer=streamer,
        return_dict_in_generate=True, output_scores=True,
    )
    assert streamer.chunks[0] == query[0].tolist() and streamer.chunks[-1] == "end"
    assert sum(streamer.chunks[1:-1], []) == out.sequences[0, query.shape[1]:].tolist()
    assert len(out.scores) == NEW
    expected = model.generate(
        torch.cat([context, query], 1), max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_scores=True
    )
    assert relative_error(out.scores[0], expected.scores[0]) < 1e-4
    model.generate(query, past_states=[state], max_new_tokens=3, do_sample=False, streamer=TextStreamer(_Tokenizer()))
    assert capsys.readouterr().out.strip()


@torch.no_grad()
def test_generate_does_not_mutate_the_states(model):
    context, query, state = _pair(model)
    before = state.clone()
    model.generate(query, past_states=[state, state], max_new_tokens=NEW, do_sample=False)
    for i in range(state.num_layers):
        assert torch.equal(state.ssm_states[i], before.ssm_states[i])
        assert torch.equal(state.conv_states[i], before.conv_states[i])


@torch.no_grad()
def test_enable_changes_nothing_without_past_states(arch):
    plain = tiny_model(arch)
    hsc.disable(plain)
    enabled = hsc.enable(hsc.enable(tiny_model(arch)))  # idempotent
    ids = random_ids(11, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    assert torch.equal(plain(ids, attention_mask=mask).logits, enabled(ids, attention_mask=mask).logits)
    a = plain.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    b = enabled.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(a, b)
    assert type(enabled.backbone.layers[0].mixer).__name__.startswith("Composable")
    assert hsc.is_enabled(enabled) and not hsc.is_enabled(plain)


def test_loss_with_past_states_trains_through_the_composition(model):
    """forward(..., labels=) returns the loss, and it is differentiable w.r.t. the states (BPTC)."""
    states = [ComposableMambaCache.encode(model, random_ids(n)) for n in (6, 9)]
    leaf = states[0].ssm_states[0].clone().requires_grad_(True)
    states[0].layers[0].ssm_state = leaf
    ids = random_ids(7)
    out = model(ids, past_states=states, composition="picaso_s", labels=ids)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0
    assert model.backbone.layers[0].mixer.in_proj.weight.grad is not None
