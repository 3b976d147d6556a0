"""The Lance store under concurrency (issue 21): processes writing the same ids store each entry once;
a store holding copies of an entry reads right until ``repair`` keeps one; deletes, compactions and
adds at once all succeed (the retry helper); ``delete(missing_ok=...)``."""

import collections
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

pytest.importorskip("lancedb")
TESTS = str(Path(__file__).parent)
ROOT = str(Path(__file__).parent.parent)
ROUNDS = 8

# Three processes, started once for the two concurrent tests (loading torch is most of their time).
# Phase 1: all three write the same 4 ids at one moment, ROUNDS times (write_rows of pre-encoded rows,
# or add(ids=...), by turns), to a new store and to one made before the id was the primary key (its
# first writes declare it, the three processes at once). Phase 2, on another store: one deletes the "victim" entries one at a time,
# one compacts, one writes new entries, all at once. Every call must succeed.
WORKER = """
import glob, json, os, sys, time
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer
import hf_statecompose as hsc

root, worker, workers, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = tiny_model("mamba2")

def start_together(phase):  # every worker ready (model loaded, rows encoded): all begin at one moment
    open(os.path.join(root, f"ready-{{phase}}-{{worker}}"), "w").close()
    waiting = time.time()
    while len(glob.glob(os.path.join(root, f"ready-{{phase}}-*"))) < workers:
        if time.time() - waiting > 120:
            sys.exit(f"another worker never reached {{phase}} (it failed: see its error)")
        time.sleep(0.01)
    start = max(os.path.getmtime(p) for p in glob.glob(os.path.join(root, f"ready-{{phase}}-*"))) + 0.5
    while time.time() < start:
        time.sleep(0.001)
    return start

stores = [hsc.StateStore(os.path.join(root, name), model, CharTokenizer(), retriever=BagOfWords(), backend="lance") for name in ("same", "legacy")]
texts = [[f"round {{r}}: {{t}}" for t in TEXTS[:4]] for r in range(rounds)]
ids = [[f"{{r:08x}}{{n:08x}}" for n in range(4)] for r in range(rounds)]
rows = [stores[0].encode_rows(texts[r], [{{}}] * 4, ids[r]) for r in range(rounds)]
start = start_together("same")
for r in range(rounds):
    for n, store in enumerate(stores):
        while time.time() < start + 0.3 * (2 * r + n):
            time.sleep(0.001)
        if r % 2 == 0:
            store.write_rows(rows[r], skip_existing=True)
        else:
            assert store.add(texts[r], ids=ids[r], show_progress=False) == ids[r]

store = hsc.StateStore(os.path.join(root, "busy"), model, CharTokenizer(), retriever=BagOfWords(), backend="lance")
role = ["delete", "compact", "add"][worker]
victims = sorted(e.id for e in store.entries() if e.text.startswith("victim"))
new = [store.encode_rows([f"new {{n}}: " + TEXTS[n % 7]], [{{}}], [f"{{n + 1000:016x}}"]) for n in range(10)]
start_together("busy")
if role == "delete":
    for victim in victims:
        store.delete(victim)
elif role == "compact":
    for _ in range(10):
        store.compact(keep_versions_for=5)
else:
    for batch in new:
        store.write_rows(batch, skip_existing=True)
print("done", role, len(victims))
"""


def make_store(path, model):
    return hsc.StateStore(str(path), model, CharTokenizer(), retriever=BagOfWords(), backend="lance")


def _legacy_store(path, model):
    """A store as made before the id column was the table's primary key (nullable, no key metadata)."""
    import lancedb
    import pyarrow as pa

    schema = hsc.StateStore(
        str(path) + "-new", model, CharTokenizer(), retriever=BagOfWords(), backend="lance"
    )._schema(BagOfWords().dim)
    lancedb.connect(str(path)).create_table("states", schema=schema.set(0, pa.field("id", pa.string())))
    return make_store(path, model)  # keeps that states table, adds the header


def copies(store) -> collections.Counter:
    """How many rows the table holds of each id (the API reads copies as one entry)."""
    return collections.Counter(store.table.search().select(["id"]).limit(None).to_arrow().column("id").to_pylist())


