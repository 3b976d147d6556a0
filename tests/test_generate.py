"""generate(query, past_states=...) behaves like generate(context + query) for every decoding mode.

Each case first shows that the context changes the output: the first step's logits with the state differ
from those with its SSM states zeroed and from those without any context, by far more than the tolerance of
the comparison with context + query that follows (tokens identical, logits of every step within 1e-5)."""

import itertools

import pytest
import torch
from transformers import TextStreamer
from transformers.generation.streamers import BaseStreamer

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache

from helpers import random_ids, relative_error, tiny_model

NEW = 8
# The default tiny Mamba-1 hardly reads its SSM state (small B, C and Δ: zeroing the state moves its logits by
# ~4e-4 relative and changes no token; even no context at all gives the same greedy tokens), so a test of
# "generates from the context" would pass without it. A larger initialisation (B, C, embeddings: wider logits)
# and larger steps Δ make the state matter, for both architectures (zeroing it moves the first logits by 5-120%).
CONTEXT_MATTERS = dict(initializer_range=0.5, time_step_min=0.01, time_step_max=0.5)
EXACT = 1e-5  # relative logit error allowed against context + query (measured: below 1e-6)
MATTERS = 2e-2  # smallest relative change of the first logits that counts as "the context changes the output"


@pytest.fixture
def model(arch):
    model = tiny_model(arch, **CONTEXT_MATTERS)
    model.generation_config.eos_token_id = None  # fixed-length generations: rows and runs line up token for token
    return model


def _pair(model, context_length=19, query_length=5):
    context, query = random_ids(context_length), random_ids(query_length)
    return context, query, ComposableMambaCache.encode(model, context)


def _without_ssm_states(states):
    """The states (a list, or a list of lists) with every SSM state zeroed: conv windows, ΣΔ and counts kept."""
    if isinstance(states, list):
        return [_without_ssm_states(s) for s in states]
    zeroed = states.clone()
    for i in range(zeroed.num_layers):
        zeroed.ssm_states[i].zero_()
    return zeroed


def _generate(model, ids, past_states=None, seed=None, **kwargs):
    """(sequences, raw logits of every step [steps, rows, vocab]); ``seed`` seeds sampling just before."""
    if seed is not None:
        torch.manual_seed(seed)
    if past_states is not None:
        kwargs["past_states"] = past_states
    kwargs.setdefault("max_new_tokens", NEW)
    out = model.generate(ids, output_logits=True, return_dict_in_generate=True, **kwargs)
    return out.sequences, torch.stack(out.logits)


def _assert_context_matters(model, query, states, logits, **kwargs):
    """``logits`` (generating from ``states``) differ in the first step from generating with the SSM states
    zeroed and from generating without context: a broken or ignored state cannot pass the comparisons."""
    kwargs["max_new_tokens"] = 1  # the first step is all that is compared
    for name, past_states in (("SSM states zeroed", _without_ssm_states(states)), ("no context", None)):
        other = _generate(model, query, past_states, **kwargs)[1]
        assert relative_error(other[0], logits[0]) > MATTERS, name


def _assert_same_generation(actual, expected, context_length):
    """Token-identical to generating from context + query (without the context tokens), logits close."""
    (sequences, logits), (whole, whole_logits) = actual, expected
    assert torch.equal(sequences, whole[:, context_length:])
    assert logits.shape == whole_logits.shape and relative_error(logits, whole_logits) < EXACT


@pytest.mark.parametrize("query_length", [1, 6])
@torch.no_grad()
def test_greedy_equals_generate_on_concatenation(model, query_length):
    context, query, state = _pair(model, query_length=query_length)
    expected = _generate(model, torch.cat([context, query], 1), do_sample=False)
    out = _generate(model, query, [state], do_sample=False)
    _assert_context_matters(model, query, [state], out[1], do_sample=False)
    assert torch.equal(out[0][:, :query_length], query)  # the query as passed, never the context
    _assert_same_generation(out, expected, context.shape[1])


@torch.no_grad()
def test_sampling_equals_generate_on_concatenation(model):
    context, query, state = _pair(model)
    kwargs = dict(do_sample=True, top_k=0, seed=123)
    expected = _generate(model, torch.cat([context, query], 1), **kwargs)
    out = _generate(model, query, [state], **kwargs)
    _assert_context_matters(model, query, [state], out[1], **kwargs)
    _assert_same_generation(out, expected, context.shape[1])


