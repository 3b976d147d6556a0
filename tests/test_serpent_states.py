"""SeRpEnt-Mamba states: encode, compose and generate like Mamba (issue 12).

What every architecture's state does (one state + query = context + query, padded batches, files, copies,
refusals) is checked once for all in test_state_contract.py. Here what is SeRpEnt's own: a continued state
carries the resampling clock, window and times; more states compose their branch SSMs as Mamba-1 states (checked
against the plain reference per virtual layer) and take the resampling state of the last one; state files carry
the resampling state and refuse crafted ones."""

import copy

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, ComposableSeRpEntCache, StateComposer
from hf_statecompose.composition.composer import METHODS, MODEL_FREE_METHODS
from hf_statecompose.ops.compose.reference import compose_ssm_ref
from hf_statecompose.state.architectures import SERPENT_MAMBA
from hf_statecompose.state.serpent_cache import CLOCK_BITS
from hf_statecompose.state.validation import check_state

from architectures import SERPENT_STATE_MATTERS, SERPENT_VOCAB, tiny_serpent
from helpers import craft, relative_error

VOCAB = SERPENT_VOCAB
NEW = 8
EXTRAS = tuple(extra.attribute for extra in SERPENT_MAMBA.extras)
STATE_MATTERS = SERPENT_STATE_MATTERS
MATTERS = 2e-2  # smallest relative change of the next-token logits that counts as "the state changes the output"


tiny = tiny_serpent  # the tiny SeRpEnt LM of tests/architectures.py


def ids_of(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def composer_of(method: str, n: int) -> StateComposer:
    return (
        StateComposer(method, weights=[0.2, 0.5, 0.3][:n] if n == 3 else [1.0])
        if method == "weighted"
        else StateComposer(method)
    )


def without_ssm_states(state):
    """A copy with every (branch) SSM state zeroed; conv windows, ΣΔ and the resampling state kept."""
    zeroed = state.clone()
    for v in range(zeroed.num_layers):
        zeroed.ssm_states[v].zero_()
    return zeroed


def assert_states_equal(actual, expected, rtol=1e-5, atol=1e-6, clock_atol=None):
    """Every tensor of two SeRpEnt states: SSM, conv, ΣΔ, A close; the valid masks and the grid points
    (clock >> CLOCK_BITS) exact; clocks and times exact (``clock_atol=None``) or within ``clock_atol``
    fixed-point units; the float extras close.

    Why a clock tolerance: a token's clock step is round(δ · 2^20) with δ from a float matmul, whose last bits
    depend on the shapes it runs at (a padded batch, another chunking), so a row encoded in a padded batch
    can be a few 2^-20 time units off the row encoded alone (a difference of about 1e-6 in δ)."""
    assert type(actual) is type(expected) and actual.num_layers == expected.num_layers
    for v in range(expected.num_layers):
        for name in ("ssm_states", "conv_states", "delta_sums", "A"):
            torch.testing.assert_close(getattr(actual, name)[v], getattr(expected, name)[v], rtol=rtol, atol=atol)
        assert torch.equal(actual.window_valid[v], expected.window_valid[v]), v
        assert torch.equal(actual.clocks[v] >> CLOCK_BITS, expected.clocks[v] >> CLOCK_BITS), v
        for name in ("clocks", "window_times"):
            a, b = getattr(actual, name)[v], getattr(expected, name)[v]
            assert torch.equal(a, b) if clock_atol is None else int((a - b).abs().max()) <= clock_atol, (name, v)
        for name in ("window_inputs", "last_outputs"):
            torch.testing.assert_close(getattr(actual, name)[v], getattr(expected, name)[v], rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def model():
    return tiny(**STATE_MATTERS)


@pytest.fixture(scope="module")
def context():
    return ids_of(13, seed=11)


@pytest.fixture(scope="module")
def state(model, context):
    with torch.no_grad():
        return ComposableMambaCache.encode(model, context)


@pytest.fixture(scope="module")
def states(model):
    with torch.no_grad():
        return [ComposableMambaCache.encode(model, ids_of(n, seed=20 + n)) for n in (9, 14, 6)]


# ------------------------------------------------------------------------------------------ enable / encode
def test_enable_and_encode_accept_a_serpent_model(model, state, context):
    assert hsc.is_enabled(model) and isinstance(model, hsc.SeRpEntMambaForCausalLM)
    assert type(model.backbone.layers[0].mixer).__name__ == "SeRpEntMixer"  # no mixer swap
    assert hsc.get_backend(model) == "auto"
    assert hsc.enable(model) is model  # idempotent
    assert isinstance(state, ComposableSeRpEntCache) and state.architecture == "serpent_mamba"
    assert state.num_layers == 2 * 3 and state.fingerprint == hsc.model_fingerprint(model)
    assert state.num_tokens.tolist() == [13] and torch.equal(state.token_ids, context)
    assert type(ComposableMambaCache.empty_for(model)) is ComposableSeRpEntCache
    assert hsc.encode is not None and type(hsc.encode(model, context)) is ComposableSeRpEntCache
    check_state(state, model)
    with torch.no_grad():  # a left-padded batch of contexts: counts, ids, each row as encoded alone
        ids = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids_of(5, seed=3)], 1)
        ids = torch.cat([ids, ids_of(9, seed=4)])
        mask = (torch.arange(9) >= torch.tensor([[4], [0]])).long()
        batch = ComposableMambaCache.encode(model, ids, attention_mask=mask)
        alone = ComposableMambaCache.encode(model, ids[:1, 4:])
    assert batch.num_tokens.tolist() == [5, 9] and batch.token_ids[0, :4].tolist() == [-1] * 4
    assert_states_equal(batch.select(0), alone, clock_atol=64)


