"""One hybrid state + the query reproduces the context + the query (issue 22): forward logits, greedy, sampling, beam
search, several return sequences, left-padded batches of contexts and queries, per-row context lists, stopping.

The reference is always the stock model run on the concatenated ids (``generate(cat(context, query))[:,
len(context):]``), on tiny random float64 hybrids (Mamba layers + attention layers, :mod:`architectures`). Each test
first shows that the context changes the result (the query alone gives other logits / tokens), so that "equals the
concatenation" says the state carried the context. The states keep their SSM states in float32 (as transformers' own
cache does), so float64 models agree to about float32 rounding: relative error <= 3.1e-7 on the logits of a forward,
and on every generation step against the stock model's *prefill* of the generated sequence.

Against the stock model's own one-token steps the scores differ more for NemotronH and Zamba2 (up to 3.7e-6 and
2.3e-5 over 16 greedy steps, 3.7e-5 over 8 with a head whose Δ lies below ``time_step_min``; the others <= 2.4e-7): their stock one-token step (transformers 5.24,
``mamba2_selective_state_update``) skips the ``time_step_min`` clamp that their prefill applies, so the stock model's
decode disagrees with its own prefill by as much; the state-aware path clamps at every step, as the prefill does.
The generated tokens are the stock ones all the same.
"""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.state.architectures import architecture, has_transitions

from architectures import EOS, arch_params, hybrid_model, ids, left_pad
from helpers import relative_error

TOL64 = 1e-6  # relative, logits of a float64 model's forward (prefill) with past_states (measured <= 3.1e-7)
TOL_STEPS = 1e-4  # relative, scores against the stock one-token steps (measured <= 2.3e-5, Zamba2: module doc)
TOL32 = 1e-4  # relative, float32 models
# the delta-rule hybrids: transformers computes the gated delta rule in float32 even in a float64 model (by its chunked
# algorithm), and so does the state path, whose rounding differs: float32-level agreement (measured <= 1.2e-6)
TOL64_DELTA = 1e-5


def tol64(model) -> float:
    """TOL64, or TOL64_DELTA for a delta-rule hybrid (its recurrence runs in float32 in every dtype)."""
    return TOL64_DELTA if has_transitions(architecture(model.config.model_type)) else TOL64


@pytest.fixture(scope="module", params=arch_params())
def model(request):
    model = hybrid_model(request.param)
    model.generation_config.eos_token_id = None  # random tiny models: no early stop unless a test asks for it
    return model


def stock_continuation(model, context, query, **kwargs):
    """What the stock model generates after ``context + query`` (the new tokens only)."""
    full = torch.cat([context, query], 1)
    return model.generate(full, attention_mask=torch.ones_like(full), **kwargs)[:, full.shape[1] :]


def prefill_logits(model, sequences, start):
    """The stock model's logits for the tokens of ``sequences`` from ``start`` on, from one prefill of them all."""
    return model(sequences).logits[:, start - 1 : -1]


def state_continuation(model, states, query, **kwargs):
    return model.generate(query, past_states=states, **kwargs)[:, query.shape[1] :]


@torch.no_grad()
def test_forward_logits_equal_the_concatenation_float32(model):
    model32 = hybrid_model(model.config.model_type, dtype=torch.float32)
    context, query = ids(13, seed=1), ids(5, seed=2)
    expected = model32(torch.cat([context, query], 1)).logits[:, -5:]
    logits = model32(query, past_states=[hsc.encode(model32, context)]).logits
    assert relative_error(logits, expected) < TOL32


@torch.no_grad()
def test_greedy_generate_equals_the_concatenation(model):
    context, query = ids(11, seed=3), ids(4, seed=4)
    kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
    full = torch.cat([context, query], 1)
    expected = model.generate(full, **kwargs)
    alone = model.generate(query, **kwargs)
    assert relative_error(alone.scores[0], expected.scores[0]) > 1e-2  # the context matters
    ours = model.generate(query, past_states=[hsc.encode(model, context)], **kwargs)
    assert torch.equal(ours.sequences[:, query.shape[1] :], expected.sequences[:, full.shape[1] :])
    prefill = prefill_logits(model, expected.sequences, full.shape[1])
    for step, (a, e) in enumerate(zip(ours.scores, expected.scores)):
        assert relative_error(a, prefill[:, step]) < tol64(model), step
        assert relative_error(a, e) < TOL_STEPS, step


