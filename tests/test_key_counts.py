"""A hybrid state's attention keys agree with its own token count, an encoded state's keys sit exactly where its
encode put them, and a context of no tokens is refused everywhere (issue 41: F2, F3, F5 of the adversarial trial).

* F2: one key, value and position dropped from every attention layer of a state file (resealed) loaded, and moved
  the logits; now ``num_tokens`` (and ``token_ids``) bound the number of real keys per row.
* F3: key positions all 0 in a state that carries ``token_ids`` passed (as ``attention='shared'`` placement); an
  encoded state's positions must now be -1 for each padding slot, then ``0, 1, ..., n - 1``.
* F5: a state of ``num_tokens == 0`` loaded, and composed last it replaced the previous state's conv window with
  zeros; now refused at load, store read and write, ``past_states``, compose and encode ("a context of no tokens").

Every architecture with keys (the Mamba hybrids and the delta-rule hybrids) for F2 / F3; Mamba, Mamba-2, a Mamba
hybrid, a delta-rule hybrid, SeRpEnt and COFFEE with every composition method for F5."""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import compat
from hf_statecompose.composition import StateComposer
from hf_statecompose.ops.compose.methods import METHODS
from hf_statecompose.state.cache import ComposableMambaCache
from hf_statecompose.state.validation import check_state
from hf_statecompose.store import StateStore
from hf_statecompose.store.format import checksum

from architectures import ARCHITECTURES, WORKING, hybrid_params, left_pad, tiny_hybrid
from helpers import craft, random_ids
from store_helpers import TEXTS, BagOfWords, CharTokenizer

F2 = r"row 0's attention layers hold 5 keys \(positions >= 0\) but the state has 6 tokens \(num_tokens\): an encoded"
F3 = r"row \d's key positions are not those of an encoding of its \d+ tokens \(the state carries token_ids\)"
F5 = r"is a context of no tokens\b.*it has no state to compose or continue"


@pytest.fixture(scope="module")
def models():
    return {}


def model_of(models, arch):
    if arch not in models:
        models[arch] = tiny_hybrid(arch)
    return models[arch]


