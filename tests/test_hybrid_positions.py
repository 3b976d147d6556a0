"""A hybrid state's key positions are checked against what an encode, a composition and a continuation make
(``validation.check_key_positions``): per row, -1 padding only on the left, and the keys' positions, as a set,
exactly 0, 1, ..., m (each context from 0; ``"concat"`` places the next context right after, ``"shared"`` repeats
positions, a continuation goes on at m + 1). A gap, an offset beyond the context or a position whose + 1 overflows
int64 would start a RoPE query at the wrong position (logits off by up to 0.08): refused from memory
(``set_positions``, a layer's positions edited before compose / generate), from a resealed file and from a store
entry; the legitimate states (left-padded batch, concat, shared, continued, stacked) are accepted."""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import compat
from hf_statecompose.composition import StateComposer
from hf_statecompose.state.cache import ComposableMambaCache
from hf_statecompose.state.validation import check_key_positions, check_state

from architectures import hybrid_model, ids, left_pad
from helpers import craft

INT64_MAX = torch.iinfo(torch.int64).max


@pytest.fixture(scope="module")
def model():
    # Bamba: partial RoPE, its attention layer (model layer 1) right after the first Mamba layer
    return hybrid_model("bamba", dtype=torch.float32)


@pytest.fixture(scope="module")
def padded(model):
    """A left-padded batch of contexts of 6 and 4 tokens: positions [[0..5], [-1, -1, 0..3]]."""
    return hsc.encode(model, *left_pad([ids(6, seed=1)[0], ids(4, seed=2)[0]]))


def _edit(row: int, fn):
    def edit(p):
        p = p.clone()
        p[row] = fn(p[row])
        return p

    return edit


def _at(index: int, value: int):
    def fn(r):
        r[index] = value
        return r

    return fn


# each a change of the padded batch's positions [[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]], and the error it gets
VIOLATIONS = {
    "a gap": (_edit(0, _at(-1, 9)), r"row 0's key positions jump from 4 to 9 \(no key at 5\)"),
    "a gap in a padded row": (_edit(1, _at(-1, 4)), r"row 1's key positions jump from 2 to 4"),
    "an offset beyond the context": (
        _edit(0, lambda r: r + 10**9),
        r"row 0's first key position is 1000000000, not 0",
    ),
    "a padded row's offset": (_edit(1, lambda r: torch.where(r >= 0, r + 7, r)), "row 1's first key position is 7"),
    "a position whose + 1 overflows int64": (
        _edit(0, _at(-1, INT64_MAX)),
        rf"jump from 4 to {INT64_MAX} .*overflows int64",
    ),
    "every position at int64's max": (
        _edit(0, lambda r: torch.full_like(r, INT64_MAX)),
        rf"first key position is {INT64_MAX}, not 0 \(its last \+ 1, a query's start, overflows int64\)",
    ),
    "a negative position": (_edit(0, _at(2, -3)), "below -1"),
    "padding in the middle": (_edit(0, _at(3, -1)), "not left padded"),
    "padding on the right": (_edit(1, _at(-1, -1)), "not left padded"),
}


def _bad_positions(state, case):
    edit, message = VIOLATIONS[case]
    return edit(state.attention_layers[0].positions), message


def test_the_padded_batch_is_what_the_violations_edit(padded):
    assert torch.equal(padded.attention_layers[0].positions, torch.tensor([[0, 1, 2, 3, 4, 5], [-1, -1, 0, 1, 2, 3]]))


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_set_positions_refuses(case, padded):
    state = padded.clone()
    before = state.attention_layers[0].positions
    positions, message = _bad_positions(state, case)
    with pytest.raises(ValueError, match=r"set_positions\(positions\): .*" + message):
        state.set_positions(positions)
    assert all(layer.positions is before for layer in state.attention_layers)  # nothing recorded
    check_state(state)


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_positions_edited_in_memory_are_refused_by_compose_and_generate(case, model, padded):
    state = padded.clone()
    positions, message = _bad_positions(state, case)
    for layer in state.attention_layers:
        layer.positions = positions
    with pytest.raises(ValueError, match=message):
        StateComposer("picaso_r").compose([state], model=model)
    with pytest.raises(ValueError, match=message):
        model.generate(ids(3, batch=2, seed=5), past_states=[state], max_new_tokens=1, do_sample=False)


@pytest.mark.parametrize("case", list(VIOLATIONS))
def test_resealed_files_are_refused(case, model, padded, tmp_path):
    source = tmp_path / "s.safetensors"
    padded.save(source)
    edit, message = VIOLATIONS[case]
    layer = padded.attention_layer_indices[0]

    def edit_file(tensors, meta):
        tensors[f"attn.positions.{layer}"] = edit(tensors[f"attn.positions.{layer}"])

    path = craft(source, tmp_path / "crafted.safetensors", edit_file)
    for kwargs in ({}, {"model": model}):
        with pytest.raises(ValueError, match=message):
            ComposableMambaCache.load(path, **kwargs)
    ComposableMambaCache.load(craft(source, tmp_path / "same.safetensors", lambda t, m: None), model=model)


