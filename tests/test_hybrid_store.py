"""Hybrid states (Mamba layers + attention layers) in both stores: add / get / retrieve / delete / compact (and the
Lance store's repair, the folder -> Lance migration) keep every entry's keys, values and positions, verified on every
read as the SSM layers are; ``generate_with_retrieval`` and the command line run end to end on a saved hybrid."""

import json
import shutil
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import cli
from hf_statecompose.state.hybrid_cache import ComposableHybridCache
from hf_statecompose.store import StateStore
from hf_statecompose.store.format import checksum

from architectures import WORKING, tiny_hybrid
from store_helpers import TEXTS, BagOfWords, CharTokenizer

BACKENDS = ["folder", "lance"]
# delta-rule hybrids in the stores: Qwen3.5 (GDN) and Kimi Linear (KDA; its MLA keys and values differ in width)
DELTA_RULE_STORED = ("qwen3_5_text", "kimi_linear")


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_hybrid(arch) for arch in (*WORKING, *DELTA_RULE_STORED)}


def open_store(path, model, backend, **kw):
    if backend == "lance":
        pytest.importorskip("lancedb")
    return StateStore(str(path), model, CharTokenizer(), retriever=BagOfWords(), backend=backend, **kw)


def alone(model, text):
    """The state of ``text`` encoded alone (what a store entry must equal)."""
    return hsc.encode(model, torch.tensor([CharTokenizer()(text)["input_ids"]]))


def assert_keys_equal(state, expected, dtype=None, atol=0.0):
    """Same keys, values (rounded to ``dtype`` first, if given) and positions; ``atol``: encoded in another batch."""
    assert (
        isinstance(state, ComposableHybridCache) and state.attention_layer_indices == expected.attention_layer_indices
    )
    for a, b in zip(state.attention_layers, expected.attention_layers):
        assert a.keys.dtype == b.keys.dtype == state.model_dtype
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            y = y if dtype is None else y.to(dtype).to(y.dtype)
            assert torch.equal(x, y) if not atol else torch.allclose(x, y, rtol=0, atol=atol)
        assert torch.equal(a.positions, b.positions)


