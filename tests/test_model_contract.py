"""The contract of this package's own causal LMs as transformers models, written once and run for SeRpEnt-Mamba
and COFFEE (its LM head and its core head): causality, padding, ragged batches, incremental == full forward,
generate() (greedy, padded, sampling, beams, several return sequences), copies, past_states refused until enabled.
What is each model's own (configs, SeRpEnt's compression, COFFEE's Newton solve and image classifier, the Hub
round trip) stays in test_serpent.py and test_coffee_model.py; their states: test_state_contract.py."""

import copy
import io
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from architectures import COFFEE_VOCAB, SERPENT_VOCAB, coffee_lm, serpent_lm
from helpers import load_saved, pickle_round_trip, relative_error


@dataclass(frozen=True)
class OwnModel:
    """``make()``: a tiny random model, not enabled; ``exact``: padding and later tokens leave earlier logits
    bit for bit (SeRpEnt), else to rounding (COFFEE's prefill is a Newton solve with one stopping rule for the
    whole batch: earlier logits may move by rounding when later tokens change, never more); ``echoes``: greedy
    decoding may repeat one token (the random core head)."""

    make: Callable[[], torch.nn.Module]
    vocab: int
    exact: bool = False
    echoes: bool = False


MODELS = {
    "serpent_mamba": OwnModel(serpent_lm, SERPENT_VOCAB, exact=True, echoes=True),
    "coffee_lm": OwnModel(coffee_lm, COFFEE_VOCAB),
    "coffee_core": OwnModel(lambda: coffee_lm(head="core", num_hidden_layers=1), COFFEE_VOCAB, echoes=True),
}
GENERATE = dict(pad_token_id=0, eos_token_id=None)  # fixed lengths


@pytest.fixture(scope="module", params=list(MODELS))
def own(request):
    return MODELS[request.param]


@pytest.fixture(scope="module")
def model(own):
    return own.make()


def ids_of(own, batch, length, seed=1):
    return torch.randint(3, own.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_same(own, actual, expected):
    assert torch.equal(actual, expected) if own.exact else relative_error(actual, expected) < 1e-5


# ------------------------------------------------------------------------------------------ causality, padding
@pytest.mark.parametrize("padded", [False, True])
@torch.no_grad()
def test_later_tokens_change_no_earlier_logit(own, model, padded):
    ids = ids_of(own, 3, 24)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
        mask[2, :9] = 0
    changed = ids.clone()
    p = 14
    changed[:, p + 1 :] = ids_of(own, 3, 24 - p - 1, seed=7)
    before, after = model(ids, attention_mask=mask).logits, model(changed, attention_mask=mask).logits
    assert_same(own, after[:, : p + 1], before[:, : p + 1])
    assert relative_error(after[:, p + 1 :], before[:, p + 1 :]) > 1e-3  # the perturbation does reach later tokens


@torch.no_grad()
def test_padding_content_is_ignored(own, model):
    ids = ids_of(own, 2, 16)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    other = ids.clone()
    other[0, :6] = ids_of(own, 1, 6, seed=3)
    assert_same(own, model(other, attention_mask=mask).logits[:, 6:], model(ids, attention_mask=mask).logits[:, 6:])


@torch.no_grad()
def test_ragged_batch_rows_equal_each_row_alone(own, model):
    ids = ids_of(own, 3, 20)
    lengths = [20, 13, 4]
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, -n:] = 1
    batched = model(ids, attention_mask=mask).logits
    for row, n in enumerate(lengths):
        assert relative_error(batched[row, -n:], model(ids[row : row + 1, -n:]).logits[0]) < 1e-5, row


# ------------------------------------------------------------------------------------------ incremental
@torch.no_grad()
def test_token_by_token_and_chunks_equal_the_full_forward(own, model):
    ids = ids_of(own, 2, 22)
    full = model(ids).logits
    cache, steps = None, []
    for t in range(ids.shape[1]):
        out = model(ids[:, t : t + 1], cache_params=cache, use_cache=True)
        cache, steps = out.cache_params, steps + [out.logits]
    first = model(ids[:, :9], use_cache=True)
    second = model(ids[:, 9:], cache_params=first.cache_params, use_cache=True)
    assert relative_error(torch.cat(steps, 1), full) < 1e-4
    assert relative_error(torch.cat([first.logits, second.logits], 1), full) < 1e-4
    assert cache.num_tokens.tolist() == [22, 22] and cache.architecture == model.config.model_type


