"""StateStore safety (issue 21): links never followed, multi-id deletes all or nothing, forged
supersession refused, clear errors for a file path and ``add(None)``, read-only stores readable,
``add`` skipping texts already stored, states owning their ``A``."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.store import folder_disk as store_module

from helpers import tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer


def make_store(path, model, **kwargs):
    return hsc.StateStore(path, model, CharTokenizer(), retriever=BagOfWords(), **kwargs)


def files_under(path):
    return {
        str(p.relative_to(path)): p.read_bytes() for p in Path(path).rglob("*") if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def model():
    return tiny_model("mamba2")


def bait(folder):
    """Files named as the store names its own (entry ids, temporary files, shard tensors) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("0123456789abcdef", ".tmp-precious", "0123456789abcdef0123456789abcdef.safetensors"):
        (folder / name).write_bytes(b"precious")
    return files_under(folder)


# ------------------------------------------------------------------------------------ 1. links
@pytest.mark.parametrize("link", ["deleted", "shards", "store.json", ".lock"])
def test_a_store_whose_files_are_links_is_refused_and_compact_never_follows_them(tmp_path, model, link):
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    store.delete(ids[0])
    outside = tmp_path / "outside"
    before = bait(outside)
    real = tmp_path / "s" / link
    moved = tmp_path / "moved"
    os.replace(real, moved)
    if link in ("deleted", "shards"):  # the store's own files go along, so the link looks like a store
        for name in os.listdir(moved):
            os.replace(moved / name, outside / name)
        os.symlink(outside, real)
    else:
        os.replace(moved, outside / link)
        os.symlink(outside / link, real)
    with pytest.raises(ValueError, match="symbolic link"):
        make_store(tmp_path / "s", model)
    with pytest.raises(ValueError, match="symbolic link"):
        store.compact()  # the object opened before the link appeared checks again
    with pytest.raises(ValueError, match="symbolic link"):
        store.delete(ids[1])
    assert {name: data for name, data in files_under(outside).items() if name in before} == before


# ------------------------------------------------------------------------------------ 2. delete: all or nothing
class Stop(BaseException):
    """A crash: raised around a file change, nothing after it runs."""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_multi_id_delete_stopped_at_any_file_change_is_all_or_nothing(tmp_path, model, monkeypatch, when):
    path = tmp_path / "s"
    ids = make_store(path, model).add(TEXTS[:4], show_progress=False)
    write, remove = store_module._write, store_module._remove
    for step in range(8):
        count = [0]

        def maybe_stop(*args):
            if count[0] == step:  # noqa: B023 - only called during this step's delete
                raise Stop
            count[0] += 1  # noqa: B023 - only called during this step's delete

        def patched_write(p, data):
            if when == "before":
                maybe_stop()
            write(p, data)
            if when == "after":
                maybe_stop()

        def patched_remove(p):
            if when == "before":
                maybe_stop()
            done = remove(p)
            if when == "after":
                maybe_stop()
            return done

        monkeypatch.setattr(store_module, "_write", patched_write)
        monkeypatch.setattr(store_module, "_remove", patched_remove)
        stopped = False
        try:
            make_store(path, model).delete(ids[:3])
        except Stop:
            stopped = True
        monkeypatch.undo()
        left = set(make_store(path, model).ids())
        assert left in ({ids[3]}, set(ids)), (when, step, left)
        if not stopped:
            break
        make_store(path, model).delete(ids[:3], missing_ok=True)  # the retry completes it
        assert make_store(path, model).ids() == [ids[3]]
        # undo for the next step: a fresh store
        import shutil

        shutil.rmtree(path)
        ids = make_store(path, model).add(TEXTS[:4], show_progress=False)
    assert step < 7


def test_delete_checks_every_id_before_changing_anything(tmp_path, model):
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    absent = "0123456789abcdef"
    before = files_under(tmp_path / "s")
    with pytest.raises(KeyError, match=absent):
        store.delete([ids[0], absent, ids[1]])
    assert files_under(tmp_path / "s") == before and len(store) == 3
    store.delete([ids[0], absent, ids[0]], missing_ok=True)  # absent ids ignored, a repeated one once
    assert sorted(store.ids()) == sorted(ids[1:])
    store.delete(ids[0], missing_ok=True)  # already gone: a no-op
    with pytest.raises(KeyError, match=ids[0]):
        store.delete(ids[0])
    assert store.compact()["removed_entries"] == 1 and sorted(store.ids()) == sorted(ids[1:])
    assert not any((tmp_path / "s" / "deleted").iterdir())  # the tombstone went with the entry