@pytest.mark.parametrize(
    "arch,backend",
    [(arch, backend) for arch in (*WORKING, *DELTA_RULE_STORED) for backend in BACKENDS] + [("zamba2", "folder")],
)
def test_entries_hold_the_keys_of_their_context_alone(arch, backend, models, tmp_path):
    if backend == "lance":
        pytest.importorskip("lancedb")
    model = models[arch] if arch in models else tiny_hybrid(arch)
    store = open_store(tmp_path / "s", model, backend)
    ids = store.add(TEXTS[:5], batch_size=3, show_progress=False)  # left-padded batches of different lengths
    states = store.get(ids)
    for text, state in zip(TEXTS[:5], states):
        expected = alone(model, text)
        assert_keys_equal(state, expected, atol=1e-6)  # (a batch may round differently in the layers before)
        assert state.key_mask.all() and state.context_length == len(text)
        for a, b in zip(state.ssm_states, expected.ssm_states):
            assert torch.allclose(a, b, atol=1e-5)
    # retrieve, delete, compact: the remaining entries read back the same
    hits = store.retrieve("the red fox jumps", k=2)
    assert hits[0].text == TEXTS[0] and isinstance(hits[0].state, ComposableHybridCache)
    store.delete([ids[1], ids[3]])
    store.compact()
    for entry_id, before in zip([ids[0], ids[2], ids[4]], [states[0], states[2], states[4]]):
        assert_keys_equal(store.get(entry_id), before)
    # and generation from retrieved states equals generation from the contexts' own states
    result = hsc.generate_with_retrieval(model, CharTokenizer(), "the red fox", store, k=2, max_new_tokens=4)
    query = torch.tensor([CharTokenizer()("the red fox")["input_ids"]])
    expected = model.generate(
        query,
        past_states=[e.state for e in reversed(result.retrieved)],
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
    )
    assert torch.equal(result.sequences, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bf16_store_rounds_the_keys_and_reads_them_in_the_model_dtype(backend, models, tmp_path):
    model = models["granitemoehybrid"]
    store = open_store(tmp_path / "s", model, backend, storage_dtype="bf16")
    state = store.get(store.add(TEXTS[:2], show_progress=False)[1])
    assert_keys_equal(state, alone(model, TEXTS[1]), dtype=torch.bfloat16)


def _set(name, fn):
    return lambda tensors: tensors.__setitem__(name, fn(tensors[name]))


ENTRY_CRAFTS = {
    "keys of another head count": (
        _set("attn.keys.1", lambda k: k[:, :1].contiguous()),
        "keys are torch.float32 (1, 1,",
    ),
    "values in float64": (_set("attn.values.1", lambda v: v.double()), "values are torch.float64"),
    "keys for fewer tokens": (_set("attn.keys.1", lambda k: k[:, :, 1:].contiguous()), "keys are torch.float32"),
    "NaN in the keys": (
        _set("attn.keys.1", lambda k: k.index_fill(2, torch.tensor([0]), float("nan"))),
        "keys hold NaN/inf",
    ),
    "shifted positions": (_set("attn.positions.1", lambda p: p + 1), "positions are not 0 .."),
    "padding positions": (
        _set("attn.positions.1", lambda p: p.index_fill(1, torch.tensor([0]), -1)),
        "positions are not 0 ..",
    ),
    "float positions": (_set("attn.positions.1", lambda p: p.double()), "positions are not 0 .."),
    # issue 29: what no encode makes (a gap, an offset beyond the context, a last position whose + 1 overflows int64)
    "a gap in the positions": (
        _set("attn.positions.1", lambda p: p.index_fill(1, torch.tensor([3]), 9)),
        "positions are not 0 ..",
    ),
    "positions far beyond the context": (_set("attn.positions.1", lambda p: p + 10**9), "positions are not 0 .."),
    "a position at int64's max": (
        _set(
            "attn.positions.1", lambda p: p.index_fill(1, torch.tensor([p.shape[1] - 1]), torch.iinfo(torch.int64).max)
        ),
        "positions are not 0 ..",
    ),
}


@pytest.mark.parametrize("case", list(ENTRY_CRAFTS))
def test_folder_entries_with_crafted_keys_are_refused(case, models, tmp_path):
    model = models["nemotron_h"]  # layers M * - M: the attention layer is model layer 1
    store = open_store(tmp_path / "s", model, "folder")
    entry_id = store.add(TEXTS[:1], show_progress=False)[0]
    store.get(entry_id)
    sid, row = store._entries[entry_id]
    handle, _ = store._open_shard(sid)
    with handle:
        tensors = store._read_entry_tensors(handle, sid, entry_id, 2)
    assert "attn.keys.1" in tensors and "attn.positions.1" in tensors
    edit, message = ENTRY_CRAFTS[case]
    edit(tensors)
    record = dict(store._manifests[sid]["entries"][row], checksum=checksum(tensors))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("..", r"\.\.")):
        store._verify_entry(sid, record, tensors, 2)


def test_a_corrupted_folder_shard_is_refused(models, tmp_path):
    model = models["bamba"]
    store = open_store(tmp_path / "s", model, "folder")
    entry_id = store.add(TEXTS[:1], show_progress=False)[0]
    store.get(entry_id)
    sid, _ = store._entries[entry_id]
    path = store._shard_path(sid)
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little") + 8
    start = json.loads(bytes(data[8:header]))[f"{entry_id}.attn.keys.1"]["data_offsets"][0]
    data[header + start + 2] ^= 0x10
    path.write_bytes(bytes(data))
    fresh = open_store(tmp_path / "s", model, "folder")
    with pytest.raises(ValueError, match="does not match its checksum"):
        fresh.get(entry_id)


