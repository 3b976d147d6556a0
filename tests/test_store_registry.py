"""The store backends' registry (issue 29): ``StateStore(path, ..., backend=name)`` dispatches through
``register_backend``; a toy in-memory backend registered here is used with no other edit, and what the registry
cannot use is refused when it is registered (or, for a backend named by its module path, on first use)."""

import sys

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.store import (
    BACKEND_METHODS,
    FolderStateStore,
    StateStore,
    StoreEntry,
    register_backend,
    registered_backends,
    unregister_backend,
)
from hf_statecompose.store import base as store_base
from hf_statecompose.store.format import content_id

from helpers import tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer


class MemoryStore(StateStore):
    """A toy backend: entries in a dict (nothing on disk), the shared checks and encoding of StateStore."""

    backend = "toy"

    def __init__(self, path, model, tokenizer, retriever=None, storage_dtype=None, info=None, backend=None):
        self.path = path
        self._bind(model, tokenizer, retriever, storage_dtype, info)
        self._rows: dict[str, tuple[StoreEntry, torch.Tensor, object]] = {}

    def add(self, texts, metadata=None, batch_size=16, show_progress=True):
        texts, metadata, _ = self._check_add(texts, metadata, batch_size)
        ids = []
        for text, meta in zip(texts, metadata):
            entry_id = content_id(text, meta)
            if entry_id not in self._rows:
                input_ids, mask, tokens = self._tokenize([text])
                state = hsc.ComposableMambaCache.encode(self.model, input_ids, attention_mask=mask)
                self._rows[entry_id] = (StoreEntry(entry_id, text, meta, len(tokens[0])), self._embed([text])[0], state)
            ids.append(entry_id)
        return ids

    def get(self, ids, device=None):
        single, ids = self._check_one_or_many(ids)
        states = [self._rows[i][2] for i in ids]
        return states[0] if single else states

    def retrieve(self, query, k=5, exclude=(), load_states=True):
        k, excluded = self._check_query(query, k, exclude)
        vector = self._embed([query])[0]
        ranked = sorted(
            ((float(row[1] @ vector), row) for i, row in self._rows.items() if i not in excluded),
            key=lambda pair: -pair[0],
        )[:k]
        return [
            StoreEntry(e.id, e.text, e.metadata, e.num_tokens, score=score, state=state if load_states else None)
            for score, (e, _, state) in ranked
        ]

    def delete(self, ids, missing_ok=False):
        for entry_id in self._check_one_or_many(ids)[1]:
            self._rows.pop(entry_id, None)

    def compact(self):
        return {}

    def entries(self, ids=None):
        return [self._rows[i][0] for i in (self._rows if ids is None else self._check_ids(ids, "ids"))]

    def ids(self):
        return list(self._rows)

    def refresh(self):
        pass

    def stats(self):
        return {"entries": len(self._rows)}

    def __len__(self):
        return len(self._rows)

    def __contains__(self, entry_id):
        return entry_id in self._rows


@pytest.fixture
def toy():
    register_backend("toy", MemoryStore)
    yield MemoryStore
    unregister_backend("toy")


@pytest.fixture(scope="module")
def model():
    return tiny_model("mamba2")


def test_a_registered_toy_backend_is_what_state_store_opens(tmp_path, model, toy):
    assert registered_backends()[:2] == ["folder", "lance"] and "toy" in registered_backends()
    store = hsc.StateStore(tmp_path / "unused", model, CharTokenizer(), retriever=BagOfWords(), backend="toy")
    assert type(store) is MemoryStore and isinstance(store, StateStore) and not (tmp_path / "unused").exists()
    ids = store.add(TEXTS[:4], show_progress=False)
    assert store.add(TEXTS[:1], show_progress=False) == ids[:1] and len(store) == 4
    expected = hsc.encode(model, torch.tensor([CharTokenizer()(TEXTS[3])["input_ids"]]))
    got = store.get(ids[3])
    assert torch.equal(got.ssm_states[0], expected.ssm_states[0]) and torch.equal(
        got.delta_sums[0], expected.delta_sums[0]
    )
    # the rest of the package uses it as any store: retrieval, composition and generation
    out = hsc.generate_with_retrieval(
        model, CharTokenizer(), "the mountain town wool", store, k=2, composition="soup", max_new_tokens=2
    )
    assert (
        out.retrieved[0].id == ids[3]
        and len(out.sequences[0]) == len(CharTokenizer()("the mountain town wool")["input_ids"]) + 2
    )
    # the shared argument checks come with StateStore
    with pytest.raises(TypeError, match="single string"):
        store.add("one text")
    # the same without the backend keyword is the folder store
    assert type(hsc.StateStore(tmp_path / "f", model, CharTokenizer(), retriever=BagOfWords())) is FolderStateStore