def test_per_id_tombstones_of_existing_stores_still_delete_and_are_compacted(tmp_path, model):
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    (tmp_path / "s" / "deleted" / ids[1]).write_bytes(b"")  # as an older hf_statecompose deleted
    store.delete(ids[2])
    assert make_store(tmp_path / "s", model).ids() == [ids[0]]
    assert store.compact()["removed_entries"] == 2
    assert store.ids() == [ids[0]] and not any((tmp_path / "s" / "deleted").iterdir())


# ------------------------------------------------------------------------------------ 3. forged supersession
def reseal(path, edit):
    body = {k: v for k, v in json.loads(Path(path).read_text()).items() if k != "digest"}
    edit(body)
    Path(path).write_bytes(store_module.seal(body))


def test_a_forged_manifest_superseding_a_live_shard_is_refused_and_nothing_is_deleted(tmp_path, model):
    store = make_store(tmp_path / "s", model)
    first = store.add(TEXTS[:2], show_progress=False)
    second = store.add(TEXTS[2:4], show_progress=False)
    shards = {json.loads(p.read_text())["entries"][0]["id"]: p.stem for p in (tmp_path / "s" / "shards").glob("*.json")}
    victim, forger = shards[first[0]], shards[second[0]]
    # the forger's manifest claims to supersede the victim's shard, seal recomputed
    reseal(tmp_path / "s" / "shards" / f"{forger}.json", lambda m: m.update(supersedes=[victim]))
    before = files_under(tmp_path / "s")
    with pytest.raises(ValueError, match="supersede"):
        make_store(tmp_path / "s", model).ids()  # readers refuse rather than drop two entries
    with pytest.raises(ValueError, match="supersede"):
        store.compact()
    assert files_under(tmp_path / "s") == before


def test_a_compaction_killed_after_committing_still_finishes(tmp_path, model, monkeypatch):
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:4], show_progress=False)
    store.delete(ids[:2])

    def stop(path):
        raise Stop

    monkeypatch.setattr(store_module, "_remove", stop)
    with pytest.raises(Stop):
        store.compact()
    monkeypatch.undo()
    reader = make_store(tmp_path / "s", model)
    assert sorted(reader.ids()) == sorted(ids[2:])  # the superseded shard's entries are accounted for
    assert reader.compact()["superseded_shards_removed"] == 1 and sorted(reader.ids()) == sorted(ids[2:])


def test_a_compaction_killed_between_the_two_removals_of_a_superseded_shard_leaves_no_manifest_without_tensors(
    tmp_path, model, monkeypatch
):
    """Compaction step 1 (what a killed compaction left) removes a superseded shard's manifest, then its
    tensors: killed in between, the store holds orphan tensors (removed by the next compaction), never a manifest
    whose tensors are gone (a committed shard is always complete). The other order fails here."""
    path = tmp_path / "s"
    store = make_store(path, model)
    ids = store.add(TEXTS[:4], show_progress=False)  # one shard
    expected = {i: store.get(i) for i in ids[2:]}
    store.delete(ids[:2])
    remove = store_module._remove

    def stop(p):
        raise Stop

    monkeypatch.setattr(store_module, "_remove", stop)  # the first compaction: killed once its new shard is committed
    with pytest.raises(Stop):
        store.compact()
    shards = path / "shards"
    superseded = {s for p in shards.glob("*.json") for s in json.loads(p.read_text())["supersedes"]}
    assert len(superseded) == 1 and len(list(shards.glob("*.json"))) == 2
    removed = []

    def remove_once(p):  # the second compaction, step 1: killed right after its first removal
        if removed:
            raise Stop
        removed.append(p.name)
        return remove(p)

    monkeypatch.setattr(store_module, "_remove", remove_once)
    with pytest.raises(Stop):
        make_store(path, model).compact()
    monkeypatch.undo()
    assert removed and removed[0].startswith(next(iter(superseded)))  # the kill fell inside step 1
    manifests_left = sorted(p.stem for p in shards.glob("*.json"))
    without_tensors = [sid for sid in manifests_left if not (shards / f"{sid}.safetensors").exists()]
    assert without_tensors == [], "a manifest outlived its tensors: step 1 must remove the manifest first"
    reader = make_store(path, model)
    assert sorted(reader.ids()) == sorted(ids[2:])
    for sid in manifests_left:  # every manifest on disk is a complete shard (size checked, file opened)
        handle, _ = reader._open_shard(sid)
        with handle:
            pass
    for entry_id, state in expected.items():
        assert torch.equal(reader.get(entry_id).ssm_states[0], state.ssm_states[0])
    assert reader.stats()["orphan_files"] == 1  # the superseded shard's tensors, uncommitted
    reader.compact()
    stats = reader.stats()
    assert stats["orphan_files"] == stats["superseded_shards"] == 0 and sorted(reader.ids()) == sorted(ids[2:])