def test_lance_entries_with_crafted_keys_are_refused(models, tmp_path):
    pytest.importorskip("lancedb")
    from safetensors.torch import load, save

    from hf_statecompose.state.serialization import _digest
    from hf_statecompose.store.lance import row_seal

    model = models["nemotron_h"]
    store = open_store(tmp_path / "s", model, "lance")
    entry_id = store.add(TEXTS[:1], show_progress=False)[0]
    row = store._rows([entry_id], ["id", "text", "metadata", "num_tokens", "vector", "state", "tensor_digest", "seal"])[
        entry_id
    ]
    for edit, message in (
        (_set("attn.positions.1", lambda p: p + 1), r"positions are not 0 \.\."),
        (_set("attn.positions.1", lambda p: p.index_fill(1, torch.tensor([3]), 9)), r"positions are not 0 \.\."),
        (_set("attn.positions.1", lambda p: p + 10**9), r"positions are not 0 \.\."),
        (
            _set("attn.positions.1", lambda p: p.index_fill(1, torch.tensor([2]), torch.iinfo(torch.int64).max)),
            r"positions are not 0 \.\.",
        ),
        (_set("attn.values.1", lambda v: v[..., :4].contiguous()), "values are torch.float32"),
        (lambda t: t.pop("attn.keys.1"), "it should not"),
    ):
        tensors = load(bytes(row["state"]))
        edit(tensors)
        digest = _digest(tensors)
        meta = {**store._blob_meta, "tensor_digest": digest}
        crafted = dict(row, state=save(tensors, metadata={"hf_statecompose": json.dumps(meta)}), tensor_digest=digest)
        vector = torch.tensor(row["vector"], dtype=torch.float32).numpy().tobytes()
        crafted["seal"] = row_seal(entry_id, row["text"], row["metadata"], row["num_tokens"], vector, digest)
        with pytest.raises(ValueError, match=message):
            store._read_state(crafted, "cpu")


def test_lance_repair_and_migration_keep_the_keys(models, tmp_path):
    pytest.importorskip("lancedb")
    from hf_statecompose.store.migrate import migrate

    model = models["nemotron_h"]
    folder = open_store(tmp_path / "folder", model, "folder")
    ids = folder.add(TEXTS[:3], show_progress=False)
    counts = migrate(
        str(tmp_path / "folder"),
        str(tmp_path / "lance"),
        model,
        CharTokenizer(),
        retriever=BagOfWords(),
        show_progress=False,
    )
    assert counts["verified"] == 3
    lance = open_store(tmp_path / "lance", model, "lance")
    for entry_id in ids:
        assert_keys_equal(lance.get(entry_id), folder.get(entry_id))
    rows = lance.encode_rows([TEXTS[4]], [{}], ["00000000000000aa"])
    lance.write_rows(rows, skip_existing=False)
    lance.write_rows(rows, skip_existing=False)  # the same id twice (a writer outside this API)
    report = lance.repair()
    assert report["duplicated"] == 1 and report["removed_copies"] == 1 and not report["unverifiable"]
    assert_keys_equal(lance.get("00000000000000aa"), alone(model, TEXTS[4]))


def test_a_store_refuses_another_hybrid_model(models, tmp_path):
    open_store(tmp_path / "s", models["nemotron_h"], "folder").add(TEXTS[:1], show_progress=False)
    with pytest.raises(ValueError, match="was built with another model"):
        open_store(tmp_path / "s", tiny_hybrid("nemotron_h", seed=1), "folder")


