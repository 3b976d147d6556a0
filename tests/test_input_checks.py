"""Input checks at the boundary: contexts and queries whose padding cannot be told from tokens without a mask are
refused (never a silently wrong state)."""
import pytest
import torch

import hf_statecompose as hsc
from helpers import random_ids, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("mamba2")  # pad 0, eos 1, bos 2: a pad token of its own


@pytest.fixture(scope="module")
def shared_pad_model():
    """pad = eos = 0 (as the demo tokenizer and GPT-NeoX Mamba checkpoints have it)."""
    model = tiny_model("mamba")
    model.config.pad_token_id = model.config.eos_token_id = 0
    model.generation_config.pad_token_id = model.generation_config.eos_token_id = 0
    return model


def left_padded(rows, pad=0):
    """Rows of different lengths, left padded with ``pad``; and their mask."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, length - len(r):] = r
        mask[i, length - len(r):] = 1
    return ids, mask


def same_state(a, b):
    close = all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a.ssm_states, b.ssm_states))
    return close and torch.equal(a.num_tokens, b.num_tokens)


# ------------------------------------------------------------------------------------------ encode: unmasked padding
@pytest.mark.parametrize("fixture", ["model", "shared_pad_model"])
def test_encode_refuses_a_left_padded_batch_without_its_mask(fixture, request):
    model = request.getfixturevalue(fixture)
    ids, mask = left_padded([random_ids(6)[0], random_ids(3)[0]])
    with pytest.raises(ValueError, match=r"pad token id 0.*no attention_mask was given.*attention_mask"):
        hsc.encode(model, ids)
    state = hsc.encode(model, ids, attention_mask=mask)  # with the mask: each row as encoded alone
    assert same_state(state.select([1]), hsc.encode(model, ids[1:, 3:]))


def test_encode_refuses_a_right_padded_batch_without_its_mask(shared_pad_model):
    ids = torch.cat([random_ids(5), torch.cat([random_ids(3), torch.zeros(1, 2, dtype=torch.long)], 1)])
    with pytest.raises(ValueError, match=r"look right padded.*padding_side = 'left'"):
        hsc.encode(shared_pad_model, ids)


def test_encode_without_mask_keeps_unpadded_contexts(shared_pad_model, model):
    """Batches whose rows start and end alike (or a single context) are not padding; nor is anything when the
    config has no pad token; an explicit all-ones mask says a pad id is a real token."""
    ids = random_ids(6, batch=2)
    hsc.encode(model, ids)
    eos_at_end = torch.cat([random_ids(5, batch=2), torch.zeros(2, 1, dtype=torch.long)], 1)  # pad = eos = 0
    hsc.encode(shared_pad_model, eos_at_end)
    hsc.encode(shared_pad_model, eos_at_end[:1])
    with_pad = torch.cat([random_ids(4), torch.zeros(1, 1, dtype=torch.long), random_ids(2)], 1)
    with pytest.raises(ValueError, match=r"row 0 contains the pad token id 0.*torch.ones_like"):
        hsc.encode(model, with_pad)
    hsc.encode(model, with_pad, attention_mask=torch.ones_like(with_pad))
    no_pad = tiny_model("mamba2")
    no_pad.config.pad_token_id = None
    hsc.encode(no_pad, with_pad)


# ------------------------------------------------------------------------------------------ generate: pad == eos
def test_generate_refuses_a_right_padded_query_without_mask_when_pad_is_eos(shared_pad_model):
    model = shared_pad_model
    state = hsc.encode(model, random_ids(6))
    query = torch.cat([random_ids(3), torch.zeros(1, 2, dtype=torch.long)], 1)  # real tokens, then pad = eos
    with pytest.raises(ValueError, match=r"query row 0 ends with token 0, which is both pad_token_id and eos_token_id"):
        model.generate(query, past_states=[state], max_new_tokens=2, do_sample=False)
    batch = torch.cat([random_ids(5), query])
    with pytest.raises(ValueError, match=r"query row 1 ends with token 0"):
        model.generate(batch, past_states=[state], max_new_tokens=2, do_sample=False)


def test_generate_refuses_a_left_padded_query_without_mask_when_pad_is_eos(shared_pad_model):
    model = shared_pad_model
    state = hsc.encode(model, random_ids(6))
    ids, mask = left_padded([random_ids(5)[0], random_ids(3)[0]])
    with pytest.raises(ValueError, match=r"looks left padded.*Pass attention_mask"):
        model.generate(ids, past_states=[state], max_new_tokens=2, do_sample=False)
    out = model.generate(ids, attention_mask=mask, past_states=[state], max_new_tokens=2, do_sample=False)
    alone = model.generate(ids[1:, 2:], past_states=[state], max_new_tokens=2, do_sample=False)
    assert torch.equal(out[1, -2:], alone[0, -2:])


def test_generate_keeps_legitimate_queries_when_pad_is_eos(shared_pad_model):
    model = shared_pad_model
    state = hsc.encode(model, random_ids(6))
    query = random_ids(4, batch=2)  # all real tokens
    out = model.generate(query, past_states=[state], max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)
    bos_only = torch.zeros(1, 1, dtype=torch.long)  # a query of just the bos / eos token (= pad)
    out = model.generate(bos_only, past_states=[state], max_new_tokens=2, min_new_tokens=2, do_sample=False)
    assert out.shape == (1, 3)