# ------------------------------------------------------------------------------------ 4. clear errors
def test_a_file_path_and_add_none_are_clear_errors(tmp_path, model):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        make_store(tmp_path / "file", model)
    store = make_store(tmp_path / "s", model)
    with pytest.raises(TypeError, match="texts must be a list"):
        store.add(None)
    with pytest.raises(TypeError, match="texts must be a list"):
        store.add(42)


# ------------------------------------------------------------------------------------ 5. read-only
def test_a_read_only_store_can_be_read_and_refuses_writes_clearly(tmp_path, model, monkeypatch):
    path = tmp_path / "s"
    store = make_store(path, model)
    ids = store.add(TEXTS[:3], show_progress=False)
    expected = store.get(ids[0])
    real_open, real_mkdir = os.open, Path.mkdir
    inside = str(path)

    def read_only_open(file, flags, *args, **kwargs):
        if str(file).startswith(inside) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, flags, *args, **kwargs)

    def read_only_mkdir(self, *args, **kwargs):
        if str(self).startswith(inside):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    monkeypatch.setattr(Path, "mkdir", read_only_mkdir)
    reader = make_store(path, model)
    assert sorted(reader.ids()) == sorted(ids) and reader.entries([ids[1]])[0].text == TEXTS[1]
    assert torch.equal(reader.get(ids[0]).ssm_states[0], expected.ssm_states[0])
    assert reader.retrieve("red fox", k=1)[0].id == ids[0] and reader.stats()["entries"] == 3
    for write in (lambda: reader.add(["new text"], show_progress=False), lambda: reader.delete(ids[0]), reader.compact):
        with pytest.raises(PermissionError, match="is read-only"):
            write()
    (path / ".lock").unlink()  # a copy without it, on a read-only filesystem: still readable
    assert sorted(make_store(path, model).ids()) == sorted(ids)
    monkeypatch.undo()
    assert sorted(make_store(path, model).ids()) == sorted(ids)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root ignores permissions")
def test_a_store_in_a_folder_without_write_permission_can_be_read(tmp_path, model):
    path = tmp_path / "s"
    ids = make_store(path, model).add(TEXTS[:2], show_progress=False)
    modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
    try:
        for p in [*path.rglob("*"), path]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        reader = make_store(path, model)
        assert sorted(reader.ids()) == sorted(ids) and reader.get(ids[0]).num_tokens.tolist() == [len(TEXTS[0])]
        with pytest.raises(PermissionError, match="is read-only"):
            reader.delete(ids[0])
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


# ------------------------------------------------------------------------------------ 6. add skips what is stored
def test_adding_texts_already_stored_skips_them(tmp_path, model, monkeypatch):
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], metadata=[{"n": 0}, {"n": 1}, {}], show_progress=False)
    encoded = []
    encode = store_module.ComposableMambaCache.encode
    monkeypatch.setattr(
        store_module.ComposableMambaCache,
        "encode",
        lambda model, ids, **kw: encoded.append(ids.shape[0]) or encode(model, ids, **kw),
    )
    again = store.add(TEXTS[:3], metadata=[{"n": 0}, {"n": 1}, {}], show_progress=False)  # the Quickstart rerun
    assert again == ids and len(store) == 3 and encoded == []
    # other metadata is another entry; duplicates within one call are one entry
    more = store.add(
        [TEXTS[0], TEXTS[3], TEXTS[3], TEXTS[1]], metadata=[{"n": 5}, {}, {}, {"n": 1}], show_progress=False
    )
    assert more[0] not in ids and more[1] == more[2] and more[3] == ids[1] and len(store) == 5 and encoded == [2]
    # another process (another object) sees the same
    assert make_store(tmp_path / "s", model).add([TEXTS[3]], show_progress=False) == [more[1]]
    # an entry deleted (not yet compacted) is added again as a new live entry
    store.delete(ids[2])
    back = store.add([TEXTS[2]], show_progress=False)
    assert back[0] in store and ids[2] not in store and len(store) == 5
    store.compact()
    assert sorted(make_store(tmp_path / "s", model).ids()) == sorted({*ids[:2], *more, *back})