@pytest.fixture(params=["nemotron_h", "qwen3_5_text"])
def saved_hybrid(tmp_path, request):
    """A tiny random NemotronH (Mamba-2 layers) or Qwen3.5 (gated DeltaNet layers) saved with save_pretrained, beside
    the demo model's tokenizer."""
    demo = Path(cli.__file__).parent / "demo" / "models" / "mamba2"
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    model = tiny_hybrid(request.param, vocab_size=vocab)
    folder = tmp_path / "hybrid"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, folder / name)
    (tmp_path / "passages.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:4]))
    return folder


def test_the_command_line_builds_and_queries_a_hybrid_store(saved_hybrid, tmp_path, capsys, monkeypatch):
    from hf_statecompose.cli import main

    monkeypatch.setattr("hf_statecompose.retrieval.default_retriever", BagOfWords)
    store = tmp_path / "store"
    assert (
        main(["build", str(store), str(tmp_path / "passages.jsonl"), "--model", str(saved_hybrid), "--batch-size", "3"])
        == 0
    )
    capsys.readouterr()
    assert main(["query", str(store), TEXTS[0][:20], "-k", "2", "--max-new-tokens", "3", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["retrieved"][0]["text"] == TEXTS[0]
    # the same answer in Python, from the states the store holds
    model, tokenizer = cli.load_model(str(saved_hybrid))
    opened = StateStore(str(store), model, tokenizer, retriever=BagOfWords())
    result = hsc.generate_with_retrieval(
        model, tokenizer, TEXTS[0][:20], opened, k=2, max_new_tokens=3, do_sample=False
    )
    assert result.text == answer["generated"]
    assert main(["stats", str(store)]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 4


def test_the_command_line_places_the_attention_keys(saved_hybrid, tmp_path, capsys, monkeypatch):
    from hf_statecompose.cli import main
    from hf_statecompose.composition.attention import ATTENTION_POLICIES

    assert cli.ATTENTION_POLICIES == ATTENTION_POLICIES
    monkeypatch.setattr("hf_statecompose.retrieval.default_retriever", BagOfWords)
    store = tmp_path / "store"
    assert main(["build", str(store), str(tmp_path / "passages.jsonl"), "--model", str(saved_hybrid)]) == 0
    model, tokenizer = cli.load_model(str(saved_hybrid))
    opened = StateStore(str(store), model, tokenizer, retriever=BagOfWords())
    for attention in ("concat", "shared"):
        capsys.readouterr()
        assert (
            main(
                [
                    "query",
                    str(store),
                    TEXTS[1][:20],
                    "-k",
                    "3",
                    "--max-new-tokens",
                    "4",
                    "--json",
                    "--attention",
                    attention,
                ]
            )
            == 0
        )
        answer = json.loads(capsys.readouterr().out)
        composer = hsc.StateComposer("picaso_r", attention=attention)
        result = hsc.generate_with_retrieval(
            model, tokenizer, TEXTS[1][:20], opened, k=3, composition=composer, max_new_tokens=4
        )
        assert answer["generated"] == result.text
    # a store of a model without attention layers refuses the option in one line
    (tmp_path / "one.txt").write_text(TEXTS[0])
    assert main(["build", str(tmp_path / "mamba"), str(tmp_path / "one.txt")]) == 0  # the demo Mamba-2
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["query", str(tmp_path / "mamba"), "red fox", "--attention", "shared"])
    code = done.value.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--attention applies to hybrid models" in err


def test_continuation_losses_of_hybrid_states_of_different_lengths(models):
    from hf_statecompose.pipeline import continuation_losses

    from helpers import random_ids

    model = models["nemotron_h"]
    generator = torch.Generator().manual_seed(5)
    contexts = [random_ids(n, generator=generator) for n in (5, 11)]
    query, continuation = random_ids(3, generator=generator), random_ids(4, generator=generator)
    states = [hsc.encode(model, ids) for ids in contexts]
    together = continuation_losses(
        model, [states[0], None, states[1]], query, continuation
    )  # stacked: keys left padded
    for k, state in ((0, states[0]), (2, states[1])):
        assert torch.allclose(together[k], continuation_losses(model, [state], query, continuation)[0], atol=1e-6)
    # and a state's loss is the loss after its context tokens (NemotronH's path is exact)
    full = torch.cat([contexts[1], query, continuation], 1)
    logits = model(full).logits[0, -5:-1].double()
    assert torch.allclose(together[2], torch.nn.functional.cross_entropy(logits, continuation[0]), atol=1e-5)
