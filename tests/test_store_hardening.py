"""StateStore hardening: ids, sealed manifests and header, compaction killed at every step, checked
arguments, the recorded tokenizer, reads verified once per shard file."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.store import folder_disk as store_module

from helpers import tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer

TESTS = str(Path(__file__).parent)


def make_store(path, model, **kwargs):
    return hsc.StateStore(
        path, model, kwargs.pop("tokenizer", CharTokenizer()), retriever=kwargs.pop("retriever", BagOfWords()), **kwargs
    )


def snapshot(store):
    """What a reader sees: ids, texts and metadata, sorted."""
    return sorted((e.id, e.text, json.dumps(e.metadata, sort_keys=True)) for e in store.entries())


def same_states(a, b):
    return all(
        torch.equal(x, y)
        for layer in range(a.num_layers)
        for x, y in (
            (a.ssm_states[layer], b.ssm_states[layer]),
            (a.conv_states[layer], b.conv_states[layer]),
            (a.delta_sums[layer], b.delta_sums[layer]),
            (a.A[layer], b.A[layer]),
        )
    ) and torch.equal(a.token_ids, b.token_ids)


def manifests(path):
    return {p.stem: json.loads(p.read_text()) for p in (Path(path) / "shards").glob("*.json")}


def files_under(path):
    return {
        str(p.relative_to(path)): p.read_bytes() for p in Path(path).rglob("*") if p.is_file() and p.name != ".lock"
    }


# ------------------------------------------------------------------------------------ ids
def test_ids_that_are_not_store_ids_are_refused_everywhere_and_nothing_outside_changes(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "a" / "b" / "s", model)
    ids = store.add(TEXTS[:2], show_progress=False)
    outside = tmp_path / "a" / "x"
    outside.write_text("precious")
    before = files_under(tmp_path)
    for bad in ("../../x", "../../../a/x", "/etc/passwd", ids[0] + "/..", ids[0].upper(), ""):
        with pytest.raises(ValueError, match="not a store entry id"):
            store.delete(bad)
        with pytest.raises(ValueError, match="not a store entry id"):
            store.delete([ids[1], bad])  # nothing deleted: ids are checked before any file is touched
        with pytest.raises(ValueError, match="not a store entry id"):
            store.get(bad)
        with pytest.raises(ValueError, match="not a store entry id"):
            store.entries([bad])
        with pytest.raises(ValueError, match="not a store entry id"):
            store.retrieve("red fox", k=1, exclude=[bad])
        assert bad not in store
    with pytest.raises(TypeError, match="entry ids"):
        store.retrieve("red fox", k=1, exclude=ids[0])  # one str, not a list
    with pytest.raises(TypeError, match="str"):
        store.get([1234])
    assert files_under(tmp_path) == before and outside.read_text() == "precious"
    assert sorted(store.ids()) == sorted(ids)


def reseal(path, edit):
    """Edit a manifest / header *and* recompute its digest, as a forger would."""
    body = {k: v for k, v in json.loads(Path(path).read_text()).items() if k != "digest"}
    edit(body)
    Path(path).write_bytes(store_module.seal(body))


def test_a_crafted_manifest_with_a_traversal_id_is_refused(tmp_path):
    model = tiny_model("mamba")
    store = make_store(tmp_path / "s", model)
    store.add(TEXTS[:2], show_progress=False)
    (tmp_path / "x").write_text("precious")
    path = next((tmp_path / "s" / "shards").glob("*.json"))
    reseal(path, lambda m: m["entries"][0].update(id="../../x"))
    with pytest.raises(ValueError, match="malformed entry record"):
        make_store(tmp_path / "s", model).ids()
    with pytest.raises(ValueError, match="malformed entry record"):
        make_store(tmp_path / "s", model).compact()
    with pytest.raises(ValueError, match="not a store entry id"):
        store.delete("../../x")
    assert (tmp_path / "x").read_text() == "precious"


# ------------------------------------------------------------------------------------ integrity
def _flips(data: bytes):
    for position in range(len(data)):
        for mask in (0x01, 0x20):
            out = bytearray(data)
            out[position] ^= mask
            yield bytes(out)


def test_every_byte_flip_of_a_manifest_is_refused_or_harmless(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    store.add(
        ["bees make honey", "iron ships sail"],
        metadata=[{"source": "a", "n": 1}, {"source": "b", "n": 2}],
        show_progress=False,
    )
    expected = snapshot(store)
    path = next((tmp_path / "s" / "shards").glob("*.json"))
    pristine = path.read_bytes()
    refused = 0
    for flipped in _flips(pristine):
        path.write_bytes(flipped)
        try:
            seen = snapshot(make_store(tmp_path / "s", model))
        except ValueError as error:
            assert "shard manifest" in str(error) or str(path) in str(error)
            refused += 1
            continue
        assert seen == expected, "a flipped byte silently changed what the store holds"
    assert refused >= len(pristine)  # nearly every flip is caught by the digest (the rest change nothing)
    path.write_bytes(pristine)
    assert snapshot(make_store(tmp_path / "s", model)) == expected


def test_every_byte_flip_of_the_header_is_refused_or_harmless(tmp_path):
    model = tiny_model("mamba")
    store = make_store(tmp_path / "s", model)
    store.add(TEXTS[:1], show_progress=False)
    path = tmp_path / "s" / "store.json"
    pristine = path.read_bytes()
    header = json.loads(pristine)
    for flipped in _flips(pristine):
        path.write_bytes(flipped)
        try:
            opened = make_store(tmp_path / "s", model)
        except ValueError as error:
            assert "store.json" in str(error)
            continue
        assert opened.header == {k: v for k, v in header.items() if k != "digest"}


def test_a_lost_header_does_not_let_another_model_adopt_the_store(tmp_path):
    model, other = tiny_model("mamba2"), tiny_model("mamba2", seed=1)
    store = make_store(tmp_path / "s", model)
    store.add(TEXTS[:2], show_progress=False)
    header = (tmp_path / "s" / "store.json").read_bytes()
    (tmp_path / "s" / "store.json").unlink()
    for who in (other, model):
        with pytest.raises(ValueError, match=r"store.json is missing"):
            make_store(tmp_path / "s", who)
    assert not (tmp_path / "s" / "store.json").exists()
    # a forged header for the other model still meets the fingerprint recorded in every manifest
    (tmp_path / "s" / "store.json").write_bytes(header)
    reseal(tmp_path / "s" / "store.json", lambda h: h.update(fingerprint=hsc.model_fingerprint(other)))
    with pytest.raises(ValueError, match="another model"):
        make_store(tmp_path / "s", other).ids()


def test_a_store_of_the_unsealed_format_1_is_refused_with_the_fix(tmp_path):
    model = tiny_model("mamba")
    make_store(tmp_path / "s", model)
    header = json.loads((tmp_path / "s" / "store.json").read_text())
    header.update(format_version=1)
    del header["digest"]
    (tmp_path / "s" / "store.json").write_text(json.dumps(header))
    with pytest.raises(ValueError, match=r"format 1.*rebuild"):
        make_store(tmp_path / "s", model)


def _flip_tensor_byte(path, tensor):
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    start, _end = json.loads(data[8 : 8 + header_len])[tensor]["data_offsets"]
    out = bytearray(data)
    out[8 + header_len + start + 1] ^= 0x10
    path.write_bytes(bytes(out))


@pytest.mark.parametrize("tensor", ["embeddings", "entry", "A.0"])
def test_compaction_never_blesses_corrupted_data(tmp_path, tensor):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)  # one shard
    shard = next((tmp_path / "s" / "shards").glob("*.safetensors"))
    _flip_tensor_byte(shard, f"{ids[1]}.ssm.0" if tensor == "entry" else tensor)
    store.delete(ids[0])  # the shard must be rewritten
    with pytest.raises(ValueError, match="checksum"):
        make_store(tmp_path / "s", model).compact()
    # the corruption is still reported, not re-checksummed into validity
    fresh = make_store(tmp_path / "s", model)
    with pytest.raises(ValueError, match="checksum"):
        fresh.retrieve("red fox", k=2) if tensor == "embeddings" else fresh.get(ids[1])


# ------------------------------------------------------------------------------------ arguments
def test_bad_arguments_get_clear_errors(tmp_path):
    model = tiny_model("mamba")
    store = make_store(tmp_path / "s", model)
    with pytest.raises(TypeError, match="single string"):
        store.add("a text", show_progress=False)
    for bad in ("2", 2.0, True, None):
        with pytest.raises(TypeError, match="batch_size must be an int"):
            store.add(["a"], batch_size=bad, show_progress=False)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        store.add(["a"], batch_size=0, show_progress=False)
    with pytest.raises(TypeError, match="metadata of text 1"):
        store.add(["a", "b"], metadata=[{}, {"when": object()}], show_progress=False)
    with pytest.raises(TypeError, match="metadata of text 0"):
        store.add(["a"], metadata=[{1: "int key"}], show_progress=False)
    with pytest.raises(TypeError, match="metadata of text 0"):
        store.add(["a"], metadata=[{"x": float("nan")}], show_progress=False)
    with pytest.raises(TypeError, match="metadata of text 0 must be a dict"):
        store.add(["a"], metadata=["source"], show_progress=False)
    with pytest.raises(TypeError, match="info"):
        make_store(tmp_path / "t", model, info={"when": object()})
    assert len(store) == 0
    store.add(["copper and tin"], show_progress=False)
    for bad in (1.5, "2", True, None):
        with pytest.raises(TypeError, match="k must be an int"):
            store.retrieve("copper", k=bad)
    with pytest.raises(ValueError, match="k must be >= 0"):
        store.retrieve("copper", k=-1)
    assert len(store.retrieve("copper", k=torch.tensor(3).item())) == 1


class ShiftedTokenizer(CharTokenizer):
    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        out = super().__call__(text, add_special_tokens, return_tensors)
        return {**out, "input_ids": [3 + (i - 2) % 96 for i in out["input_ids"]]}


def test_the_store_records_its_tokenizer_and_refuses_another(tmp_path):
    model = tiny_model("mamba2")
    make_store(tmp_path / "s", model).add(TEXTS[:1], show_progress=False)
    record = json.loads((tmp_path / "s" / "store.json").read_text())["tokenizer"]
    assert record["name_or_path"] == "CharTokenizer" and len(record["probe_sha256"]) == 64
    with pytest.raises(ValueError, match="tokenizer"):
        make_store(tmp_path / "s", model, tokenizer=ShiftedTokenizer())
    assert len(make_store(tmp_path / "s", model)) == 1


# ------------------------------------------------------------------------------------ verified reads
def test_reads_verify_each_entry_once_per_shard_file_and_again_when_the_file_changes(tmp_path, monkeypatch):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    hashed = []
    checksum = store_module.checksum
    monkeypatch.setattr(store_module, "checksum", lambda tensors: hashed.append(sorted(tensors)) or checksum(tensors))
    first = store.get(ids[:2])
    entry_hashes = len([h for h in hashed if "token_ids" in h])
    assert entry_hashes == 2
    again = store.get(ids[:2])
    other_object = make_store(tmp_path / "s", model).get(ids[:2])  # the cache is per process, not per object
    assert len([h for h in hashed if "token_ids" in h]) == 2  # nothing hashed again
    assert all(same_states(a, b) for a, b in zip(first + first, again + other_object))
    shard = next((tmp_path / "s" / "shards").glob("*.safetensors"))
    time.sleep(0.01)  # a later mtime even on filesystems with coarse timestamps
    _flip_tensor_byte(shard, f"{ids[0]}.conv.1")  # rewritten in place: same inode, same size
    with pytest.raises(ValueError, match="checksum"):
        store.get(ids[0])
    # replaced by another file (new inode): everything is verified again
    pristine_dir = tmp_path / "copy"
    shutil.copytree(tmp_path / "s", pristine_dir)
    hashed.clear()
    assert same_states(store.get(ids[2]), make_store(tmp_path / "s", model).get(ids[2]))
    assert len([h for h in hashed if "token_ids" in h]) == 1
    tmp = shard.with_name(".replacement")
    tmp.write_bytes(shard.read_bytes())
    os.replace(tmp, shard)
    hashed.clear()
    store.get(ids[2])
    assert len([h for h in hashed if "token_ids" in h]) == 1


@pytest.mark.parametrize("damage", ["negative ΣΔ", "NaN", "inf", "shape"])
def test_stored_states_that_are_not_states_of_the_model_are_refused(tmp_path, damage):
    model = tiny_model("mamba")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:1], show_progress=False)
    shard = next((tmp_path / "s" / "shards").glob("*.safetensors"))
    from safetensors.torch import load_file, save

    tensors = {name: t.clone() for name, t in load_file(shard).items()}  # load_file maps the file: detach from it
    if damage == "negative ΣΔ":  # no encoding makes that
        tensors[f"{ids[0]}.delta_sum.0"] = -tensors[f"{ids[0]}.delta_sum.0"] - 1
    elif damage == "shape":
        tensors[f"{ids[0]}.conv.1"] = tensors[f"{ids[0]}.conv.1"][..., :-1].contiguous()
    else:
        tensors[f"{ids[0]}.ssm.1"][0, 3, 2] = float(damage.lower())
    payload = save(tensors, metadata={"hf_statecompose_store": "shard"})
    shard.write_bytes(payload)
    entry_tensors = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.startswith(ids[0] + ".")}

    def forge(m):
        m["shard_size"] = len(payload)
        m["entries"][0]["checksum"] = store_module.checksum(entry_tensors)

    reseal(next((tmp_path / "s" / "shards").glob("*.json")), forge)
    expected = {
        "negative ΣΔ": "ΣΔ is negative",
        "NaN": "ssm holds NaN/inf",
        "inf": "ssm holds NaN/inf",
        "shape": "not a fp32 state of this model",
    }
    with pytest.raises(ValueError, match=expected[damage]):
        make_store(tmp_path / "s", model).get(ids[0])


# ------------------------------------------------------------------------------------ compaction killed
KILLER_SCRIPT = """
import json, os, shutil, signal, sys
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from store_helpers import BagOfWords, CharTokenizer
import hf_statecompose as hsc
from hf_statecompose.store import folder_disk as store_module