def test_a_batch_another_process_stored_meanwhile_is_not_written_again(tmp_path, model):
    ours, theirs = make_store(tmp_path / "s", model), make_store(tmp_path / "s", model)
    build, ids = ours._shard, []

    def meanwhile(*args):  # our shard is built (outside the writers' lock); another process commits two of its texts
        if not ids:
            ids.extend(theirs.add(TEXTS[:2], show_progress=False))
        return build(*args)

    ours._shard = meanwhile
    assert ours.add(TEXTS[:3], show_progress=False)[:2] == ids  # the commit re-checks under the writers' lock
    assert len(ours) == 3 and len(make_store(tmp_path / "s", model).entries()) == 3
    assert sorted(e.text for e in ours.entries()) == sorted(TEXTS[:3])


def test_entry_ids_come_from_content(tmp_path, model):
    a = make_store(tmp_path / "a", model).add(TEXTS[:2], metadata=[{"n": 1}, {}], show_progress=False)
    b = make_store(tmp_path / "b", model).add(TEXTS[:2], metadata=[{"n": 1}, {}], show_progress=False)
    assert a == b


# ------------------------------------------------------------------------------------ 7. states own their A
def test_each_state_owns_its_tensors(tmp_path, model):
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:2], show_progress=False)
    first = store.get(ids[0])
    first.A[0].mul_(2)  # edited in place
    again = store.get(ids[0])
    assert not torch.equal(first.A[0], again.A[0])
    retrieved = store.retrieve("red fox", k=1)[0].state
    assert not torch.equal(first.A[0], retrieved.A[0]) and torch.equal(again.A[0], retrieved.A[0])
    query = torch.tensor([CharTokenizer()("what?")["input_ids"]])
    out = model.generate(query, past_states=[again], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, query.shape[1] + 3)


# ------------------------------------------------------------------------------------ the Lance backend: the shared checks
def test_the_lance_store_shares_the_checks_and_hands_out_its_own_A(tmp_path, model):
    pytest.importorskip("lancedb")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        make_store(tmp_path / "file", model, backend="lance")
    store = make_store(tmp_path / "l", model, backend="lance")
    with pytest.raises(TypeError, match="texts must be a list"):
        store.add(None)
    ids = store.add(TEXTS[:2], show_progress=False)
    first = store.get(ids[0])
    first.A[0].mul_(2)
    again = store.get(ids[0])
    assert not torch.equal(first.A[0], again.A[0]) and torch.equal(
        again.A[0], store.retrieve("red fox", k=1)[0].state.A[0]
    )


def test_the_lance_store_skips_texts_already_stored_too(tmp_path, model):
    pytest.importorskip("lancedb")
    store = make_store(tmp_path / "l", model, backend="lance")
    ids = store.add(TEXTS[:3], metadata=[{"n": 0}, {}, {}], show_progress=False)
    assert len(store) == 3
    again = store.add(TEXTS[:3], metadata=[{"n": 0}, {}, {}], show_progress=False)  # the Quickstart rerun
    more = store.add([TEXTS[0], TEXTS[3], TEXTS[3]], metadata=[{}, {}, {}], show_progress=False)
    assert again == ids and more[0] not in ids and more[1] == more[2] and len(store) == 5
    # the same ids as the folder store gives the same texts
    assert make_store(tmp_path / "f", model).add(TEXTS[:3], metadata=[{"n": 0}, {}, {}], show_progress=False) == ids


@pytest.mark.parametrize("backend", ["folder", "lance"])
def test_a_store_under_a_file_is_a_clear_error(tmp_path, model, backend):
    if backend == "lance":
        pytest.importorskip("lancedb")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        make_store(tmp_path / "a_file" / "store", model, backend=backend)


def test_a_damaged_lance_data_file_is_one_clear_error(tmp_path, model):
    pytest.importorskip("lancedb")
    store = make_store(tmp_path / "l", model, backend="lance")
    ids = store.add(TEXTS[:3], show_progress=False)
    data = sorted((tmp_path / "l" / "states.lance" / "data").glob("*.lance"), key=lambda p: p.stat().st_size)[-1]
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 200 : len(raw) - 100] = bytes(100)  # the file's footer region: its page layout
    data.write_bytes(bytes(raw))
    reopened = make_store(tmp_path / "l", model, backend="lance")
    try:
        reopened.entries(ids)
    except ValueError as error:  # either Lance cannot read it, or a row fails its seal: both name the fix
        assert "restore" in str(error) or "re-add" in str(error) or "repair" in str(error)
        assert "\n" not in str(error)
    else:
        pytest.fail("a damaged data file was read without an error")
