"""A hybrid cache continued by generate / forward from composed states records where the call put each new key:
the query's padding slots as padding (-1), the real tokens after the composed keys' last position with the
padding skipped, as the call's position_ids placed them. transformers' attention appends keys without a mask, so
without this the padding would pass for context tokens when the cache is reused."""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import compat
from hf_statecompose.state.validation import check_state

from architectures import hybrid_model, ids


def _states(model):
    return [hsc.encode(model, ids(n, seed=n)) for n in (5, 3)]


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h"])
def test_generate_records_the_padded_querys_positions(arch):
    model = hybrid_model(arch, dtype=torch.float32)
    query = ids(4, batch=2, seed=9)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    out = model.generate(
        query,
        attention_mask=mask,
        past_states=_states(model),
        max_new_tokens=3,
        do_sample=False,
        num_beams=2,
        return_dict_in_generate=True,
    )
    cache = compat.output_cache(out)
    positions = cache.attention_layers[0].positions
    assert positions.shape == (4, 8 + 4 + 2)  # 8 composed keys, the query, 2 generated tokens (the last is not fed)
    composed = torch.arange(8)
    for row in (0, 1):  # query row 0's beams: two padding slots, then positions 8, 9, ... for the real tokens
        assert torch.equal(positions[row], torch.cat([composed, torch.tensor([-1, -1]), torch.arange(8, 12)]))
    for row in (2, 3):
        assert torch.equal(positions[row], torch.arange(14))
    assert all(torch.equal(layer.positions, positions) for layer in cache.attention_layers)
    with pytest.raises(ValueError, match="continued from a left-padded query holds that padding"):
        check_state(cache.select([0]))
    check_state(cache.select([2]))  # an unpadded row's continuation is a valid state


def test_forward_records_positions_too():
    model = hybrid_model("granitemoehybrid", dtype=torch.float32, position_embedding_type="rope")
    query = ids(3, batch=2, seed=4)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    out = model(query, attention_mask=mask, past_states=_states(model), use_cache=True)
    positions = compat.output_cache(out).attention_layers[0].positions
    assert torch.equal(positions[0], torch.cat([torch.arange(8), torch.tensor([-1, 8, 9])]))
    assert torch.equal(positions[1], torch.arange(11))