def test_backend_and_disable(model):
    other = copy.deepcopy(model)
    hsc.set_backend(other, "torch")
    assert hsc.get_backend(other) == "torch"
    assert all(block.mixer._hsc_backend == "torch" for block in other.backbone.layers)
    hsc.disable(other)
    assert not hsc.is_enabled(other) and type(other) is hsc.SeRpEntMambaForCausalLM
    with pytest.raises(ValueError, match=r"past_states needs hf_statecompose\.enable"):
        other(ids_of(2), past_states=[object()])
    hsc.enable(other)
    assert hsc.is_enabled(other)


# ------------------------------------------------------------------------------------------ continuing
@torch.no_grad()
def test_continuing_a_state_equals_encoding_the_concatenation(model):
    """encode(c1) then forward(c2, cache_params=state) is encode(c1 + c2) in every tensor: SSM, conv, ΣΔ
    (accumulated over both forwards), the resampling clock, window, times, valid mask and last output."""
    c1, c2 = ids_of(7, batch=2, seed=60), ids_of(10, batch=2, seed=61)
    continued = ComposableMambaCache.encode(model, c1).clone()
    model(c2, cache_params=continued, use_cache=True)
    whole = ComposableMambaCache.encode(model, torch.cat([c1, c2], 1))
    assert_states_equal(continued, whole, clock_atol=64)
    assert continued.num_tokens.tolist() == [17, 17] and continued.token_ids is None


# ------------------------------------------------------------------------------------------ n > 1
@torch.no_grad()
def test_the_branch_ssm_states_of_a_composed_state_matter(model, states):
    """Zeroing every branch SSM state of each method's composed state (conv windows, ΣΔ and the resampling state
    kept) moves the next-token logits: the SSM states are not bypassed (test_state_contract.py checks the rest)."""
    query = ids_of(5, seed=80)
    for method in METHODS:
        composed = composer_of(method, 3).compose(states, model=model)
        expected = model(query, cache_params=composed.clone(), use_cache=True).logits[:, -1]
        zeroed = model(query, cache_params=without_ssm_states(composed), use_cache=True).logits[:, -1]
        assert relative_error(zeroed, expected) > MATTERS, method