@pytest.fixture(scope="module")
def concurrent_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("concurrent")
    model = tiny_model("mamba2")
    make_store(root / "same", model)  # created before the workers start
    _legacy_store(root / "legacy", model)
    busy = make_store(root / "busy", model)
    keep = busy.add(TEXTS, batch_size=1, show_progress=False)
    busy.add([f"victim {i} " + TEXTS[i % 7] for i in range(10)], batch_size=1, show_progress=False)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    script = WORKER.format(tests=TESTS)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(root), str(w), "3", str(ROUNDS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(3)
    ]
    outcomes = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    return root, model, keep, outcomes


def test_processes_writing_the_same_ids_at_once_store_each_entry_once(concurrent_run):
    root, model, _, outcomes = concurrent_run
    for returncode, out, err in outcomes:
        assert returncode == 0 and "done" in out, err[-3000:]
    for name in ("same", "legacy"):
        store = make_store(root / name, model)
        counts = copies(store)
        assert len(counts) == 4 * ROUNDS and max(counts.values()) == 1, (
            name,
            {i: n for i, n in counts.items() if n > 1},
        )
        assert sorted(e.text for e in store.entries()) == sorted(
            f"round {r}: {t}" for r in range(ROUNDS) for t in TEXTS[:4]
        )
        assert len({e.id for e in store.retrieve("the red fox", k=6)}) == 6


def test_deletes_compactions_and_writes_at_once_all_succeed(concurrent_run):
    root, model, keep, outcomes = concurrent_run
    for returncode, out, err in outcomes:  # no "Retryable commit conflict", no "Too many concurrent writers"
        assert returncode == 0 and "done" in out, err[-3000:]
    assert "done delete 10" in outcomes[0][1]
    store = make_store(root / "busy", model)
    assert sorted(store.ids()) == sorted(keep + [f"{n + 1000:016x}" for n in range(10)])
    assert max(copies(store).values()) == 1
    store.compact()
    assert store.stats()["deleted_pending"] == 0 and len(store) == 17


# ------------------------------------------------------------------------------------ a store holding copies
def _copy_rows(store, ids, seal=None, **changes):
    """Rows of ``ids`` as Arrow, re-sealed after ``changes`` (a valid row another writer might have made),
    or with ``seal`` (a damaged one)."""
    from hf_statecompose.store.lance import row_seal

    rows = (
        store.table.search()
        .where(f"id IN {store._in(ids)}")
        .select(store._schema(store.embedding_dim).names)
        .limit(None)
        .to_arrow()
        .to_pylist()
    )
    for row in rows:
        row.update(changes)
        row["seal"] = seal or row_seal(
            row["id"],
            row["text"],
            row["metadata"],
            row["num_tokens"],
            store._vector_bytes(row["vector"]),
            row["tensor_digest"],
        )
    return store._pa.Table.from_pylist(rows, schema=store._schema(store.embedding_dim))