def padded_batch(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return left_pad([random_ids(n, generator=generator)[0] for n in lengths])


def _attention_names(tensors, kind):
    return [name for name in tensors if name.startswith(f"attn.{kind}.")]


def drop_last_key(tensors, meta):
    """F2: the last key, value and position of every attention layer dropped (every row loses one key)."""
    for kind in ("keys", "values"):
        for name in _attention_names(tensors, kind):
            tensors[name] = tensors[name][:, :, :-1].contiguous()
    for name in _attention_names(tensors, "positions"):
        tensors[name] = tensors[name][:, :-1].contiguous()


def zero_positions(tensors, meta):
    """F3: every real key at position 0 (padding kept at -1), the same in every attention layer."""
    for name in _attention_names(tensors, "positions"):
        tensors[name] = torch.where(tensors[name] >= 0, 0, -1)


def _edit_state(state, keys_fn, positions_fn):
    """The in-memory edit of every attention layer (one positions tensor, as encode makes it)."""
    first = state.attention_layers[0].positions
    positions = positions_fn(first)
    for layer in state.attention_layers:
        layer.fill_keys(keys_fn(layer.keys), keys_fn(layer.values), positions)
    return state


IN_MEMORY = {
    "F2": (lambda t: t[:, :, :-1], lambda p: p[:, :-1], F2),
    "F3": (lambda t: t, lambda p: torch.where(p >= 0, 0, -1), F3),
}


# ------------------------------------------------------------------------------------------ F2 / F3: state files
@pytest.mark.parametrize("arch", hybrid_params())
@pytest.mark.parametrize("case", ["F2", "F3"])
def test_a_file_whose_keys_disagree_with_its_tokens_is_refused(arch, case, models, tmp_path):
    model = model_of(models, arch)
    source = tmp_path / "s.safetensors"
    state = hsc.encode(model, *padded_batch([6, 4], seed=2))
    state.save(source)
    ComposableMambaCache.load(source, model=model)  # the untouched file loads
    edit, message = (drop_last_key, F2) if case == "F2" else (zero_positions, F3)
    path = craft(source, tmp_path / "crafted.safetensors", edit)
    for kwargs in ({}, {"model": model}):
        with pytest.raises(ValueError, match=message):
            ComposableMambaCache.load(path, **kwargs)


# ------------------------------------------------------------------------------------------ F2 / F3: past_states
@pytest.mark.parametrize("arch", hybrid_params())
@pytest.mark.parametrize("case", ["F2", "F3"])
def test_past_states_whose_keys_disagree_with_their_tokens_are_refused(arch, case, models):
    model = model_of(models, arch)
    keys_fn, positions_fn, message = IN_MEMORY[case]
    good = hsc.encode(model, random_ids(4, generator=torch.Generator().manual_seed(1)))
    bad = _edit_state(hsc.encode(model, *padded_batch([6, 4], seed=2)).select([0]), keys_fn, positions_fn)
    query = random_ids(3, generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=message):
        check_state(bad)
    with pytest.raises(ValueError, match=message.replace("row 0's", r"row \d's")):
        model(query, past_states=[good, bad])
    with pytest.raises(ValueError, match=message):
        StateComposer("caso").compose([good, bad])


# ------------------------------------------------------------------------------------------ F2 / F3: store reads
def _folder_store(path, model):
    return StateStore(str(path), model, CharTokenizer(), retriever=BagOfWords(), backend="folder")


def _read_folder_entry(store, entry_id, edit=None, record_edit=None):
    """Read ``entry_id`` as ``store.get`` does (verify, then build and check the state), after ``edit(tensors)`` and
    ``record_edit(record)`` with a fresh checksum: an entry only the checks of its contents can refuse."""
    store.get(entry_id)  # the store as a read finds it (its manifests loaded)
    sid, row = store._entries[entry_id]
    handle, _ = store._open_shard(sid)
    with handle:
        A = store._shard_A(handle, sid, store._manifests[sid]["shared_checksum"])
        num_layers = len(A)
        tensors = store._read_entry_tensors(handle, sid, entry_id, num_layers)
    if edit is not None:
        edit(tensors, None)
    record = dict(store._manifests[sid]["entries"][row])
    if record_edit is not None:
        record_edit(record)
    record["checksum"] = checksum(tensors)
    store._verify_entry(sid, record, tensors, num_layers)
    return store._state(tensors, record, A, "cpu")


@pytest.mark.parametrize("arch", [*WORKING, "qwen3_5_text", "kimi_linear"])
@pytest.mark.parametrize("case", ["F2", "F3"])
def test_folder_entries_whose_keys_disagree_with_their_tokens_are_refused(arch, case, models, tmp_path):
    model = model_of(models, arch)
    store = _folder_store(tmp_path / "s", model)
    entry_id = store.add(TEXTS[:1], show_progress=False)[0]
    check_state(_read_folder_entry(store, entry_id))  # the untouched entry reads
    edit = drop_last_key if case == "F2" else zero_positions
    with pytest.raises(ValueError, match=r"(attention\) keys are .* for its \d+ tokens|positions are not 0 \.\.)"):
        _read_folder_entry(store, entry_id, edit)


def test_lance_entries_whose_keys_disagree_with_their_tokens_are_refused(models, tmp_path):
    pytest.importorskip("lancedb")
    import json

    from safetensors.torch import load, save

    from hf_statecompose.state.serialization import _digest
    from hf_statecompose.store.lance import row_seal

    model = model_of(models, "nemotron_h")
    store = StateStore(str(tmp_path / "s"), model, CharTokenizer(), retriever=BagOfWords(), backend="lance")
    entry_id = store.add(TEXTS[:1], show_progress=False)[0]
    columns = ["id", "text", "metadata", "num_tokens", "vector", "state", "tensor_digest", "seal"]
    row = store._rows([entry_id], columns)[entry_id]

    def crafted(edit, num_tokens=None):
        tensors = load(bytes(row["state"]))
        edit(tensors, None)
        count = row["num_tokens"] if num_tokens is None else num_tokens
        digest = _digest(tensors)
        meta = {**store._blob_meta, "tensor_digest": digest}
        out = dict(row, state=save(tensors, metadata={"hf_statecompose": json.dumps(meta)}), tensor_digest=digest)
        out["num_tokens"] = count
        vector = torch.tensor(row["vector"], dtype=torch.float32).numpy().tobytes()
        out["seal"] = row_seal(entry_id, row["text"], row["metadata"], count, vector, digest)
        return out

    for edit in (drop_last_key, zero_positions):
        with pytest.raises(ValueError, match=r"(attention\) keys are .* for its \d+ tokens|positions are not 0 \.\.)"):
            store._read_state(crafted(edit), "cpu")

    def empty(tensors, meta):  # F5: an entry of no tokens, every tensor of that length
        drop = tensors["token_ids"].shape[1]
        for kind in ("keys", "values"):
            for name in _attention_names(tensors, kind):
                tensors[name] = tensors[name][:, :, drop:].contiguous()
        for name in _attention_names(tensors, "positions"):
            tensors[name] = tensors[name][:, drop:].contiguous()
        tensors["token_ids"] = tensors["token_ids"][:, drop:].contiguous()
        tensors["num_tokens"] = torch.tensor([0])

    with pytest.raises(ValueError, match=r"its record says 0 tokens: a context of no tokens; it has no state"):
        store._read_state(crafted(empty, num_tokens=0), "cpu")


# ------------------------------------------------------------------------------------------ legitimate states pass
@pytest.mark.parametrize("arch", hybrid_params())
def test_encoded_composed_and_continued_states_pass(arch, models, tmp_path):
    """Every state an encode, a composition (each attention policy, each method) or a continuation makes passes the
    new checks: it is saved and loaded back."""
    model = model_of(models, arch)
    states = [hsc.encode(model, *padded_batch([6, 4], seed=s)) for s in (1, 2)]
    made = list(states)
    made.append(ComposableMambaCache.stack([states[0].select([1]), states[1].select([0])]))
    for attention in ("concat", "shared", "none"):
        for method in METHODS:
            extra = {"weights": [0.5, 0.5]} if METHODS[method].user_weights else {}
            made.append(StateComposer(method, attention=attention, **extra).compose(states, model=model))
        made.append(StateComposer("caso", attention=attention).compose(states[:1], model=model))
    query = random_ids(3, batch=2, generator=torch.Generator().manual_seed(4))
    for attention in ("concat", "shared", "none"):
        out = model(query, past_states=states, composition=StateComposer("caso", attention=attention), use_cache=True)
        made.append(compat.output_cache(out))
    for k, state in enumerate(made):
        check_state(state, where=f"made[{k}]")
        state.save(tmp_path / f"{k}.safetensors")
        ComposableMambaCache.load(tmp_path / f"{k}.safetensors", model=model)


def test_composed_states_may_hold_fewer_keys_than_tokens_but_not_more(models):
    model = model_of(models, "bamba")
    states = [hsc.encode(model, random_ids(n, generator=torch.Generator().manual_seed(n))) for n in (5, 3)]
    composed = StateComposer("caso").compose(states)
    assert composed.token_ids is None and composed.num_tokens.tolist() == [8]
    fewer = composed.clone()
    fewer.num_tokens = torch.tensor([9])  # as a continuation of an attention='none' composition: keys of some tokens
    check_state(fewer)
    more = composed.clone()
    more.num_tokens = torch.tensor([7])
    with pytest.raises(
        ValueError, match=r"row 0's attention layers hold 8 keys .* but the state has 7 tokens .*: more"
    ):
        check_state(more)


# ------------------------------------------------------------------------------------------ F5: no tokens
F5_ARCHS = ["mamba", "mamba2", "nemotron_h", "qwen3_5_text", "serpent_mamba", "coffee"]


@pytest.fixture(scope="module")
def f5_models():
    return {}


def _f5_model(f5_models, arch):
    if arch not in f5_models:
        f5_models[arch] = ARCHITECTURES[arch].make(seed=0)
    return f5_models[arch]


def _empty_like(state):
    """A state of no tokens, as the trial's file held: zero SSM states, conv windows and ΣΔ, num_tokens 0."""
    empty = state.clone()
    for layer in empty.state_layers:
        layer.ssm_state.zero_()
        layer.conv_state.zero_()
        layer.delta_sum.zero_()
    for layer in getattr(empty, "attention_layers", ()):
        layer.fill_keys(layer.keys[:, :, :0], layer.values[:, :, :0], layer.positions[:, :0])
    empty.num_tokens = torch.zeros_like(state.num_tokens)
    empty.token_ids = None
    return empty


@pytest.mark.parametrize("arch", F5_ARCHS)
def test_a_state_of_no_tokens_is_refused(arch, f5_models, tmp_path):
    model = _f5_model(f5_models, arch)
    vocab = ARCHITECTURES[arch].vocab
    generator = torch.Generator().manual_seed(0)
    state = hsc.encode(model, torch.randint(3, vocab, (1, 5), generator=generator))
    empty = _empty_like(state)
    query = torch.randint(3, vocab, (1, 3), generator=generator)
    with pytest.raises(ValueError, match=r"state: row 0 " + F5):
        check_state(empty)
    for method in METHODS:  # last in the list, as in the trial, and first
        extra = {"weights": [0.5, 0.5]} if METHODS[method].user_weights else {}
        for states in ([state, empty], [empty, state]):
            name = 1 if states[1] is empty else 0
            with pytest.raises(ValueError, match=rf"states\[{name}\]: row 0 " + F5):
                StateComposer(method, **extra).compose(states, model=model)
            with pytest.raises(ValueError, match=r"row 0 " + F5):
                model(query, past_states=states, composition=StateComposer(method, **extra))
    with pytest.raises(ValueError, match=F5):  # save refuses it too (it checks the state)
        empty.save(tmp_path / "empty.safetensors")
    # a file of no tokens (resealed): refused at load, with and without the model
    state.save(tmp_path / "s.safetensors")

    def no_tokens(tensors, meta):
        tensors["num_tokens"] = torch.zeros_like(tensors["num_tokens"])
        tensors.pop("token_ids", None)
        for name in tensors:
            if name.split(".")[0] in ("ssm", "conv", "delta_sum"):
                tensors[name] = torch.zeros_like(tensors[name])

    path = craft(tmp_path / "s.safetensors", tmp_path / "empty.safetensors", no_tokens)
    for kwargs in ({}, {"model": model}):
        with pytest.raises(ValueError, match=r"row 0 " + F5):
            ComposableMambaCache.load(path, **kwargs)


@pytest.mark.parametrize("arch", F5_ARCHS)
def test_encode_refuses_a_context_of_no_tokens(arch, f5_models):
    model = _f5_model(f5_models, arch)
    ids = torch.randint(3, ARCHITECTURES[arch].vocab, (2, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"attention_mask: row 1 " + F5):
        hsc.encode(model, ids, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"input_ids \(shape \(1, 0\)\) " + F5):
        hsc.encode(model, torch.zeros(1, 0, dtype=torch.long))


def test_a_store_refuses_to_write_or_read_a_context_of_no_tokens(models, tmp_path):
    class SilentTokenizer(CharTokenizer):  # "~" makes no token (as a tokenizer may drop what it cannot read)
        def __call__(self, text, **kwargs):
            return super().__call__(text.replace("~", ""), **kwargs)

    model = model_of(models, "nemotron_h")
    store = StateStore(str(tmp_path / "s"), model, SilentTokenizer(), retriever=BagOfWords(), backend="folder")
    with pytest.raises(ValueError, match=r"the tokenizer produced no tokens for '~~~': a context of no tokens; it has"):
        store.add(["~~~"], show_progress=False)
    entry_id = store.add(TEXTS[:1], show_progress=False)[0]

    def record_edit(record):
        record["num_tokens"] = 0

    with pytest.raises(ValueError, match=r"its record says 0 tokens: a context of no tokens; it has no state"):
        _read_folder_entry(store, entry_id, record_edit=record_edit)