@pytest.mark.parametrize("arch", arch_params())
@torch.no_grad()
def test_generation_steps_with_a_head_below_time_step_min(arch):
    """One head per mixer whose Δ lies below the time-step floor (NemotronH / Zamba2 clamp it to ``time_step_min``):
    every step equals the stock prefill of the generated sequence, tightly, and the tokens the stock generate's."""
    model = hybrid_model(arch)
    model.generation_config.eos_token_id = None
    layout = architecture(arch)
    for block in model.model.layers:
        mixer = layout.mixer_of(block)
        if mixer is not None and hasattr(mixer, "dt_bias"):
            mixer.dt_bias[0] = -8.0
    context, query = ids(11, seed=5), ids(4, seed=6)
    kwargs = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_scores=True)
    full = torch.cat([context, query], 1)
    expected = model.generate(full, **kwargs)
    ours = model.generate(query, past_states=[hsc.encode(model, context)], **kwargs)
    assert torch.equal(ours.sequences[:, query.shape[1] :], expected.sequences[:, full.shape[1] :])
    prefill = prefill_logits(model, expected.sequences, full.shape[1])
    for step, a in enumerate(ours.scores):
        assert relative_error(a, prefill[:, step]) < tol64(model), step


@torch.no_grad()
def test_sampling_with_the_same_seed_equals_the_concatenation(model):
    context, query = ids(11, seed=5), ids(4, seed=6)
    state = hsc.encode(model, context)
    full = torch.cat([context, query], 1)
    kwargs = dict(
        max_new_tokens=10, do_sample=True, top_k=0, temperature=1.5, return_dict_in_generate=True, output_scores=True
    )
    for seed in (0, 1):
        torch.manual_seed(seed)
        expected = model.generate(full, **kwargs)
        torch.manual_seed(seed)
        ours = model.generate(query, past_states=[state], **kwargs)
        assert torch.equal(ours.sequences[:, query.shape[1] :], expected.sequences[:, full.shape[1] :]), seed
        for step, (a, e) in enumerate(zip(ours.scores, expected.scores)):
            assert relative_error(a, e) < TOL_STEPS, (seed, step)
    # the context matters: the distribution sampled from is another one without it (a tiny random model's samples
    # from a shared seed often coincide anyway, so the distributions are compared)
    torch.manual_seed(0)
    assert relative_error(model.generate(query, **kwargs).scores[0], expected.scores[0]) > 1e-2


@torch.no_grad()
def test_sampling_several_return_sequences_equals_the_concatenation(model):
    context, query = ids(11, seed=11), ids(4, seed=12)
    kwargs = dict(
        max_new_tokens=8,
        do_sample=True,
        top_k=0,
        temperature=1.5,
        num_return_sequences=2,
        return_dict_in_generate=True,
        output_scores=True,
    )
    full = torch.cat([context, query], 1)
    torch.manual_seed(3)
    expected = model.generate(full, **kwargs)
    new = expected.sequences[:, full.shape[1] :]
    assert new.shape[0] == 2 and not torch.equal(new[0], new[1])
    torch.manual_seed(3)
    ours = model.generate(query, past_states=[hsc.encode(model, context)], **kwargs)
    assert torch.equal(ours.sequences[:, query.shape[1] :], new)
    for step, (a, e) in enumerate(zip(ours.scores, expected.scores)):
        assert relative_error(a, e) < TOL_STEPS, step
    torch.manual_seed(3)
    assert relative_error(model.generate(query, **kwargs).scores[0], expected.scores[0]) > 1e-2  # the context matters


@torch.no_grad()
def test_left_padded_batch_of_contexts_and_queries(model):
    """A batch encode of left-padded contexts: each row's state (SSM layers, keys, positions) is that row's alone
    (padding inert), and with left-padded queries every row continues exactly as its own concatenation."""
    contexts = [ids(n, seed=20 + n)[0] for n in (5, 12, 8)]
    queries = [ids(n, seed=30 + n)[0] for n in (3, 1, 5)]
    context_ids, context_mask = left_pad(contexts)
    query_ids, query_mask = left_pad(queries)
    states = hsc.encode(model, context_ids, attention_mask=context_mask)
    assert states.num_tokens.tolist() == [5, 12, 8]
    # a delta-rule model's layers compute their recurrence in float32 (by chunks that a padded row aligns otherwise),
    # so what a later layer reads (its conv window, the keys) differs from the row alone by float32 rounding
    delta_rule = tol64(model) == TOL64_DELTA
    tol = dict(rtol=1e-5, atol=1e-6) if delta_rule else dict(rtol=1e-6, atol=1e-7)
    for r, context in enumerate(contexts):
        alone, row = hsc.encode(model, context[None]), states.select(r)
        for v in range(alone.num_layers):
            torch.testing.assert_close(row.ssm_states[v], alone.ssm_states[v], **tol)
            torch.testing.assert_close(row.conv_states[v], alone.conv_states[v], **tol)
            torch.testing.assert_close(row.delta_sums[v], alone.delta_sums[v], **tol)
        real = row.key_mask[0]
        assert int(real.sum()) == len(context) and bool(real[-len(context) :].all())
        key_tol = 1e-6 if delta_rule else 1e-9
        for got, want in zip(row.attention_layers, alone.attention_layers):
            assert torch.equal(got.positions[:, real], want.positions)
            torch.testing.assert_close(got.keys[:, :, real], want.keys, rtol=key_tol, atol=key_tol)
            torch.testing.assert_close(got.values[:, :, real], want.values, rtol=key_tol, atol=key_tol)
    logits = model(query_ids, attention_mask=query_mask, past_states=[states]).logits
    generated = model.generate(
        query_ids, attention_mask=query_mask, past_states=[states], max_new_tokens=6, do_sample=False
    )[:, query_ids.shape[1] :]
    for r, (context, query) in enumerate(zip(contexts, queries)):
        expected = model(torch.cat([context, query])[None]).logits[0, -len(query) :]
        assert relative_error(logits[r, -len(query) :], expected) < tol64(model), r
        assert relative_error(model(query[None]).logits[0], expected) > 1e-2  # the context matters
        assert torch.equal(
            generated[r], stock_continuation(model, context[None], query[None], max_new_tokens=6, do_sample=False)[0]
        ), r