def test_set_positions_checks_type_and_shape(padded):
    state = padded.clone()
    good = state.attention_layers[0].positions
    for bad, message in (
        (good.int(), "must be an int64 tensor"),
        (good[0], "must be an int64 tensor"),
        (good[:, 1:], r"positions have shape \(2, 5\), the keys \(2, 6\)"),
        (good.tolist(), "must be an int64 tensor"),
    ):
        with pytest.raises(ValueError, match=message):
            state.set_positions(bad)
    state.set_positions(good.clone())  # the state's own positions: accepted


def _accepted(state):
    check_state(state)
    positions = state.attention_layers[0].positions
    check_key_positions(positions, "test")
    state.set_positions(positions.clone())
    return positions


def test_what_encode_composition_and_continuation_make_is_accepted(model, padded):
    a, b = hsc.encode(model, ids(6, seed=1)), hsc.encode(model, ids(4, seed=2))
    assert torch.equal(_accepted(padded)[1], torch.tensor([-1, -1, 0, 1, 2, 3]))  # left-padded batch
    concat = StateComposer("picaso_r").compose([a, b], model=model)
    assert torch.equal(_accepted(concat), torch.arange(10)[None])
    shared = StateComposer("picaso_r", attention="shared").compose([a, b], model=model)
    # shared placement repeats positions: each context at 0, 1, ...
    assert torch.equal(_accepted(shared), torch.cat([torch.arange(6), torch.arange(4)])[None])
    # shared, then concatenated after another state: the shared block continues after it, still without a gap
    nested = StateComposer("picaso_r").compose([b, shared], model=model)
    assert torch.equal(_accepted(nested), torch.cat([torch.arange(4), 4 + torch.arange(6), 4 + torch.arange(4)])[None])
    # per-row placement of a padded batch: row 1 (4 tokens) + row 1 of b's batch
    both = StateComposer("picaso_r", attention="shared").compose([padded, b.repeat_interleave(2)], model=model)
    _accepted(both)
    # a continued cache: generate from the shared composition, the query at 6, 7, ... (after the longest)
    out = model.generate(
        ids(3, seed=7),
        past_states=[a, b],
        composition=StateComposer("picaso_r", attention="shared"),
        max_new_tokens=2,
        do_sample=False,
        return_dict_in_generate=True,
    )
    continued = compat.output_cache(out)
    positions = continued.attention_layers[0].positions
    assert torch.equal(positions[0, 10:], torch.arange(6, 10))
    check_state(continued)
    # a batch of states with and without keys: the keyless row is all padding
    keyless = StateComposer("picaso_r", attention="none").compose([a], model=model)
    stacked = ComposableMambaCache.stack([keyless, shared])
    assert torch.equal(_accepted(stacked)[0], torch.full((10,), -1))


def test_a_continued_states_query_starts_after_the_last_position(model):
    """What the invariant protects: the query of a state continues at its last position + 1 (bounded by its keys)."""
    state = hsc.encode(model, ids(5, seed=3))
    query = ids(2, seed=4)
    full = model(torch.cat([ids(5, seed=3), query], dim=-1)).logits[:, -1]
    composed = model(query, past_states=[state]).logits[:, -1]
    assert torch.allclose(composed, full, atol=1e-4)


def _reference_valid(positions) -> bool:
    """The invariant, row by row in plain Python: -1 only before the first key, the keys' positions a set 0 .. m."""
    for row in positions.tolist():
        keys = [p for p in row if p != -1]
        if any(p < -1 for p in row) or row[len(row) - len(keys) :] != keys:
            return False
        if sorted(set(keys)) != list(range(len(set(keys)))):
            return False
    return True


def test_the_check_agrees_with_a_plain_reference_on_random_positions():
    """check_key_positions (a fast path for slot-ordered rows, a sort for repeated positions) accepts exactly what
    the row-by-row reference accepts, on fresh random rows: encoded, concatenated, shared, continued, then perturbed."""
    generator = torch.Generator().manual_seed(29)

    def randint(low, high):
        return int(torch.randint(low, high, (1,), generator=generator))

    verdicts = {True: 0, False: 0}
    for _ in range(400):
        batch, rows = randint(1, 4), []
        for _ in range(batch):
            blocks = [torch.arange(randint(0, 6)) for _ in range(randint(1, 4))]
            if randint(0, 2):  # shared: every block from 0; else concatenated
                row = torch.cat(blocks)
            else:
                row = torch.arange(sum(len(b) for b in blocks))
            rows.append(row)
        width = max(len(r) for r in rows) + randint(0, 3)
        positions = torch.stack([torch.cat([torch.full((width - len(r),), -1), r]) for r in rows])
        if randint(0, 2) and positions.numel():  # perturb one slot
            flat = positions.view(-1)
            flat[randint(0, flat.numel())] = [-1, -2, 0, 1, 7, 10**9, INT64_MAX][randint(0, 7)]
        expected = _reference_valid(positions)
        verdicts[expected] += 1
        if expected:
            check_key_positions(positions, "random")
        else:
            with pytest.raises(ValueError):
                check_key_positions(positions, "random")
    assert min(verdicts.values()) > 50  # both verdicts are exercised