def test_a_store_holding_copies_reads_right_and_repair_keeps_one_verified_copy(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS, show_progress=False)
    twice, differ, broken = ids[0], ids[1], ids[2]
    # rows written outside the API (as concurrent writers of older versions did): identical copies of two
    # entries, which read as one entry
    store.table.add(_copy_rows(store, [twice, ids[4]]))
    assert copies(store)[twice] == 2 and len(copies(store)) == len(TEXTS)
    assert sorted(store.ids()) == sorted(ids) and len(store.entries()) == len(TEXTS)
    alone = hsc.ComposableMambaCache.encode(model, torch.tensor([CharTokenizer()(TEXTS[0])["input_ids"]]))
    torch.testing.assert_close(store.get(twice).ssm_states[0], alone.ssm_states[0])
    assert store.entries([twice])[0].text == TEXTS[0]
    top = store.retrieve(TEXTS[0], k=len(TEXTS), load_states=False)
    assert len(top) == len(TEXTS) and len({e.id for e in top}) == len(TEXTS) and top[0].id == twice
    # copies that differ (another metadata; a bad seal stored before the good copy): one clear error naming the fix
    store.table.add(_copy_rows(store, [differ], metadata='{"other": 1}'))
    bad, good = _copy_rows(store, [broken], seal="0" * 32), _copy_rows(store, [broken])
    store.table.delete(f"id = '{broken}'")
    store.table.add(bad)
    store.table.add(good)
    for read in (
        lambda: store.get(differ),
        lambda: store.entries([differ]),
        lambda: store.entries(),
        lambda: store.get(broken),
        lambda: store.retrieve(TEXTS[0], k=len(TEXTS)),
    ):
        with pytest.raises(ValueError, match="hf-statecompose store repair"):
            read()
    report = store.repair()
    assert report == {
        "entries": len(TEXTS),
        "duplicated": 4,
        "removed_copies": 4,
        "unverifiable": [],
        "still_duplicated": [],
    }
    assert max(copies(store).values()) == 1 and sorted(store.ids()) == sorted(ids)
    assert store.entries([differ])[0].metadata == {}  # the first verified copy: the original
    for entry_id, text in zip(ids, TEXTS):  # `broken`: its first copy fails its seal, the second is kept
        store.get(entry_id)
        assert store.entries([entry_id])[0].text == text
    assert store.repair()["duplicated"] == 0


def test_repair_killed_between_its_commits_leaves_a_readable_store_and_completes_next_time(tmp_path, monkeypatch):
    model = tiny_model("mamba")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    store.table.add(_copy_rows(store, ids[:2]))
    real_delete = store.table.delete

    def killed(where):
        if "_rowid" in where:
            raise KeyboardInterrupt  # the process dies after the fresh copies are committed
        return real_delete(where)

    monkeypatch.setattr(store.table, "delete", killed)
    with pytest.raises(KeyboardInterrupt):
        store.repair()
    monkeypatch.undo()
    assert copies(store)[ids[0]] == 3 and [e.text for e in store.entries(ids)] == TEXTS[:3]
    assert store.repair()["removed_copies"] == 4 and max(copies(store).values()) == 1


def test_delete_of_an_entry_stored_twice_removes_every_copy(tmp_path):
    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    store.table.add(_copy_rows(store, [ids[0]]))
    store.table.add(_copy_rows(store, [ids[1]], text="changed"))
    version = store.table.version
    store.delete(ids[:2])
    assert store.table.version == version + 1 and sorted(store.ids()) == [ids[2]] and len(store) == 1


