"""In-memory states get every check a state file gets, once per state object (issue 21).

* ``clone()`` and ``copy.deepcopy`` return states owning every tensor (``A`` and SeRpEnt's extras included);
* a state altered in memory (negative ΣΔ, wrong dtype, token counts that disagree, ...) is refused by
  ``compose``, ``forward`` and ``generate`` as its file would be by ``load``; the check runs once per state
  and runs again after an in-place edit or a reassigned tensor;
* SeRpEnt resampling states satisfy the invariants of every real encoding (derived in
  :func:`hf_statecompose.state.architectures._check_resampling_values`), crafted ones are refused;
* row indices must be integers; error messages name the argument the user passed.
"""

import copy
import itertools

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer
from hf_statecompose.composition.composer import MODEL_FREE_METHODS
from hf_statecompose.state import validation
from hf_statecompose.state.serpent_cache import CLOCK_ONE
from hf_statecompose.state.validation import check_state

from helpers import tiny_model

SERPENT_VOCAB = 61


def tiny_serpent(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=SERPENT_VOCAB,
        hidden_size=24,
        num_hidden_layers=2,
        state_size=4,
        resample_window=3,
        num_gaussians=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    kwargs.update(overrides)
    return hsc.enable(hsc.SeRpEntMambaForCausalLM(hsc.SeRpEntMambaConfig(**kwargs)).eval())


@pytest.fixture(scope="module", params=["mamba", "mamba2", "serpent_mamba"])
def any_model(request):
    return tiny_serpent() if request.param == "serpent_mamba" else tiny_model(request.param)


@pytest.fixture(scope="module")
def serpent():
    return tiny_serpent()


def encode(model, length=7, batch=1, seed=1):
    ids = torch.randint(3, 50, (batch, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return ComposableMambaCache.encode(model, ids)


def all_tensors(state):
    """Every tensor a state holds (per layer: SSM state, conv window, ΣΔ, A and the extras; token counts, ids)."""
    out = []
    for layer in state.layers:
        out += [layer.ssm_state, layer.conv_state, layer.delta_sum, layer.A]
        out += [getattr(layer, name) for name in layer._row_tensors if name != "delta_sum"]
    return out + [t for t in (state.num_tokens, state.token_ids) if t is not None]


def storages(state):
    return {t.untyped_storage().data_ptr() for t in all_tensors(state)}


# ------------------------------------------------------------------------------------------ 1. ownership
@pytest.mark.parametrize("make", [lambda s: s.clone(), copy.deepcopy], ids=["clone", "deepcopy"])
def test_clone_and_deepcopy_own_every_tensor(any_model, make):
    state = encode(any_model)
    copied = make(state)
    assert len(all_tensors(copied)) == len(all_tensors(state))
    assert not storages(copied) & storages(state)
    # editing the copy's A in place leaves the original intact: it still generates (it is not "altered")
    before = [a.clone() for a in state.A]
    copied.A[0].mul_(2.0)
    assert all(torch.equal(a, b) for a, b in zip(state.A, before))
    with torch.no_grad():
        any_model(torch.tensor([[5, 6]]), past_states=[state])


def test_row_operations_own_their_rows_and_A(any_model):
    """select / [] / repeat_interleave / stack and composition results (n >= 2) copy, as torch's index_select,
    repeat_interleave and cat do; detach and to() of the same device share, as torch's do."""
    state = encode(any_model, batch=2)
    for made in (
        state.select(0),
        state[1],
        state[0:2],
        state.repeat_interleave(2),
        type(state).stack([state, state]),
        StateComposer("soup").compose([state, state]),
    ):
        assert not storages(made) & storages(state)
    for made in (state.detach(), state.to("cpu")):
        assert storages(made) == storages(state)


# ------------------------------------------------------------------------------------------ 2. in-memory checks
def _negative_delta(s):
    s.delta_sums[0][0, 0] = -1.0


def _float64_ssm(s):
    s.layers[1].ssm_state = s.ssm_states[1].double()


def _num_tokens_off(s):
    s.num_tokens = s.num_tokens + 1


def _token_ids_bad(s):
    s.token_ids = s.token_ids.clone()
    s.token_ids[0, 0] = 10**6


def _positive_A(s):
    s.A[0].abs_()


IN_MEMORY = [
    ("negative ΣΔ", _negative_delta, "layer 0 ΣΔ has negative entries"),
    # (compose compares the dtypes of its states first: "states[1] layer 1 SSM state is torch.float64, states[0] ...")
    ("float64 SSM state", _float64_ssm, "layer 1 SSM state is torch.float64, (expected torch.float32|states.0. is)"),
    ("num_tokens", _num_tokens_off, "token_ids hold .* ids per row but num_tokens says"),
    ("token id", _token_ids_bad, r"token_ids hold ids outside \[-1,"),
    ("A", _positive_A, "layer 0 A must be finite and <= 0"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in IN_MEMORY], ids=[c[0] for c in IN_MEMORY])
@torch.no_grad()
def test_states_altered_in_memory_are_refused_as_their_files_are(any_model, edit, message, tmp_path):
    good = encode(any_model, seed=2)
    bad = encode(any_model)
    edit(bad)
    query = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match=message):
        bad.save(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=r"past_states\[1\]:? " + message):
        any_model(query, past_states=[good, bad])
    with pytest.raises(ValueError, match=r"past_states\[1\]: " + message):
        any_model.generate(query, past_states=[good, bad], max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"past_states\[0\]\[1\]: " + message):
        any_model.generate(query, past_states=[[good, bad]], max_new_tokens=2, do_sample=False)
    for method in MODEL_FREE_METHODS:
        composer = StateComposer(method, weights=[0.5, 0.5]) if method == "weighted" else StateComposer(method)
        with pytest.raises(ValueError, match=r"^states\[1\]:? " + message):
            composer.compose([good, bad])
    with pytest.raises(ValueError, match=r"^states\[0\]: " + message):
        StateComposer("picaso_r").compose([bad])


@torch.no_grad()
def test_negative_delta_sum_no_longer_moves_the_logits():
    """The trial's case: a negative ΣΔ set in memory ran through picaso_r (logits moved by 1.7)."""
    model = tiny_model("mamba")
    states = [encode(model, seed=s) for s in (1, 2)]
    states[1].delta_sums[0].neg_()
    with pytest.raises(ValueError, match=r"past_states\[1\]: layer 0 ΣΔ has negative entries"):
        model(torch.tensor([[5, 6]]), past_states=states, composition="picaso_r")


@torch.no_grad()
def test_the_check_runs_once_per_state_and_again_after_an_edit(monkeypatch):
    model = tiny_model("mamba2")
    states = [encode(model, seed=s) for s in range(3)]
    calls = []
    real = validation.check_state
    monkeypatch.setattr(
        validation, "check_state", lambda state, *a, **k: (calls.append(state), real(state, *a, **k))[1]
    )
    query = torch.tensor([[5, 6]])
    for _ in range(3):
        model.generate(query, past_states=states, max_new_tokens=2, do_sample=False)
        StateComposer("caso").compose(states)
    assert len(calls) == 3 and {id(s) for s in calls} == {id(s) for s in states}
    # an in-place edit after the check: checked again, and refused
    states[2].delta_sums[1][0, 0] = -0.5
    with pytest.raises(ValueError, match=r"past_states\[2\]: layer 1 ΣΔ has negative entries"):
        model(query, past_states=states)
    states[2].delta_sums[1][0, 0] = 0.5  # repaired in place: accepted again
    model(query, past_states=states)
    # a reassigned tensor (same shape, new object): checked again
    states[0].layers[0].delta_sum = -states[0].delta_sums[0]
    with pytest.raises(ValueError, match=r"^states\[0\]: layer 0 ΣΔ has negative entries"):
        StateComposer("soup").compose(states)
    states[0].layers[0].delta_sum = states[0].delta_sums[0].abs()
    StateComposer("soup").compose(states)
    states[0].num_tokens = torch.tensor([-1])
    with pytest.raises(ValueError, match=r"past_states\[0\]: .*num_tokens"):
        model(query, past_states=states[:1] + states[1:])


# ------------------------------------------------------------------------------------------ 3. SeRpEnt invariants
def _left_padded_batch(lengths, seed):
    width = max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, width - n :] = torch.randint(3, SERPENT_VOCAB, (n,), generator=g)
        mask[r, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize("compressions", [(1.0, 0.5, 0.1), (0.3,), (0.999, 0.02)])
@torch.no_grad()
def test_real_serpent_encodings_always_pass(compressions):
    """Contexts of every length 1..3K (alone and in left-padded batches), continued, composed and
    generated from: each state satisfies the invariants."""
    model = tiny_serpent(
        seed=3,
        branch_compressions=list(compressions),
        hidden_size=12 * len(compressions),
        intermediate_size=24 * len(compressions),
    )
    K = model.config.resample_window
    lengths = list(range(1, 3 * K + 1))
    states = []
    for n in lengths:
        state = encode(model, length=n, seed=n)
        check_state(state)
        states.append(state)
    for start in range(0, len(lengths), 3):
        ids, mask = _left_padded_batch(lengths[start : start + 3], seed=start)
        batch = ComposableMambaCache.encode(model, ids, attention_mask=mask)
        check_state(batch)
        out = model(torch.tensor([[5, 6, 7]] * batch.batch_size), cache=batch.clone(), use_cache=True)
        check_state(out.cache)  # continued (no token ids any more)
        # a left-padded query after the state
        query_mask = torch.tensor([[0, 1, 1]] * batch.batch_size)
        out = model(
            torch.tensor([[0, 5, 6]] * batch.batch_size), attention_mask=query_mask, cache=batch.clone(), use_cache=True
        )
        check_state(out.cache)
    for method in MODEL_FREE_METHODS:
        composer = StateComposer(method, weights=[0.5, 0.5]) if method == "weighted" else StateComposer(method)
        for a, b in itertools.pairwise(states):
            check_state(composer.compose([a, b]))
    for method in ("concat", "piconcat_r"):
        check_state(StateComposer(method).compose(states[:3], model=model))
    # past_states accepted end to end, and what generation leaves in the cache too
    out = model.generate(
        torch.tensor([[5]]), past_states=states[-2:], max_new_tokens=4, do_sample=False, return_dict_in_generate=True
    )
    check_state(out.cache if hasattr(out, "cache") else out.past_key_values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@torch.no_grad()
def test_real_serpent_encodings_pass_in_other_dtypes(dtype):
    """The time steps are computed in float32 (float64 for a float64 model): the least step keeps its slack."""
    model = tiny_serpent(seed=3).to(dtype)
    K = model.config.resample_window
    for n in range(1, 3 * K + 1):
        check_state(encode(model, length=n, seed=n))
    ids, mask = _left_padded_batch([1, K, 3 * K], seed=5)
    state = ComposableMambaCache.encode(model, ids, attention_mask=mask)
    check_state(state)
    check_state(model(torch.tensor([[5, 6]] * 3), cache=state, use_cache=True).cache)


def _all_invalid(s, v):
    s.window_valid[v] = torch.zeros_like(s.window_valid[v])


def _times_equal_clock(s, v):
    s.window_times[v] = s.clocks[v][:, None].expand_as(s.window_times[v]).clone()


def _last_time_not_clock(s, v):
    s.clocks[v] = s.clocks[v] + 5


def _step_too_long(s, v):
    times = s.window_times[v].clone()
    times[:, 1:] += 2 * CLOCK_ONE
    s.window_times[v] = times
    s.clocks[v] = s.clocks[v] + 2 * CLOCK_ONE


def _kappa_one_step(s, v):
    # v = 0 is the κ = 1 branch: every token advances its clock by exactly CLOCK_ONE
    times = s.window_times[v].clone()
    times[:, 0] += 1
    s.window_times[v] = times


def _one_token_window(s, v, clock):
    """Layer v as if it had seen one token (consistent by itself); the state no longer an encoding."""
    s.token_ids = None
    s.clocks[v] = torch.tensor([clock])
    s.window_times[v] = torch.tensor([[0, 0, clock]])
    s.window_valid[v] = torch.tensor([[False, False, True]])


def _output_before_grid(s, v):
    # v = 2 is the κ = 0.1 branch: a first token of step 1/2 creates no grid point, so no output yet
    _one_token_window(s, v, CLOCK_ONE // 2)
    s.last_outputs[v] = torch.ones_like(s.last_outputs[v])


def _valid_counts_differ(s, v):
    _one_token_window(s, v, CLOCK_ONE)


def _more_valid_than_tokens(s, v):
    s.token_ids = None
    s.num_tokens = torch.tensor([2])


def _window_not_full_but_late(s, v):
    # 2 valid neighbours where the window holds 3: they are the first two tokens ever, so the first time <= 1
    s.token_ids = None
    s.window_valid[v] = torch.tensor([[False, True, True]])
    s.window_times[v] = torch.tensor([[0, 5 * CLOCK_ONE, 6 * CLOCK_ONE]])
    s.clocks[v] = torch.tensor([6 * CLOCK_ONE])


def _not_an_encoding(s, v):
    # token ids say the state is the encoding of 8 tokens from scratch: the κ = 1 clock is then exactly 8
    s.clocks[v] = s.clocks[v] - CLOCK_ONE
    s.window_times[v] = s.window_times[v] - CLOCK_ONE


CRAFTED = [
    ("all invalid with a clock", 0, _all_invalid, "layer 0 resampling clock is .* but no window neighbour is valid"),
    ("times equal the clock", 1, _times_equal_clock, "layer 1 resampling window times .*step"),
    ("last time is not the clock", 0, _last_time_not_clock, "layer 0 .*latest valid neighbour's time"),
    ("a step longer than one", 2, _step_too_long, "layer 2 resampling window times .*step"),
    ("κ = 1 step", 0, _kappa_one_step, "layer 0 resampling window times .*step"),
    (
        "output before the first grid point",
        2,
        _output_before_grid,
        "layer 2 resampling last output .*before the first grid point",
    ),
    ("valid counts differ", 0, _valid_counts_differ, "valid neighbours.*layer 0 .*layer 1"),
    (
        "more neighbours than tokens",
        0,
        _more_valid_than_tokens,
        r"layer 0 .*3 valid neighbours, more than num_tokens \(2\)",
    ),
    ("window not full, late first time", 0, _window_not_full_but_late, "layer 0 .*first"),
    ("not an encoding of its tokens", 3, _not_an_encoding, "layer 3 .*token_ids"),
]


@pytest.mark.parametrize("layer, edit, message", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
@torch.no_grad()
def test_crafted_serpent_states_are_refused(serpent, layer, edit, message, tmp_path):
    bad = encode(serpent, length=8)
    edit(bad, layer)
    with pytest.raises(ValueError, match=message):
        check_state(bad)
    with pytest.raises(ValueError, match=message):
        bad.save(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match=r"past_states\[0\]: .*" + message):
        serpent(torch.tensor([[5, 6]]), past_states=[bad])
    with pytest.raises(ValueError, match=r"^states\[0\]: .*" + message):
        StateComposer("soup").compose([bad, bad])


@torch.no_grad()
def test_crafted_serpent_files_are_refused(serpent, tmp_path):
    """The same invariants guard files: a state whose times all equal its clock, written past the save check."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save

    from hf_statecompose.state import serialization

    path = tmp_path / "good.safetensors"
    encode(serpent, length=8).save(path)
    tensors = load_file(path)
    with safe_open(path, framework="pt") as handle:
        meta = json.loads(handle.metadata()["hf_statecompose"])
    tensors["resample.times.2"] = tensors["resample.clock.2"][:, None].expand(-1, 3).contiguous()
    meta["tensor_digest"] = serialization._digest(tensors)
    crafted = tmp_path / "crafted.safetensors"
    crafted.write_bytes(save(tensors, metadata={"hf_statecompose": json.dumps(meta)}))
    for kwargs in ({}, {"model": serpent}):
        with pytest.raises(ValueError, match=r"layer 2 resampling window times .*step"):
            ComposableMambaCache.load(crafted, **kwargs)


# ------------------------------------------------------------------------------------------ 4. row indices
@pytest.mark.parametrize(
    "rows",
    [
        0.5,
        1.9,
        torch.tensor([0.0]),
        torch.tensor(1.0),
        [0, 1.5],
        [0.0],
        True,
        [True, False],
        torch.tensor([True, False]),
        "0",
        None,
    ],
)
def test_row_indices_must_be_integers(rows):
    model = tiny_model("mamba")
    state = encode(model, batch=2)
    for take in (state.select, state.__getitem__):
        with pytest.raises(TypeError, match="rows must be an int, a list of ints, a slice or a LongTensor"):
            take(rows)


def test_integer_row_indices_still_work():
    model = tiny_model("mamba")
    state = encode(model, batch=3)
    for rows, expected in (
        (1, [1]),
        (-1, [2]),
        ([2, 0], [2, 0]),
        (torch.tensor([1, 2]), [1, 2]),
        (torch.tensor(2), [2]),
        (slice(0, 2), [0, 1]),
        (torch.tensor([0], dtype=torch.int32), [0]),
    ):
        for take in (state.select, state.__getitem__):
            picked = take(rows)
            assert torch.equal(picked.ssm_states[0], state.ssm_states[0][expected])


# ------------------------------------------------------------------------------------------ 5. wording
@torch.no_grad()
def test_nan_is_named_by_the_argument_passed():
    model = tiny_model("mamba")
    good, bad = encode(model, seed=1), encode(model, seed=2)
    bad.ssm_states[1][0, 0, 0] = float("nan")
    corrupted = r": layer 1 SSM state contains NaN or inf; the state is corrupted, re-encode the context"
    query = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match=r"^past_states\[1\]" + corrupted):
        model.generate(query, past_states=[good, bad], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^past_states\[1\]" + corrupted):
        model(query, past_states=[good, bad])
    with pytest.raises(ValueError, match=r"^past_states\[0\]\[1\]" + corrupted):
        model(query, past_states=[[good, bad]])
    with pytest.raises(ValueError, match=r"^states\[1\]" + corrupted):
        StateComposer("picaso_r").compose([good, bad])


# ------------------------------------------------------------------------------------ fast pass vs slow pass
# check_state's per-layer dtype / shape / device checks run as one pass that names nothing
# (validation._layer_metadata_fits), the slow pass (validation._refuse_layer_metadata) only on a failure, to
# name it: the two must agree on every state, here fresh random edits of real states
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_layer_metadata_fast_pass_agrees_with_the_slow_pass(arch):
    from hf_statecompose.state import validation

    from helpers import random_ids

    model = tiny_model(arch, layers=3)
    generator = torch.Generator().manual_seed(7)
    state = hsc.ComposableMambaCache.encode(model, random_ids(9, batch=2, generator=generator))
    layout = validation.ARCHITECTURES[state.architecture]
    ssm_shape, conv_shape = layout.state_shapes(state.config)
    delta_shape, A_shape = layout.decay_shapes(state.config)

    def verdicts(s):
        batch, device = s.ssm_states[0].shape[0], s.ssm_states[0].device
        shapes = ((batch, *ssm_shape), (batch, *conv_shape), (batch, *delta_shape), tuple(A_shape))
        fast = validation._layer_metadata_fits(s.state_layers, s.model_dtype, device, shapes)
        try:
            validation._refuse_layer_metadata(s, "s", batch, device, ssm_shape, conv_shape, delta_shape, A_shape)
        except ValueError:
            return fast, False
        except AssertionError:  # the slow pass found nothing: it only runs after a fast-pass failure
            return fast, True
        raise AssertionError("the slow pass neither refused nor reported nothing found")

    assert verdicts(state) == (True, True)
    edits = {
        "dtype": lambda t: t.to(torch.float64 if t.dtype != torch.float64 else torch.float32),
        "shape": lambda t: t[..., :-1] if t.dim() and t.shape[-1] > 1 else t.unsqueeze(0),
        "extra dim": lambda t: t.unsqueeze(-1),
        "device": lambda t: t.to("meta"),
        "not a tensor": lambda t: t.tolist(),
        "none": lambda t: None,
    }
    for trial in range(40):
        edited = copy.deepcopy(state)
        layer = int(torch.randint(len(edited.state_layers), (1,), generator=generator))
        name = ["ssm_state", "conv_state", "delta_sum", "A"][int(torch.randint(4, (1,), generator=generator))]
        kind = sorted(edits)[int(torch.randint(len(edits), (1,), generator=generator))]
        setattr(edited.state_layers[layer], name, edits[kind](getattr(edited.state_layers[layer], name)))
        assert verdicts(edited) == (False, False), (trial, layer, name, kind)