pristine, work = sys.argv[1], sys.argv[2]
model = tiny_model("mamba2")


def compact(dest, step, torn):
    # a forked child: count the store's file changes, SIGKILL itself at change number `step`
    count = [0]
    write, remove = store_module._write, store_module._remove

    def maybe_die(path, data=None):
        if count[0] == step:
            if torn and data is not None:  # half of the new file written under its temporary name
                with open(path.parent / ".tmp-torn", "wb") as handle:
                    handle.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1

    store_module._write = lambda path, data: (maybe_die(path, data), write(path, data))[1]
    store_module._remove = lambda path: (maybe_die(path), remove(path))[1]
    hsc.StateStore(dest, model, CharTokenizer(), retriever=BagOfWords()).compact()
    with open(os.path.join(work, "steps"), "w") as handle:
        handle.write(str(count[0]))


def start(name, step, torn):
    dest = os.path.join(work, name)
    shutil.copytree(pristine, dest)
    pid = os.fork()
    if pid == 0:
        try:
            compact(dest, step, torn)
        finally:
            os._exit(0)
    return pid


assert os.waitpid(start("complete", -1, False), 0)[1] == 0
steps = int(open(os.path.join(work, "steps")).read())
# every kill on its own copy of the store, all at once (the time goes to fsync, not to the CPU)
pids = [start(f"kill-{{step}}-{{int(torn)}}", step, torn) for step in range(steps) for torn in (False, True)]
killed = [os.waitpid(pid, 0)[1] for pid in pids]
print(json.dumps({{"steps": steps, "killed_by_signal_9": sum(os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9 for s in killed)}}))
"""


def test_compaction_killed_at_every_step_loses_nothing_and_readers_see_each_id_once(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "pristine", model)
    ids = store.add(TEXTS[:6], metadata=[{"n": i} for i in range(6)], batch_size=2, show_progress=False)
    store.delete([ids[0], ids[2], ids[3]])  # shard 1 rewritten, shard 2 emptied, shard 3 untouched
    (tmp_path / "pristine" / "shards" / ".tmp-left-by-a-killed-add").write_bytes(b"half")
    survivors = {i: store.get(i) for i in (ids[1], ids[4], ids[5])}
    expected = [e for e in snapshot(store)]
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", KILLER_SCRIPT.format(tests=TESTS), str(tmp_path / "pristine"), str(work)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # rewrite shard 1 (2 writes, 2 removals), drop shard 2 (2), the temporary file (1), the tombstone file (1)
    assert report["steps"] >= 8 and report["killed_by_signal_9"] == 2 * report["steps"]
    runs = sorted(p for p in work.iterdir() if p.is_dir())
    assert len(runs) == 2 * report["steps"] + 1

    def check(path):
        reader = make_store(path, model)
        assert snapshot(reader) == expected, path.name
        for entry_id, state in survivors.items():
            assert same_states(reader.get(entry_id), state), (path.name, entry_id)
        assert [e.id for e in reader.retrieve("honey bees summer", k=1)] == [ids[4]]
        # each id in exactly one live (not superseded) manifest
        found = manifests(path)
        superseded = {s for m in found.values() for s in m["supersedes"]}
        listed = [r["id"] for sid, m in found.items() if sid not in superseded for r in m["entries"]]
        assert len(listed) == len(set(listed)), path.name
        return reader

    for path in runs:
        reader = check(path)
        reader.compact()  # a later compaction finishes the job ...
        check(path)
        stats = reader.stats()
        assert stats["orphan_files"] == stats["superseded_shards"] == stats["deleted_pending"] == 0, (path.name, stats)
        assert stats["shards"] == 2 and not list(path.rglob(".tmp-*"))
        assert not any((path / "deleted").iterdir())  # ... tombstones included


def test_a_damaged_manifest_that_a_live_one_supersedes_is_ignored_then_removed(tmp_path, monkeypatch):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    store.delete(ids[0])
    old = next((tmp_path / "s" / "shards").glob("*.json"))

    class Stop(Exception):
        pass

    def stop(path):  # compaction stopped after committing the new shard, before removing the old one
        raise Stop

    monkeypatch.setattr(store_module, "_remove", stop)
    with pytest.raises(Stop):
        store.compact()
    monkeypatch.undo()
    assert len(list((tmp_path / "s" / "shards").glob("*.json"))) == 2
    old.write_text("{damaged")
    reader = make_store(tmp_path / "s", model)
    assert sorted(reader.ids()) == sorted(ids[1:])
    assert reader.stats()["superseded_shards"] == 1 and reader.compact()["superseded_shards_removed"] == 1
    assert not old.exists() and sorted(reader.ids()) == sorted(ids[1:])


@pytest.mark.parametrize("backend", ["folder", "lance"])
def test_text_and_metadata_that_utf8_cannot_encode_are_refused_naming_them(backend, tmp_path):
    """A lone surrogate (``"\\ud800"``, e.g. from a bad decode) survives Python's JSON but not the store's UTF-8: a
    ValueError naming the text or the metadata key, before anything is written (issue 29)."""
    if backend == "lance":
        pytest.importorskip("lancedb")
    model = tiny_model("mamba")
    store = make_store(tmp_path / "s", model, backend=backend)
    cases = [
        (
            {"texts": ["a", "b"], "metadata": [{}, {"note": "\ud800"}]},
            r"metadata of text 1 key 'note' holds a lone surrogate \('\\ud800'",
        ),
        (
            {"texts": ["a"], "metadata": [{"tags": ["ok", {"deep": "x\udfff"}]}]},
            r"metadata of text 0 at \['tags'\]\[1\]\['deep'\] holds a lone surrogate \('\\udfff' in 'x\\udfff'\)",
        ),
        (
            {"texts": ["a"], "metadata": [{"bad\ud83d key": 1}]},
            r"metadata of text 0 key 'bad\\ud83d key' holds a lone surrogate",
        ),
        ({"texts": ["fine", "bro\ud800ken"]}, r"text 1 holds a lone surrogate \('\\ud800' in 'bro\\ud800ken'\)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message + ".*UTF-8 cannot encode"):
            store.add(show_progress=False, **kwargs)
    assert len(store) == 0
    with pytest.raises(ValueError, match=r"info key 'who' holds a lone surrogate"):
        make_store(tmp_path / "t", model, backend=backend, info={"who": "\ud800"})
    # a proper pair (an emoji) and other non-ASCII text are fine
    store.add(["a"], metadata=[{"note": "\U0001f600 é"}], show_progress=False)
    assert store.entries()[0].metadata == {"note": "\U0001f600 é"}
