"""StateStore: round trips, retrieval, delete/compact, storage dtype, corruption, crashes, concurrency."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc

from helpers import tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer

TESTS = str(Path(__file__).parent)


def make_store(path, model, **kwargs):
    return hsc.StateStore(path, model, CharTokenizer(), retriever=kwargs.pop("retriever", BagOfWords()), **kwargs)


def encode_alone(model, text):
    return hsc.ComposableMambaCache.encode(model, torch.tensor([CharTokenizer()(text)["input_ids"]]))


def assert_same_state(actual, expected, rtol=1e-5, atol=1e-6):
    assert actual.num_layers == expected.num_layers
    for layer in range(actual.num_layers):
        torch.testing.assert_close(actual.ssm_states[layer], expected.ssm_states[layer], rtol=rtol, atol=atol)
        torch.testing.assert_close(actual.conv_states[layer], expected.conv_states[layer], rtol=rtol, atol=atol)
        torch.testing.assert_close(actual.delta_sums[layer], expected.delta_sums[layer], rtol=rtol, atol=atol)
        torch.testing.assert_close(actual.A[layer], expected.A[layer])
    assert torch.equal(actual.token_ids, expected.token_ids)
    assert actual.num_tokens.tolist() == expected.num_tokens.tolist()


def test_add_get_round_trip_equals_encoding_each_text_alone(tmp_path, model):
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS, metadata=[{"n": i} for i in range(len(TEXTS))], batch_size=3, show_progress=False)
    assert len(ids) == len(set(ids)) == len(TEXTS) == len(store)
    states = store.get(ids)
    for text, state in zip(TEXTS, states):
        assert_same_state(state, encode_alone(model, text))
    assert [e.metadata["n"] for e in store.entries(ids)] == list(range(len(TEXTS)))
    assert store.stats()["shards"] == 3  # batches of 3, 3, 1
    # a stored state works as past_states: one state + query == generate(context + query)
    query = torch.tensor([CharTokenizer()("what?")["input_ids"]])
    alone = model.generate(query, past_states=[store.get(ids[2])], max_new_tokens=6, do_sample=False)
    full = model.generate(
        torch.cat([encode_alone(model, TEXTS[2]).token_ids, query], 1), max_new_tokens=6, do_sample=False
    )
    assert torch.equal(alone[:, -6:], full[:, -6:])


def test_reopen_sees_everything_and_refuses_other_model_retriever_dtype(tmp_path, arch):
    model = tiny_model(arch)
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    again = make_store(tmp_path / "s", tiny_model(arch))  # same seed: same weights, same fingerprint
    assert again.ids() == store.ids() and set(ids) == set(again.ids())
    with pytest.raises(ValueError, match="another model"):
        make_store(tmp_path / "s", tiny_model(arch, seed=1))
    with pytest.raises(ValueError, match="another model"):
        make_store(tmp_path / "s", tiny_model("mamba2" if arch == "mamba" else "mamba"))

    class Other(BagOfWords):
        name = "other"

    with pytest.raises(ValueError, match="retriever"):
        make_store(tmp_path / "s", model, retriever=Other())
    with pytest.raises(ValueError, match="stores fp32"):
        make_store(tmp_path / "s", model, storage_dtype="bf16")


def test_retrieve_ranks_by_similarity_with_states(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS, show_progress=False)
    top = store.retrieve("which town is known for wool?", k=3)
    assert top[0].id == ids[3]
    assert top[0].score >= top[1].score >= top[2].score
    assert_same_state(top[0].state, encode_alone(model, TEXTS[3]))
    assert store.retrieve("wool town", k=0) == []
    assert len(store.retrieve("wool town", k=100)) == len(TEXTS)
    assert ids[3] not in [e.id for e in store.retrieve("known for wool", k=3, exclude=[ids[3]])]
    lean = store.retrieve("wool", k=2, load_states=False)
    assert lean[0].state is None and lean[0].text == TEXTS[3]
    with pytest.raises(ValueError, match="query"):
        store.retrieve("", k=2)
    with pytest.raises(ValueError, match="k must be"):
        store.retrieve("wool", k=-1)


def test_delete_and_compact(tmp_path):
    model = tiny_model("mamba")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS, batch_size=2, show_progress=False)
    before = store.stats()
    store.delete([ids[0], ids[3]])
    assert len(store) == len(TEXTS) - 2 and ids[0] not in store
    with pytest.raises(KeyError):
        store.get(ids[0])
    with pytest.raises(KeyError):
        store.delete(ids[0])
    assert ids[0] not in [e.id for e in store.retrieve("red fox fence", k=len(TEXTS))]
    assert store.stats()["deleted_pending"] == 2
    report = store.compact()
    assert report["removed_entries"] == 2 and report["rewritten_shards"] == 2
    after = store.stats()
    assert after["deleted_pending"] == 0 and after["entries"] == len(TEXTS) - 2
    assert after["bytes"] < before["bytes"]
    assert not any((tmp_path / "s" / "deleted").iterdir())
    for entry_id in store.ids():  # survivors intact (checksums verified on read) and unchanged
        text = store.entries([entry_id])[0].text
        assert_same_state(store.get(entry_id), encode_alone(model, text))
    assert store.retrieve("honey bees summer", k=1)[0].id == ids[4]  # the index survives compaction


def test_bf16_storage_halves_state_bytes_and_stays_close(tmp_path):
    model = tiny_model("mamba2")
    fp32 = make_store(tmp_path / "a", model)
    bf16 = make_store(tmp_path / "b", model, storage_dtype="bf16")
    ids32, ids16 = fp32.add(TEXTS, show_progress=False), bf16.add(TEXTS, show_progress=False)
    s32, s16 = fp32.stats(), bf16.stats()
    assert s16["storage_dtype"] == "bf16"
    # ssm + conv halve, the fp32 decays stay: a little over half
    assert 0.5 <= s16["state_bytes_per_entry"] / s32["state_bytes_per_entry"] < 0.6
    for a, b in zip(fp32.get(ids32), bf16.get(ids16)):
        assert b.ssm_states[0].dtype == torch.float32  # read back in the model's state dtype
        for layer in range(a.num_layers):
            torch.testing.assert_close(b.ssm_states[layer], a.ssm_states[layer], rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(b.delta_sums[layer], a.delta_sums[layer])  # decays exact


def test_bad_input_is_refused(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    assert store.add([], show_progress=False) == []
    with pytest.raises(ValueError, match="empty"):
        store.add(["fine", "   "], show_progress=False)
    with pytest.raises(ValueError, match="metadata"):
        store.add(["a", "b"], metadata=[{}], show_progress=False)
    with pytest.raises(TypeError):
        store.add(["a"], metadata=[{"x": object()}], show_progress=False)
    with pytest.raises(ValueError, match="storage_dtype"):
        make_store(tmp_path / "t", model, storage_dtype="fp8")
    with pytest.raises(TypeError, match="callable"):
        hsc.StateStore(tmp_path / "u", model, CharTokenizer(), retriever="minilm")

    class NaNRetriever(BagOfWords):
        name = "nan"

        def __call__(self, texts):
            return super().__call__(texts) * float("nan")

    with pytest.raises(ValueError, match="NaN"):
        make_store(tmp_path / "v", model, retriever=NaNRetriever()).add(["a"], show_progress=False)

    class WrongShape(BagOfWords):
        name = "wrong"

        def __call__(self, texts):
            return super().__call__(texts)[:1]

    with pytest.raises(ValueError, match="shape"):
        make_store(tmp_path / "w", model, retriever=WrongShape()).add(["a", "b"], show_progress=False)
    assert len(store) == 0  # nothing half-added


def _shard_of(store, entry_id):
    store.refresh()
    return store.path / "shards" / f"{store._entries[entry_id][0]}.safetensors"


def test_corruption_is_detected_and_other_shards_stay_readable(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:4], batch_size=2, show_progress=False)
    bad = _shard_of(store, ids[0])
    pristine = bad.read_bytes()
    for tensor, what in ((f"{ids[0]}.ssm.1", "checksum"), ("A.0", "A tensors"), ("embeddings", "embeddings")):
        bad.write_bytes(_flip_byte_of(pristine, tensor))
        fresh = make_store(tmp_path / "s", model)  # no embeddings cached yet
        with pytest.raises(ValueError, match=what):
            fresh.retrieve("red fox", k=4) if tensor == "embeddings" else fresh.get(ids[0])
        if tensor != "embeddings":
            with pytest.raises(ValueError, match=what):
                fresh.get(ids[1]) if tensor == "A.0" else fresh.get(ids[0])
    data = bytearray(pristine)
    # get() reads lazily: the other shard's entries load although this shard is damaged
    assert_same_state(store.get(ids[2]), encode_alone(model, TEXTS[2]))
    bad.write_bytes(bytes(data[: len(data) // 3]))  # truncated
    fresh = make_store(tmp_path / "s", model)
    with pytest.raises(ValueError, match="truncated or corrupted"):
        fresh.get(ids[0])
    assert_same_state(fresh.get(ids[3]), encode_alone(model, TEXTS[3]))
    manifest = next((tmp_path / "s" / "shards").glob("*.json"))
    manifest.write_text("{not json")
    with pytest.raises(ValueError, match="corrupted"):
        make_store(tmp_path / "s", model).ids()
    (tmp_path / "s" / "store.json").write_text("{")
    with pytest.raises(ValueError, match=r"store.json"):
        make_store(tmp_path / "s", model)


def _flip_byte_of(data: bytes, tensor: str) -> bytes:
    """Flip one byte in the middle of ``tensor``'s data in a safetensors file."""
    header_len = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + header_len])[tensor]["data_offsets"]
    out = bytearray(data)
    out[8 + header_len + (start + end) // 2] ^= 0xFF
    return bytes(out)


CRASH_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer
import hf_statecompose as hsc
from hf_statecompose.store import folder_disk as store_module

mode, commits = {mode!r}, [0]
original = store_module.atomic_write

def write(path, data):
    is_manifest = path.parent.name == "shards" and path.suffix == ".json"
    if commits[0] == 2 and mode == "before-commit" and is_manifest:
        os.kill(os.getpid(), signal.SIGKILL)  # tensors of batch 3 are in place, its manifest is not
    if commits[0] == 2 and mode == "mid-write" and path.suffix == ".safetensors":
        with open(path.parent / ".tmp-crash", "wb") as handle:  # half a file, never renamed
            handle.write(data[: len(data) // 2])
            handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    original(path, data)
    if is_manifest:
        commits[0] += 1

store_module.atomic_write = write
store = hsc.StateStore({path!r}, tiny_model("mamba2"), CharTokenizer(), retriever=BagOfWords())
store.add(TEXTS, batch_size=2, show_progress=False)
print("not killed")
"""


def _run(script, **env):
    return subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("mode", ["before-commit", "mid-write"])
def test_a_process_killed_mid_add_leaves_every_completed_batch(tmp_path, mode):
    path = str(tmp_path / "s")
    proc = _run(CRASH_SCRIPT.format(tests=TESTS, mode=mode, path=path))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == -9, (out, err[-2000:])
    model = tiny_model("mamba2")
    store = make_store(path, model)
    assert len(store) == 4  # two batches of two were committed before the kill
    for entry in store.entries():
        assert_same_state(store.get(entry.id), encode_alone(model, entry.text))
    assert sorted(e.text for e in store.entries()) == sorted(TEXTS[:4])
    leftovers = (
        store.stats()["orphan_files"] if mode == "before-commit" else len(list((Path(path) / "shards").glob(".tmp-*")))
    )
    assert leftovers == 1
    store.compact()
    assert store.stats()["orphan_files"] == 0 and not list((Path(path) / "shards").glob(".tmp-*"))
    assert len(store.add(TEXTS[4:], show_progress=False)) == 3 and len(store) == 7  # and it keeps working


WRITER_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer
import hf_statecompose as hsc
store = hsc.StateStore({path!r}, tiny_model("mamba2"), CharTokenizer(), retriever=BagOfWords())
for round in range(3):
    store.add([f"writer {{sys.argv[1]}} round {{round}}: " + t for t in TEXTS[:4]], batch_size=2, show_progress=False)
print("done")
"""


def test_two_processes_adding_at_once_do_not_corrupt_the_store(tmp_path):
    path = str(tmp_path / "s")
    script = WRITER_SCRIPT.format(tests=TESTS, path=path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(w)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0 and "done" in out, err[-2000:]
    model = tiny_model("mamba2")
    store = make_store(path, model)
    assert len(store) == 2 * 3 * 4
    texts = sorted(e.text for e in store.entries())
    assert texts == sorted(f"writer {w} round {r}: {t}" for w in range(2) for r in range(3) for t in TEXTS[:4])
    for entry in store.entries()[::5]:
        assert_same_state(store.get(entry.id), encode_alone(model, entry.text))
    assert json.loads((Path(path) / "store.json").read_text())["embedding_dim"] == 64


COMPACTOR_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from store_helpers import BagOfWords, CharTokenizer
import hf_statecompose as hsc
store = hsc.StateStore({path!r}, tiny_model("mamba2"), CharTokenizer(), retriever=BagOfWords())
victims = [e.id for e in store.entries() if e.text.startswith("victim")]
for victim in victims:  # every round rewrites a shard under the reader's feet
    store.delete(victim)
    store.compact()
print("done", len(victims))
"""


def test_readers_keep_working_while_another_process_compacts(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    keep = store.add(TEXTS[:6], batch_size=2, show_progress=False)
    store.add([f"victim {i} " + TEXTS[i % 6] for i in range(12)], batch_size=2, show_progress=False)
    expected = {entry_id: store.get(entry_id) for entry_id in keep}
    proc = _run(COMPACTOR_SCRIPT.format(tests=TESTS, path=str(tmp_path / "s")))
    reads = 0
    while proc.poll() is None or reads == 0:
        for entry_id, state in zip(keep, make_store(tmp_path / "s", model).get(keep)):
            assert_same_state(state, expected[entry_id])
        assert store.retrieve("honey bees summer", k=1)[0].text == TEXTS[4]  # one long-lived reader too
        reads += 1
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "done 12" in out, err[-2000:]
    assert sorted(store.ids()) == sorted(keep) and reads > 1