@pytest.mark.parametrize("method", MODEL_FREE_METHODS)
@torch.no_grad()
def test_branch_states_compose_as_mamba1_and_extras_are_the_last_states(states, method):
    """Per virtual layer v: the composed SSM state is the plain reference's composition of the stacked
    Mamba-1 states with each branch's decay; ΣΔ the total (mean / weighted mean for soup / weighted); the
    resampling state is the last state's, exactly."""
    weights = [0.2, 0.5, 0.3] if method == "weighted" else None
    composed = StateComposer(method, weights=weights).compose(states)
    assert type(composed) is ComposableSeRpEntCache and composed.num_tokens.tolist() == [9 + 14 + 6]
    w = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    for v in range(composed.num_layers):
        deltas = torch.stack([s.delta_sums[v] for s in states])
        expected = compose_ssm_ref(
            [s.ssm_states[v].double() for s in states], deltas.double(), states[0].A[v].double(), method, weights=w
        )
        torch.testing.assert_close(composed.ssm_states[v].double(), expected, rtol=1e-5, atol=1e-6)
        if method == "soup":
            total = deltas.mean(0)
        elif method == "weighted":
            total = (w.float()[:, None, None] * deltas).sum(0)
        else:
            total = deltas.sum(0)
        torch.testing.assert_close(composed.delta_sums[v], total)
        assert torch.equal(composed.A[v], states[0].A[v])
        for name in EXTRAS:
            assert torch.equal(getattr(composed, name)[v], getattr(states[-1], name)[v]), name
            assert getattr(composed, name)[v] is not getattr(states[-1], name)[v]  # a copy, not shared
    # the branches really resample: the κ = 0.1 branch made fewer grid points than the 9 tokens of states[0]
    assert int(states[0].clocks[2] >> CLOCK_BITS) < 9 == int(states[0].clocks[0] >> CLOCK_BITS)


@torch.no_grad()
def test_concat_baselines_re_encode(model, states):
    tokens = torch.cat([s.token_ids for s in states], 1)
    concat = StateComposer("concat").compose(states, model=model)
    assert_states_equal(concat, ComposableMambaCache.encode(model, tokens))
    piconcat = StateComposer("piconcat_r").compose(states, model=model)
    assert type(piconcat) is ComposableSeRpEntCache and piconcat.num_tokens.tolist() == [29]
    assert_states_equal(piconcat.select(0), piconcat)  # (a complete state)
    for name in EXTRAS:  # the resampling state of the list-order concatenation
        for v in range(concat.num_layers):
            torch.testing.assert_close(getattr(piconcat, name)[v], getattr(concat, name)[v], rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_composed_rows_stack_with_their_extras(model, states):
    from hf_statecompose.generation import compose_for_batch

    composed = compose_for_batch(model, [states[:2], states[1:]], "picaso_r", 2)
    assert type(composed) is ComposableSeRpEntCache and composed.batch_size == 2
    for name in EXTRAS:
        assert torch.equal(getattr(composed, name)[3][1], getattr(states[2], name)[3][0])
        assert torch.equal(getattr(composed, name)[3][0], getattr(states[1], name)[3][0])


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda s: s.window_inputs.__setitem__(1, s.window_inputs[1].index_fill(1, torch.tensor([0]), float("nan"))),
            "layer 1 resampling window inputs contain NaN",
        ),
        (lambda s: s.last_outputs.__setitem__(0, s.last_outputs[0] * float("inf")), "layer 0 resampling last output"),
        (lambda s: s.clocks.__setitem__(2, s.clocks[2].int()), "layer 2 resampling clock is torch.int32"),
        (lambda s: s.window_valid.__setitem__(0, None), "layer 0 resampling window valid mask is missing"),
        (
            lambda s: s.window_times.__setitem__(3, s.window_times[3][:, :1]),
            "layer 3 resampling window times has shape",
        ),
        (lambda s: s.clocks.__setitem__(4, -s.clocks[4] - 1), "clock is negative"),
    ],
)
@torch.no_grad()
def test_bad_in_memory_states_are_refused(model, state, edit, message):
    bad = state.clone()
    edit(bad)
    with pytest.raises(ValueError, match=message):
        model(ids_of(2), past_states=[bad])
    with pytest.raises(ValueError, match=message):
        check_state(bad)


# ------------------------------------------------------------------------------------------ files
@pytest.fixture
def saved(state, tmp_path):
    path = tmp_path / "serpent.safetensors"
    state.save(path)
    return path