@torch.no_grad()
def test_beam_search_and_return_sequences(model):
    context, query, state = _pair(model)
    kwargs = dict(num_beams=3, num_return_sequences=2, do_sample=False)
    expected = _generate(model, torch.cat([context, query], 1), **kwargs)
    out = _generate(model, query, [state], **kwargs)
    _assert_context_matters(model, query, [state], out[1], **kwargs)
    assert out[0].shape[0] == 2
    _assert_same_generation(out, expected, context.shape[1])


@torch.no_grad()
def test_sampled_return_sequences(model):
    context, query, state = _pair(model)
    kwargs = dict(do_sample=True, num_return_sequences=3, seed=5)
    expected = _generate(model, torch.cat([context, query], 1), **kwargs)
    out = _generate(model, query, [state], **kwargs)
    _assert_context_matters(model, query, [state], out[1], **kwargs)
    _assert_same_generation(out, expected, context.shape[1])


@torch.no_grad()
def test_rows_with_their_own_context_lists_and_padded_queries(model):
    contexts = [[random_ids(7), random_ids(12)], [random_ids(15)]]
    states = [[ComposableMambaCache.encode(model, c) for c in row] for row in contexts]
    queries = [random_ids(4)[0], random_ids(2)[0]]
    q_ids = torch.zeros(2, 4, dtype=torch.long)
    q_mask = torch.zeros(2, 4, dtype=torch.long)
    for r, q in enumerate(queries):
        q_ids[r, 4 - len(q) :], q_mask[r, 4 - len(q) :] = q, 1
    kwargs = dict(composition="caso", do_sample=False)
    out = _generate(model, q_ids, states, attention_mask=q_mask, **kwargs)
    _assert_context_matters(model, q_ids, states, out[1], attention_mask=q_mask, **kwargs)
    for r in range(2):
        single = _generate(model, queries[r][None], states[r], **kwargs)
        assert torch.equal(out[0][r, 4:], single[0][0, len(queries[r]) :])
        assert relative_error(out[1][:, r], single[1][:, 0]) < EXACT
        # each row reads its own contexts: the other row's give another first step
        other = _generate(model, queries[r][None], states[1 - r], max_new_tokens=1, **kwargs)[1][0]
        assert relative_error(other, single[1][0]) > MATTERS
    # row 1 has a single context: caso of one state is the state itself, so it matches the concatenation
    expected = _generate(model, torch.cat([contexts[1][0][0], queries[1]])[None], do_sample=False)
    _assert_same_generation((out[0][1:, 4 - 2 :], out[1][:, 1:]), expected, 15)


@torch.no_grad()
def test_shared_states_for_a_batch_of_queries(model):
    state = ComposableMambaCache.encode(model, random_ids(10))
    queries = random_ids(3, batch=2)
    out = _generate(model, queries, [state, state], max_new_tokens=4, do_sample=False)
    _assert_context_matters(model, queries, [state, state], out[1], max_new_tokens=4, do_sample=False)
    for r in range(2):
        single = _generate(model, queries[r : r + 1], [state, state], max_new_tokens=4, do_sample=False)
        assert torch.equal(out[0][r], single[0][0])
        assert relative_error(out[1][:, r], single[1][:, 0]) < EXACT


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
        query,
        past_states=[state],
        max_new_tokens=NEW,
        do_sample=False,
        streamer=streamer,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert streamer.chunks[0] == query[0].tolist() and streamer.chunks[-1] == "end"
    assert list(itertools.chain.from_iterable(streamer.chunks[1:-1])) == out.sequences[0, query.shape[1] :].tolist()
    assert len(out.scores) == NEW
    expected = model.generate(
        torch.cat([context, query], 1),
        max_new_tokens=NEW,
        do_sample=False,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert relative_error(out.scores[0], expected.scores[0]) < EXACT
    assert (
        relative_error(
            model.generate(
                query, max_new_tokens=1, do_sample=False, return_dict_in_generate=True, output_scores=True
            ).scores[0],
            out.scores[0],
        )
        > MATTERS
    )
    model.generate(query, past_states=[state], max_new_tokens=3, do_sample=False, streamer=TextStreamer(_Tokenizer()))
    assert capsys.readouterr().out.strip()


@torch.no_grad()
def test_generate_does_not_mutate_the_states(model):
    _context, query, state = _pair(model)
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