@torch.no_grad()
def test_padded_prompt_then_tokens_equals_the_full_forward(own, model):
    ids = ids_of(own, 2, 18)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    full = model(ids, attention_mask=mask).logits
    prompt = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
    cache, steps = prompt.cache_params, []
    for t in range(10, 18):
        out = model(ids[:, t : t + 1], cache_params=cache, use_cache=True)
        cache, steps = out.cache_params, steps + [out.logits]
    assert relative_error(torch.cat(steps, 1), full[:, 10:]) < 1e-4
    assert cache.num_tokens.tolist() == [18, 11]


# ------------------------------------------------------------------------------------------ generate
@torch.no_grad()
def greedy_by_full_forwards(model, ids, new_tokens, mask=None):
    ids = ids.clone()
    for _ in range(new_tokens):
        step_mask = (
            None if mask is None else torch.cat([mask, mask.new_ones(len(ids), ids.shape[1] - mask.shape[1])], 1)
        )
        ids = torch.cat([ids, model(ids, attention_mask=step_mask).logits[:, -1].argmax(-1)[:, None]], 1)
    return ids


def test_generate_greedy_and_left_padded_batch(own, model):
    ids = ids_of(own, 2, 9)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **GENERATE)
    assert torch.equal(out, greedy_by_full_forwards(model, ids, 8, mask))
    alone = model.generate(ids[1:, 4:], max_new_tokens=8, do_sample=False, **GENERATE)
    assert torch.equal(out[1, 9:], alone[0, 5:])
    if not own.echoes:  # a real test: not one token repeated
        assert len(set(out[0, 9:].tolist())) > 1


def test_generate_sampling_is_the_full_forward_distribution(own, model):
    ids = ids_of(own, 1, 8)
    torch.manual_seed(3)
    out = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0, output_scores=True,
                         return_dict_in_generate=True, **GENERATE)  # fmt: skip
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, ids.shape[1] - 1 :]
    assert relative_error(torch.stack(out.scores, 1), full) < 1e-4


def test_generate_beams_and_return_sequences(own, model):
    ids = ids_of(own, 2, 7)
    beams = model.generate(ids, max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False,
                           output_scores=True, return_dict_in_generate=True, early_stopping=False, length_penalty=0.0,
                           **GENERATE)  # fmt: skip
    with torch.no_grad():  # every returned beam's score is its log-probability under full forwards
        logits = model(beams.sequences[:, :-1]).logits[:, ids.shape[1] - 1 :]
        tokens = beams.sequences[:, ids.shape[1] :]
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0].sum(-1)
    assert torch.allclose(beams.sequences_scores, logp, atol=1e-4)
    torch.manual_seed(4)
    sampled = model.generate(ids, max_new_tokens=5, do_sample=True, top_k=0, num_return_sequences=2,
                             output_scores=True, return_dict_in_generate=True, **GENERATE)  # fmt: skip
    assert sampled.sequences.shape[0] == 4 and torch.equal(sampled.sequences[1::2, :7], ids)
    with torch.no_grad():
        full = model(sampled.sequences[:, :-1]).logits[:, ids.shape[1] - 1 :]
    assert relative_error(torch.stack(sampled.scores, 1), full) < 1e-4


# ------------------------------------------------------------------------------------------ copies, enable
@torch.no_grad()
def test_model_survives_deepcopy_pickle_and_torch_save(own, model):
    ids = ids_of(own, 2, 10)
    expected = model(ids).logits
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    # the standard asks models to survive pickle / torch.save: these bytes are made here, never a user's file
    for clone in (copy.deepcopy(model), pickle_round_trip(model), load_saved(buffer)):
        assert torch.equal(clone(ids).logits, expected)


def test_past_states_are_refused_until_the_model_is_enabled(own, model):
    ids = ids_of(own, 1, 4)
    for call in (lambda: model(ids, past_states=[object()]), lambda: model.backbone(ids, past_states=[object()])):
        with pytest.raises(ValueError, match=r"past_states needs hf_statecompose\.enable"):
            call()