def test_an_unknown_backend_name_lists_the_registered_ones(tmp_path, model, toy):
    for bad in ("nope", "", 42, ["folder"]):
        with pytest.raises(ValueError, match=r"unknown store backend .*registered: 'folder', 'lance', 'toy'"):
            hsc.StateStore(tmp_path / "s", model, CharTokenizer(), retriever=BagOfWords(), backend=bad)
    # a backend class refuses another backend's name, and an unknown one with the registry's message
    with pytest.raises(ValueError, match="is the 'folder' backend"):
        FolderStateStore(tmp_path / "s", model, CharTokenizer(), retriever=BagOfWords(), backend="toy")
    with pytest.raises(ValueError, match="unknown store backend 'nope'"):
        FolderStateStore(tmp_path / "s", model, CharTokenizer(), retriever=BagOfWords(), backend="nope")
    assert not (tmp_path / "s").exists()


def test_what_the_registry_cannot_use_is_refused_when_registered(toy):
    class Incomplete(StateStore):
        backend = "half"

        def add(self, texts, metadata=None, batch_size=16, show_progress=True):
            return []

    with pytest.raises(TypeError, match="does not implement get, retrieve, delete"):
        register_backend("half", Incomplete)
    with pytest.raises(TypeError, match="cannot open a store with Incomplete: it does not implement get"):
        Incomplete("p", None, None)  # as an abstract class would be refused (before __init__ runs)
    with pytest.raises(TypeError, match="subclass of StateStore"):
        register_backend("plain", dict)
    with pytest.raises(TypeError, match="subclass of StateStore"):
        register_backend("base", StateStore)
    with pytest.raises(ValueError, match=r"MemoryStore.backend is 'toy'; set it to 'other'"):
        register_backend("other", MemoryStore)
    for name in ("", "two words", 3, "a/b"):
        with pytest.raises(ValueError, match="identifier"):
            register_backend(name, MemoryStore)
    with pytest.raises(ValueError, match=r"package\.module:Class"):
        register_backend("lazy", "no_colon_here")
    # a name taken: refused, unless replaced on purpose; registering the same class again is a no-op
    with pytest.raises(ValueError, match="registered already"):
        register_backend("folder", type("Other", (MemoryStore,), {"backend": "folder"}))
    register_backend("toy", MemoryStore)
    replacement = type("Replacement", (MemoryStore,), {})
    register_backend("toy", replacement, replace=True)
    assert store_base.backend_class("toy") is replacement
    with pytest.raises(KeyError, match="no store backend named 'nope'"):
        unregister_backend("nope")
    assert set(BACKEND_METHODS) >= {"add", "get", "retrieve", "delete", "compact", "__len__"}


class LazyStore(MemoryStore):
    backend = "lazytoy"


def test_a_backend_named_by_its_module_path_is_imported_and_checked_on_first_use(tmp_path, model):
    register_backend("lazytoy", f"{__name__}:LazyStore")
    register_backend("missing", f"{__name__}:NoSuchClass")
    register_backend("wrongname", f"{__name__}:MemoryStore")
    try:
        assert store_base._BACKENDS["lazytoy"] == f"{__name__}:LazyStore"  # not imported yet
        store = hsc.StateStore(tmp_path, model, CharTokenizer(), retriever=BagOfWords(), backend="lazytoy")
        assert type(store) is LazyStore and store_base._BACKENDS["lazytoy"] is LazyStore
        register_backend("lazytoy", LazyStore)  # the class registering itself under its path's name: accepted
        with pytest.raises(ValueError, match="has no NoSuchClass"):
            hsc.StateStore(tmp_path, model, CharTokenizer(), backend="missing")
        with pytest.raises(ValueError, match=r"MemoryStore\.backend is 'toy'; set it to 'wrongname'"):
            hsc.StateStore(tmp_path, model, CharTokenizer(), backend="wrongname")
    finally:
        for name in ("lazytoy", "missing", "wrongname"):
            unregister_backend(name)
    assert sys.modules[__name__].LazyStore is LazyStore


def test_lance_is_registered_by_its_module_path_until_used():
    entry = store_base._BACKENDS["lance"]
    assert entry == "hf_statecompose.store.lance:LanceStateStore" or entry.__name__ == "LanceStateStore"
    assert store_base.backend_class("lance").__name__ == "LanceStateStore"
