"""The query of a past_states call: bad shapes and bad masks are refused with the fix; inputs_embeds works."""

import pytest
import torch

from hf_statecompose import ComposableMambaCache

from helpers import random_ids, tiny_model


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("mamba2", layers=1)
    return model, [ComposableMambaCache.encode(model, random_ids(7))]


def _call(kind, model, states, **kwargs):
    if kind == "forward":
        return model(past_states=states, **kwargs)
    return model.generate(past_states=states, max_new_tokens=2, do_sample=False, **kwargs)


BAD_MASKS = {
    "right padded": ([[1, 1, 1, 1], [1, 1, 0, 0]], "left padding"),
    "hole": ([[1, 1, 1, 1], [1, 0, 1, 1]], "left padding"),
    "all padding": ([[1, 1, 1, 1], [0, 0, 0, 0]], "all padding"),
    "value 2": ([[1, 1, 1, 1], [0, 1, 2, 1]], "only 0"),
    "value 0.5": ([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.5, 1.0]], "only 0"),
    "too long": ([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], "shape"),
    "one row": ([[1, 1, 1, 1]], "shape"),
    "1-D": ([1, 1, 1, 1], "shape"),
}


@pytest.mark.parametrize("kind", ["forward", "generate"])
@pytest.mark.parametrize("case", list(BAD_MASKS))
@torch.no_grad()
def test_bad_masks_are_refused(setup, kind, case):
    model, states = setup
    values, message = BAD_MASKS[case]
    with pytest.raises(ValueError, match=message):
        _call(kind, model, states, input_ids=random_ids(4, batch=2), attention_mask=torch.tensor(values))


@pytest.mark.parametrize("kind", ["forward", "generate"])
@torch.no_grad()
def test_a_mask_that_is_not_a_tensor_is_refused(setup, kind):
    model, states = setup
    with pytest.raises(TypeError, match="attention_mask must be a tensor"):
        _call(kind, model, states, input_ids=random_ids(4, batch=2), attention_mask=[[1, 1, 1, 1], [0, 1, 1, 1]])


@pytest.mark.parametrize("kind", ["forward", "generate"])
@torch.no_grad()
def test_bool_and_float_masks_mean_the_same_as_long(setup, kind):
    model, states = setup
    ids = random_ids(4, batch=2)
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    expected = _call(kind, model, states, input_ids=ids, attention_mask=mask)
    for other in (mask.bool(), mask.float()):
        out = _call(kind, model, states, input_ids=ids, attention_mask=other)
        if kind == "forward":
            assert torch.equal(out.logits, expected.logits)
        else:
            assert torch.equal(out, expected)


BAD_QUERIES = {
    "empty": (lambda: torch.zeros(1, 0, dtype=torch.long), ValueError, "query is empty"),
    "no rows": (lambda: torch.zeros(0, 3, dtype=torch.long), ValueError, "batch is empty"),
    "1-D": (lambda: random_ids(4)[0], ValueError, r"input_ids\[None\]"),
    "3-D": (lambda: random_ids(4)[None], ValueError, r"\[batch, length\]"),
    "float ids": (lambda: random_ids(4).float(), TypeError, "token ids"),
    "a list": (lambda: [5, 6, 7], TypeError, "token ids"),
}


@pytest.mark.parametrize("kind", ["forward", "generate"])
@pytest.mark.parametrize("case", list(BAD_QUERIES))
@torch.no_grad()
def test_bad_queries_are_refused(setup, kind, case):
    model, states = setup
    make, error, message = BAD_QUERIES[case]
    with pytest.raises(error, match=message):
        _call(kind, model, states, input_ids=make())


@torch.no_grad()
def test_no_query_at_all_is_refused(setup):
    model, states = setup
    with pytest.raises(ValueError, match="past_states needs the query"):
        model(past_states=states)


@torch.no_grad()
def test_positional_query_is_checked_too(setup):
    model, states = setup
    with pytest.raises(ValueError, match="left padding"):
        model.generate(random_ids(3, batch=2), past_states=states, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match="query is empty"):
        model(torch.zeros(1, 0, dtype=torch.long), None, past_states=states)


@torch.no_grad()
def test_inputs_embeds_with_past_states_equal_input_ids(arch):
    model = tiny_model(arch)
    states = [ComposableMambaCache.encode(model, random_ids(n)) for n in (6, 9)]
    ids = random_ids(5, batch=2)
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    embeds = model.get_input_embeddings()(ids)
    by_ids = model(input_ids=ids, attention_mask=mask, past_states=states).logits
    by_embeds = model(inputs_embeds=embeds, attention_mask=mask, past_states=states).logits
    assert torch.equal(by_embeds, by_ids)
    generated = model.generate(ids, attention_mask=mask, past_states=states, max_new_tokens=4, do_sample=False)
    from_embeds = model.generate(
        inputs_embeds=embeds, attention_mask=mask, past_states=states, max_new_tokens=4, do_sample=False
    )
    assert torch.equal(
        from_embeds, generated[:, ids.shape[1] :]
    )  # stock generate returns only the new tokens for embeds
    with pytest.raises(ValueError, match="inputs_embeds must have shape"):
        model(inputs_embeds=embeds[0], past_states=states)
    with pytest.raises(ValueError, match="does not match input_ids"):
        model.generate(ids[:, :3], inputs_embeds=embeds, past_states=states, max_new_tokens=2)


@torch.no_grad()
def test_left_padded_rows_equal_their_unpadded_queries(setup):
    """The mask that passes the checks is the one the model runs with (the checked int64 copy)."""
    model, states = setup
    query = random_ids(3)
    alone = model(query, past_states=states).logits
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), query], 1)
    batch = model(padded, attention_mask=torch.tensor([[0, 0, 1, 1, 1]]).bool(), past_states=states).logits
    assert (batch[:, 2:] - alone).abs().max() < 1e-5


def test_encode_refuses_fractional_masks(setup):
    """A 0.5 would be cast to 0 (a token taken as padding) if the mask were checked after the cast."""
    model, _ = setup
    with pytest.raises(ValueError, match="only 0"):
        ComposableMambaCache.encode(model, random_ids(4), attention_mask=torch.tensor([[0.5, 1.0, 1.0, 1.0]]))


@torch.no_grad()
def test_generate_checks_the_mask_it_would_infer_from_the_pad_token(setup):
    """Without attention_mask, stock generate takes every pad_token_id (0 here) for padding."""
    model, states = setup
    ids = random_ids(4, batch=2)
    right = ids.clone()
    right[1, 2:] = 0
    with pytest.raises(ValueError, match=r"left padding.*pad_token_id 0"):
        model.generate(right, past_states=states, max_new_tokens=2)
    hole = ids.clone()
    hole[0, 1] = 0
    with pytest.raises(ValueError, match=r"pad_token_id 0.*attention_mask explicitly"):
        model.generate(hole, past_states=states, max_new_tokens=2)
    left = ids.clone()
    left[1, :2] = 0
    inferred = model.generate(left, past_states=states, max_new_tokens=3, do_sample=False)
    explicit = model.generate(
        left, attention_mask=(left != 0).long(), past_states=states, max_new_tokens=3, do_sample=False
    )
    assert torch.equal(inferred, explicit)
    # an explicit mask says which zeros are tokens: no inference then
    model.generate(hole, attention_mask=torch.ones_like(hole), past_states=states, max_new_tokens=2)