@torch.no_grad()
def test_per_row_context_lists(model):
    """``past_states=[[s1], [s2, s3]]``: row 0 is its own single-state run (= its concatenation), row 1 its own
    two-state composition; the rows' keys have different lengths (the stacked state pads them)."""
    c1, c2, c3 = ids(10, seed=41), ids(4, seed=42), ids(7, seed=43)
    s1, s2, s3 = (hsc.encode(model, c) for c in (c1, c2, c3))
    q0, q1 = ids(3, seed=44)[0], ids(5, seed=45)[0]
    query_ids, query_mask = left_pad([q0, q1])
    logits = model(query_ids, attention_mask=query_mask, past_states=[[s1], [s2, s3]]).logits
    row0 = model(q0[None], past_states=[s1]).logits[0]
    assert relative_error(logits[0, -3:], row0) < tol64(model)
    expected0 = model(torch.cat([c1[0], q0])[None]).logits[0, -3:]
    assert relative_error(row0, expected0) < tol64(model)
    assert relative_error(model(q0[None], past_states=[s2, s3]).logits[0], expected0) > 1e-2  # the context matters
    assert relative_error(logits[1], model(q1[None], past_states=[s2, s3]).logits[0]) < tol64(model)
    generated = model.generate(
        query_ids, attention_mask=query_mask, past_states=[[s1], [s2, s3]], max_new_tokens=6, do_sample=False
    )[:, query_ids.shape[1] :]
    assert torch.equal(generated[0], stock_continuation(model, c1, q0[None], max_new_tokens=6, do_sample=False)[0])
    assert torch.equal(
        generated[1], state_continuation(model, [s2, s3], q1[None], max_new_tokens=6, do_sample=False)[0]
    )


@torch.no_grad()
def test_max_new_tokens_and_eos_stop_as_the_concatenation(model):
    context, query = ids(11, seed=51), ids(4, seed=52)
    state = hsc.encode(model, context)
    for n in (1, 5):
        expected = stock_continuation(model, context, query, max_new_tokens=n, do_sample=False)
        assert expected.shape[1] == n
        assert torch.equal(state_continuation(model, [state], query, max_new_tokens=n, do_sample=False), expected)
    free = stock_continuation(model, context, query, max_new_tokens=10, do_sample=False)[0].tolist()
    # an eos that greedy decoding reaches after a few tokens (first seen at step `stop`)
    stop = next(i for i in range(2, len(free)) if free[i] not in free[:i] and free[i] != EOS)
    eos = free[stop]
    expected = stock_continuation(model, context, query, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    assert expected.shape[1] == stop + 1 and int(expected[0, -1]) == eos
    ours = state_continuation(model, [state], query, max_new_tokens=10, do_sample=False, eos_token_id=eos)
    assert torch.equal(ours, expected)
    # a batch where one row stops first: the other row goes on, the stopped one is padded (as stock generate pads)
    query_ids, query_mask = left_pad([query[0], ids(2, seed=53)[0]])
    expected = [
        stock_continuation(model, context, q[None], max_new_tokens=10, do_sample=False, eos_token_id=eos)[0]
        for q in (query[0], ids(2, seed=53)[0])
    ]
    ours = model.generate(
        query_ids, attention_mask=query_mask, past_states=[state], max_new_tokens=10, do_sample=False, eos_token_id=eos
    )[:, query_ids.shape[1] :]
    for r, want in enumerate(expected):
        assert torch.equal(ours[r, : len(want)], want), r
        assert bool((ours[r, len(want) :] == model.generation_config.pad_token_id).all()), r