def _set(name, fn):
    def edit(tensors, meta):
        tensors[name] = fn(tensors[name])

    return edit


def _unsort_valid(t):
    t = t.clone()
    t[:, 0], t[:, -1] = True, False
    return t


CRAFTED = [
    ("missing extra", lambda t, m: t.pop("resample.clock.3"), r"missing tensors \['resample.clock.3'\]"),
    (
        "extra layer",
        lambda t, m: t.update({"resample.clock.6": t["resample.clock.0"].clone()}),
        r"unexpected tensors \['resample.clock.6'\]",
    ),
    (
        "inputs shape",
        _set("resample.inputs.1", lambda t: t[:, :, :-1].contiguous()),
        "layer 1 resampling window inputs has shape",
    ),
    ("clock int32", _set("resample.clock.0", lambda t: t.int()), "layer 0 resampling clock is torch.int32"),
    (
        "valid uint8",
        _set("resample.valid.2", lambda t: t.to(torch.uint8)),
        "layer 2 resampling window valid mask is torch.uint8",
    ),
    ("last output fp64", _set("resample.last_output.5", lambda t: t.double()), "last output is torch.float64"),
    ("negative clock", _set("resample.clock.4", lambda t: -t - 1), "layer 4 resampling clock is negative"),
    ("times after clock", _set("resample.times.1", lambda t: t + (1 << 40)), r"lie in \[0, clock\]"),
    ("valid not aligned", _set("resample.valid.0", _unsort_valid), "not right aligned"),
    (
        "nan inputs",
        _set("resample.inputs.5", lambda t: t.index_fill(1, torch.tensor([2]), float("nan"))),
        "window inputs contain NaN",
    ),
    ("layers vs branches", lambda t, m: m.update(num_layers=2), "config has 6 layers, the metadata says 2"),
    ("architecture mamba", lambda t, m: m.update(architecture="mamba"), "metadata says 'mamba'"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_crafted_files_are_refused(model, saved, edit, message):
    path = craft(saved, saved.parent / "crafted.safetensors", edit)
    for kwargs in ({}, {"model": model}):
        with pytest.raises(ValueError, match=message):
            ComposableMambaCache.load(path, **kwargs)


# ------------------------------------------------------------------------------------------ store
def test_a_state_store_of_a_serpent_model(tmp_path):
    """A StateStore keeps SeRpEnt states with their resampling state: add, get (each entry equal to
    encoding it alone), retrieve, generate, compact, reopen; a store of another model is refused."""
    from store_helpers import BagOfWords, CharTokenizer

    model = tiny(vocab_size=99)
    tokenizer = CharTokenizer()
    texts = ["the cat sat on the mat", "dogs bark loudly at night", "a short one", "cats and dogs"]
    store = hsc.StateStore(tmp_path / "s", model, tokenizer, retriever=BagOfWords())
    ids = store.add(texts, show_progress=False, batch_size=3)
    with torch.no_grad():
        alone = [ComposableMambaCache.encode(model, torch.tensor([tokenizer(t)["input_ids"]])) for t in texts]
    for got, expected in zip(store.get(ids), alone):
        assert type(got) is ComposableSeRpEntCache
        assert_states_equal(got, expected, clock_atol=64)  # the store encodes padded batches
    query = ids_of(4, seed=93)
    expected = model.generate(query, past_states=alone[:2], max_new_tokens=NEW, do_sample=False)
    assert torch.equal(
        model.generate(query, past_states=store.get(ids[:2]), max_new_tokens=NEW, do_sample=False), expected
    )
    assert store.retrieve("the cat", k=1)[0].text == texts[0]
    store.delete(ids[1])
    store.compact()
    again = hsc.StateStore(tmp_path / "s", model, tokenizer, retriever=BagOfWords())
    assert set(again.ids()) == {ids[0], ids[2], ids[3]}
    assert_states_equal(again.get(ids[3]), alone[3], clock_atol=64)
    with pytest.raises(ValueError, match="another model"):
        hsc.StateStore(tmp_path / "s", tiny(seed=3, vocab_size=99), tokenizer, retriever=BagOfWords())