def test_the_cli_repairs_a_store(tmp_path, monkeypatch, capsys):
    from hf_statecompose import cli

    model = tiny_model("mamba2")
    store = make_store(tmp_path / "s", model)
    ids = store.add(TEXTS[:3], show_progress=False)
    store.table.add(_copy_rows(store, ids))
    monkeypatch.setattr(
        cli, "open_store", lambda path, spec, *a, **k: (make_store(path, model), model, CharTokenizer())
    )
    assert cli.main(["store", "repair", str(tmp_path / "s")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["duplicated"] == 3 and report["removed_copies"] == 3 and max(copies(store).values()) == 1


# ------------------------------------------------------------------------------------ delete(missing_ok)
def test_delete_names_missing_ids_before_anything_changes_and_missing_ok_skips_them(tmp_path):
    store = make_store(tmp_path / "s", tiny_model("mamba2"))
    ids = store.add(TEXTS[:4], show_progress=False)
    version, absent = store.table.version, "0" * 16
    with pytest.raises(KeyError, match=f"{absent}.*nothing was deleted.*missing_ok=True"):
        store.delete([ids[0], absent, ids[1]])
    assert store.table.version == version and sorted(store.ids()) == sorted(ids)
    store.delete([ids[0], absent, ids[1]], missing_ok=True)  # one commit for the ids that are stored
    assert store.table.version == version + 1 and sorted(store.ids()) == sorted(ids[2:])
    store.delete(absent, missing_ok=True)
    assert store.table.version == version + 1
    with pytest.raises(ValueError, match="not a store entry id"):
        store.delete(["../x"], missing_ok=True)


# ------------------------------------------------------------------------------------ the retry helper
class Contended:
    """Fails with Lance's conflict errors ``failures`` times, then returns "ok"."""

    MESSAGES = (
        "lance error: Retryable commit conflict for version 25: This Rewrite transaction was preempted by concurrent transaction Delete at version 25. Please retry.",
        "lance error: Too many concurrent writers. Attempted 10 times",
        "lance error: Incompatible transaction: This UpdateConfig transaction is incompatible with concurrent transaction UpdateConfig at version 4.",
        "lance error: Dataset at path s/states.lance/_versions/53.manifest was not found: Not found",
    )

    def __init__(self, failures):
        self.failures, self.calls = failures, 0

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(self.MESSAGES[self.calls % len(self.MESSAGES)])
        return "ok"


def test_the_retry_helper_backs_off_and_then_names_the_contention():
    from hf_statecompose.store.lance import retry_contended

    sleeps, refreshed = [], []
    operation = Contended(5)
    assert (
        retry_contended(
            operation, "delete", "store s", attempts=6, sleep=sleeps.append, refresh=lambda: refreshed.append(1)
        )
        == "ok"
    )
    assert operation.calls == 6 and len(sleeps) == len(refreshed) == 5
    for n, delay in enumerate(sleeps):  # jittered: between half and all of 0.05 * 2**n (capped at 2 s)
        assert min(2.0, 0.05 * 2**n) / 2 <= delay <= min(2.0, 0.05 * 2**n)
    sleeps.clear()
    with pytest.raises(
        TimeoutError,
        match=r"delete failed 4 times.*other processes kept committing conflicting changes.*retry when fewer",
    ):
        retry_contended(Contended(10), "delete", "store s", attempts=4, sleep=sleeps.append)
    assert len(sleeps) == 3 and sum(sleeps) <= 0.35
    with pytest.raises(TimeoutError, match="failed 1 times"):  # no new attempt once the time budget is spent
        retry_contended(Contended(10), "compact", "store s", attempts=10, budget=0, sleep=sleeps.append)
    calls = []

    def other():
        calls.append(1)
        raise ValueError("no entries ['0000000000000000']")

    with pytest.raises(ValueError, match="no entries"):  # anything else at once
        retry_contended(other, "delete", "store s", sleep=sleeps.append)
    assert len(calls) == 1


def test_every_write_goes_through_the_retry_helper(tmp_path, monkeypatch):
    store = make_store(tmp_path / "s", tiny_model("mamba2"))
    ids = store.add(TEXTS[:2], show_progress=False)
    store.table.add(_copy_rows(store, ids[:1]))
    for name in ("merge_insert", "add", "delete", "optimize"):
        real, failed = getattr(store.table, name), []

        def flaky(*args, _real=real, _failed=failed, **kwargs):
            if not _failed:
                _failed.append(1)
                raise RuntimeError("lance error: Retryable commit conflict for version 9: preempted. Please retry.")
            return _real(*args, **kwargs)

        monkeypatch.setattr(store.table, name, flaky)
    store.add(TEXTS[2:4], ids=[f"{n:016x}" for n in range(2)], show_progress=False)  # merge_insert
    store.add(TEXTS[4:5], show_progress=False)  # add
    assert store.repair()["removed_copies"] == 1  # add, then delete
    store.delete(ids[1])  # delete
    store.compact()  # optimize
    assert sorted(e.text for e in store.entries()) == sorted([TEXTS[0]] + TEXTS[2:5])


def test_a_store_made_before_the_primary_key_declares_it_at_its_first_write(tmp_path):
    from hf_statecompose.store.lance import PRIMARY_KEY

    model = tiny_model("mamba2")
    store = _legacy_store(tmp_path / "s", model)
    assert store.table.schema.field("id").nullable
    ids = [f"{n:016x}" for n in range(3)]
    store.add(TEXTS[:3], ids=ids, show_progress=False)
    field = store.table.schema.field("id")
    assert not field.nullable and field.metadata[PRIMARY_KEY.encode()] == b"true"
    assert store.add(TEXTS[:3], ids=ids, show_progress=False) == ids and max(copies(store).values()) == 1
    assert [e.text for e in make_store(tmp_path / "s", model).entries(ids)] == TEXTS[:3]
