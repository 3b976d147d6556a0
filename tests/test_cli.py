"""The command line: every user error is one line ``hf-statecompose: error: ...`` with exit status 2 and
no traceback; argument errors and ``--help`` never import torch; a failed ``build`` leaves nothing behind."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_statecompose import cli
from hf_statecompose.cli import main

from store_helpers import TEXTS, BagOfWords

PROG_ERROR = "hf-statecompose: error: "


def run_main(argv, capsys):
    """``(exit status, stdout, stderr)`` of an in-process ``main(argv)``."""
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code, err, match):
    assert code == 2, err
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, f"not one line: {err!r}"
    assert err.startswith(PROG_ERROR), err
    assert match in err, err


def no_ray(monkeypatch):
    """Starting Ray fails the test: encode-corpus refuses bad input on the driver, before it starts Ray."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("lancedb")

    def started(*args, **kwargs):
        raise RuntimeError("Ray was started")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", started)


@pytest.fixture
def files(tmp_path):
    """Inputs and broken stores, made once per test (all tiny)."""
    good = tmp_path / "passages.jsonl"
    good.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:4]))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{oops\n')
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("not a store")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "store.json").write_text('{"format_version": 1, "info": ')
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "store.json").write_text("[1, 2]")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "orphan").mkdir()
    (tmp_path / "orphan" / "store.json").write_text(json.dumps({"info": {"model": str(tmp_path / "gone")}}))
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"title": "no text"}\n')
    (tmp_path / "notok").mkdir()  # a checkpoint folder without tokenizer files
    (tmp_path / "notok" / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    (tmp_path / "folder_store").mkdir()  # what encode-corpus must refuse: a folder store (its header is enough)
    (tmp_path / "folder_store" / "store.json").write_text(json.dumps({"format_version": 1, "info": {"model": "demo"}}))
    return tmp_path


# argv (with {tmp} for the test's folder) -> a piece of the expected message. None of these loads a model.
BAD_ARGUMENTS = [
    ([], "required: COMMAND"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["query", "{tmp}/s"], "required: query"),
    (["query", "{tmp}/s", ""], "the query is empty"),
    (["query", "{tmp}/s", "   "], "the query is empty"),
    (["query", "{tmp}/s", "q", "-k", "-1"], "argument -k: must be >= 0, got -1"),
    (["query", "{tmp}/s", "q", "-k", "two"], "argument -k: expected an integer, got 'two'"),
    (["query", "{tmp}/s", "q", "--composition", "nope"], "invalid choice: 'nope' (choose from 'soup'"),
    (["query", "{tmp}/s", "q", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["build", "{tmp}/s", "{tmp}/passages.jsonl", "--batch-size", "0"], "argument --batch-size: must be >= 1"),
    (["build", "{tmp}/s", "{tmp}/passages.jsonl", "--storage-dtype", "fp16"], "invalid choice: 'fp16'"),
    (["build", "{tmp}/s", "{tmp}/passages.jsonl", "--model", "gpt2"], "'gpt2' is not one of demo"),
    (["build", "{tmp}/s", "{tmp}/passages.jsonl", "--model", "{tmp}/empty_dir"], "holds no config.json"),
    (["delete", "{tmp}/s"], "required: ID"),
    (["build", "{tmp}/s", "{tmp}/missing.jsonl"], "no input file"),
    (["build", "{tmp}/s", "{tmp}/latin1.txt"], "latin1.txt is not UTF-8 text (byte 3"),
    (["build", "{tmp}/s", "{tmp}/bad.jsonl"], "bad.jsonl:2: not JSON"),
    (["build", "{tmp}/s", "{tmp}/blank.txt"], "blank.txt holds no passages"),
    (["build", "{tmp}/busy", "{tmp}/passages.jsonl"], "exists and is not a store (no store.json)"),
    (["build", "{tmp}/a_file", "{tmp}/passages.jsonl"], "is a file, not a store folder"),
    (["stats", "{tmp}/s"], "no store at"),
    (["delete", "{tmp}/s", "0123456789abcdef"], "no store at"),
    (["compact", "{tmp}/empty_dir"], "no store at"),
    (["stats", "{tmp}/corrupt"], "store.json is unreadable or corrupted"),
    (["query", "{tmp}/corrupt", "hello"], "store.json is unreadable or corrupted"),
    (["stats", "{tmp}/listed"], "store.json is corrupted (not a store header)"),
    # (stats reads the store's files without a model: compact loads the recorded one)
    (["compact", "{tmp}/orphan"], "records the model '{tmp}/gone', which cannot be loaded here: pass --model"),
    # issue 21: the outside trial's bad inputs, every subcommand
    (["build", "{tmp}/s", "{tmp}/passages.jsonl", "--model", "{tmp}/notok"], "notok' holds no tokenizer"),
    (["build", "{tmp}/s", "{tmp}/empty.jsonl"], "empty.jsonl holds no passages"),
    (
        ["build", "{tmp}/s", "{tmp}/nofield.jsonl"],
        "nofield.jsonl:1: expected an object with a non-empty string field 'text'",
    ),
    (
        ["build", "{tmp}/s", "{tmp}/passages.jsonl", "--text-field", "body"],
        "passages.jsonl:1: expected an object with a non-empty string field 'body'",
    ),
    (["build", "{tmp}/s", "{tmp}/empty_dir"], "no input file"),
    (
        ["build", "{tmp}/a_file/s", "{tmp}/passages.jsonl"],
        "cannot create a store at {tmp}/a_file/s: {tmp}/a_file is a file, not a folder",
    ),
    (["query", "{tmp}/a_file", "hello"], "is a file, not a store folder"),
    (["query", "{tmp}/s", "hello"], "no store at"),
    (["query", "{tmp}/s", "hello", "--model", "{tmp}/notok"], "notok' holds no tokenizer"),
    (["delete", "{tmp}/a_file", "0123456789abcdef"], "is a file, not a store folder"),
    (["compact", "{tmp}/a_file"], "is a file, not a store folder"),
    (["store", "migrate", "{tmp}/s", "{tmp}/d"], "no store at"),
    (["store", "migrate", "{tmp}/a_file", "{tmp}/d"], "is a file, not a store folder"),
    (["encode-corpus", "{tmp}/s", "{tmp}/missing.jsonl"], "no input file"),
    (["encode-corpus", "{tmp}/s", "{tmp}/bad.jsonl"], "bad.jsonl:2: not JSON"),
    (["encode-corpus", "{tmp}/s", "{tmp}/empty.jsonl"], "empty.jsonl holds no passages"),
    (["encode-corpus", "{tmp}/s", "{tmp}/passages.jsonl", "--actors", "0"], "argument --actors: must be >= 1"),
    (["encode-corpus", "{tmp}/s", "{tmp}/passages.jsonl", "--model", "{tmp}/notok"], "notok' holds no tokenizer"),
    (["encode-corpus", "{tmp}/s", "{tmp}/passages.jsonl", "--model", "{tmp}/missing"], "missing' is not one of demo"),
    (["encode-corpus", "{tmp}/folder_store", "{tmp}/passages.jsonl"], "holds a folder store, not a Lance store"),
    (["encode-corpus", "{tmp}/busy", "{tmp}/passages.jsonl"], "busy exists and is not a Lance store"),
    (["encode-corpus", "{tmp}/a_file", "{tmp}/passages.jsonl"], "is a file, not a store folder"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[m.split(" (")[0] for _, m in BAD_ARGUMENTS])
def test_bad_invocations_are_one_line_exit_2(files, capsys, monkeypatch, argv, message):
    if argv[:1] == ["encode-corpus"]:
        no_ray(monkeypatch)
    before = sorted(p.name for p in files.iterdir())
    code, out, err = run_main([a.replace("{tmp}", str(files)) for a in argv], capsys)
    assert_user_error(code, err, message.replace("{tmp}", str(files)))
    assert out == ""
    assert sorted(p.name for p in files.iterdir()) == before  # nothing created
    assert list((files / "empty_dir").iterdir()) == []


def test_composition_choices_are_the_methods():
    from hf_statecompose.composition import METHODS

    assert cli.COMPOSITIONS == METHODS
    from hf_statecompose.store import STORAGE_DTYPES

    assert set(cli.STORAGE_DTYPES) == set(STORAGE_DTYPES)


def test_every_option_has_help():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if a.dest == "command")
    for name, sub in commands.choices.items():
        if name == "lm-eval":  # lm-eval's own command line
            continue
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_help_and_argument_errors_do_not_import_torch(files):
    """The console script and ``python -m`` import the package first: that, the parser and the checks
    before any model is needed must stay light (a CLI call was 9-15 s on a loaded machine)."""
    script = textwrap.dedent(f"""
        import json, sys
        from hf_statecompose.cli import main
        codes = []
        for argv in (["--help"], ["query", "--help"], ["build", "s", "x", "--batch-size", "0"], ["stats", {str(files / "corrupt")!r}],
                     ["build", "s", {str(files / "latin1.txt")!r}]):
            try:
                codes.append(main(argv))
            except SystemExit as done:
                codes.append(done.code)
        print(json.dumps([codes, "torch" in sys.modules, "transformers" in sys.modules]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=files)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[0, 0, 2, 2, 2], False, False]
    errors = done.stderr.splitlines()
    assert len(errors) == 3 and all(line.startswith(PROG_ERROR) for line in errors), done.stderr


def test_the_console_module_reports_a_corrupt_store_in_one_line(files):
    done = subprocess.run(
        [sys.executable, "-m", "hf_statecompose", "stats", str(files / "corrupt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(PROG_ERROR + str(files / "corrupt" / "store.json"))


# ------------------------------------------------------------------- errors that need a model (the demo)
@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A store built by the CLI with the embedded demo Mamba-2 and a bag-of-words retriever (instant)."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "passages.jsonl").write_text(
        "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(TEXTS[:4]))
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("hf_statecompose.retrieval.default_retriever", BagOfWords)
        assert main(["build", str(folder / "store"), str(folder / "passages.jsonl"), "--batch-size", "2"]) == 0
    return folder


@pytest.fixture
def bag_of_words(monkeypatch):
    monkeypatch.setattr("hf_statecompose.retrieval.default_retriever", BagOfWords)


def test_the_build_renames_a_complete_store_into_place(built):
    header = json.loads((built / "store" / "store.json").read_text())
    assert header["info"] == {"model": "demo"}
    assert sorted(p.name for p in built.iterdir()) == ["passages.jsonl", "store"]  # no building folder left


def test_store_errors_are_one_line(built, bag_of_words, capsys):
    store = built / "store"
    code, _, err = run_main(["delete", store, "0123456789abcdef"], capsys)
    assert_user_error(code, err, "0123456789abcdef")
    code, _, err = run_main(["delete", store, "../store.json"], capsys)
    assert_user_error(code, err, "'../store.json' is not a store entry id")
    code, _, err = run_main(["query", store, "hello", "--model", "demo-mamba"], capsys)
    assert_user_error(code, err, "was built with another model")
    code, out, err = run_main(["stats", store], capsys)
    assert code == 0 and json.loads(out)["entries"] == 4


def test_a_failed_build_leaves_nothing_behind(built, bag_of_words, capsys, monkeypatch):
    from hf_statecompose.store import FolderStateStore

    original = FolderStateStore.add

    def fails_after_one_batch(self, texts, metadata=None, batch_size=16, show_progress=True):
        original(self, texts[:batch_size], metadata[:batch_size], batch_size=batch_size, show_progress=False)
        raise ValueError("the tokenizer produced no tokens for 'x'")  # as the store reports a bad passage

    monkeypatch.setattr(FolderStateStore, "add", fails_after_one_batch)
    target = built / "new" / "store"
    code, _, err = run_main(["build", target, built / "passages.jsonl", "--batch-size", "2"], capsys)
    assert_user_error(code, err, "no tokens")
    assert not target.exists() and list((built / "new").iterdir()) == []

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(FolderStateStore, "add", interrupted)
    (built / "empty").mkdir()
    code, _, err = run_main(["build", built / "empty", built / "passages.jsonl"], capsys)
    assert code == 130 and err == "hf-statecompose: interrupted\n"
    assert list((built / "empty").iterdir()) == [] and not any(p.name.startswith(".") for p in built.iterdir())


def test_a_checkpoint_that_is_not_mamba_is_refused(built, capsys, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)).save_pretrained(folder)
    demo_tokenizer = Path(cli.__file__).parent / "demo" / "models" / "mamba2"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((demo_tokenizer / name).read_bytes())
    code, _, err = run_main(["build", tmp_path / "s", built / "passages.jsonl", "--model", folder], capsys)
    assert_user_error(code, err, "GPT2LMHeadModel is not a model hf_statecompose supports")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    (tmp_path / "broken" / "tokenizer.json").write_bytes((demo_tokenizer / "tokenizer.json").read_bytes())
    code, _, err = run_main(["build", tmp_path / "s", built / "passages.jsonl", "--model", tmp_path / "broken"], capsys)
    assert_user_error(code, err, "cannot load a causal LM and its tokenizer from it")
    assert not (tmp_path / "s").exists()


def test_query_and_extending_a_store(built, bag_of_words, capsys, tmp_path):
    import shutil

    store = shutil.copytree(built / "store", tmp_path / "store")
    code, out, err = run_main(["query", store, TEXTS[0][:30], "-k", "2", "--max-new-tokens", "2", "--json"], capsys)
    assert code == 0, err
    assert len(json.loads(out)["retrieved"]) == 2
    extra = tmp_path / "more.txt"
    extra.write_text("One more passage about rivers.\n\nAnd another about hills.\n")
    code, out, err = run_main(["build", store, extra], capsys)
    assert code == 0 and out.startswith("added 2 entries") and json.loads(out.split("\n", 1)[1])["entries"] == 6


def test_a_checkpoint_folder_is_recorded_by_its_absolute_path(bag_of_words, capsys, tmp_path, monkeypatch):
    demo = Path(cli.__file__).parent / "demo" / "models" / "mamba2"
    (tmp_path / "p.txt").write_text("A passage.\n\nAnother one.\n")
    monkeypatch.chdir(demo.parent)
    code, _, err = run_main(["build", tmp_path / "s", tmp_path / "p.txt", "--model", "mamba2"], capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "s" / "store.json").read_text())["info"]["model"] == str(demo)
    monkeypatch.chdir(tmp_path)  # the relative name means nothing here: the recorded path still does
    code, out, err = run_main(["stats", "s"], capsys)
    assert code == 0 and json.loads(out)["entries"] == 2, err


def test_a_checkpoint_without_a_usable_tokenizer_is_refused(capsys, tmp_path):
    # transformers 5 makes an empty tokenizer for such a folder: every passage was refused as "no tokens"
    import shutil

    folder = shutil.copytree(
        Path(cli.__file__).parent / "demo" / "models" / "mamba2",
        tmp_path / "model",
        ignore=shutil.ignore_patterns("tokenizer*"),
    )
    (tmp_path / "p.txt").write_text("A passage.\n")
    code, _, err = run_main(["build", tmp_path / "s", tmp_path / "p.txt", "--model", folder], capsys)
    assert_user_error(code, err, "model' holds no tokenizer (none of tokenizer.json")
    (folder / "tokenizer_config.json").write_text("{}")  # a tokenizer file, but no vocabulary
    code, _, err = run_main(["build", tmp_path / "s", tmp_path / "p.txt", "--model", folder], capsys)
    assert_user_error(code, err, "its tokenizer has no vocabulary")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "p.txt"]  # nothing created


def test_encode_corpus_refuses_another_models_or_retrievers_lance_store_before_ray(
    tmp_path, capsys, monkeypatch, bag_of_words
):
    no_ray(monkeypatch)
    from hf_statecompose.demo import load_demo
    from hf_statecompose.store import StateStore

    model, tokenizer = load_demo("mamba2")
    StateStore(
        str(tmp_path / "lance"), model, tokenizer, retriever=BagOfWords(), backend="lance", info={"model": "demo"}
    )
    other = type("Other", (BagOfWords,), {"name": "another-retriever"})
    StateStore(str(tmp_path / "other"), model, tokenizer, retriever=other(), backend="lance", info={"model": "demo"})
    (tmp_path / "p.txt").write_text("A passage.\n\nAnother one.\n")
    code, _, err = run_main(["encode-corpus", tmp_path / "lance", tmp_path / "p.txt", "--model", "demo-mamba"], capsys)
    assert_user_error(code, err, "was built with another model (mamba2, 6 layers, hidden 256; recorded as 'demo')")
    code, _, err = run_main(["encode-corpus", tmp_path / "other", tmp_path / "p.txt"], capsys)
    assert_user_error(code, err, "was indexed with the retriever 'another-retriever', not 'test-bag-of-words'")


SLOW_BUILD = """
import sys, time
sys.path.insert(0, {tests!r})
from store_helpers import BagOfWords

class SlowBagOfWords(BagOfWords):  # the same retriever (name, vectors), stalled once it embeds the passages
    def __call__(self, texts):
        if any("stall" in text for text in texts):
            open({marker!r}, "w").close()
            time.sleep(600)
        return super().__call__(texts)

import hf_statecompose.retrieval
hf_statecompose.retrieval.default_retriever = SlowBagOfWords
from hf_statecompose.cli import main
main(["build", {target!r}, {passages!r}])
"""


def test_a_killed_builds_folder_is_removed_by_the_next_build_but_never_a_live_ones(tmp_path, capsys, bag_of_words):
    import os
    import time

    target, marker = tmp_path / "store", tmp_path / "stalled"
    for name, texts in (("slow.txt", ["a passage that will stall"]), ("a.txt", TEXTS[:2]), ("b.txt", TEXTS[2:4])):
        (tmp_path / name).write_text("\n\n".join(texts) + "\n")
    script = SLOW_BUILD.format(
        tests=str(Path(__file__).parent), marker=str(marker), target=str(target), passages=str(tmp_path / "slow.txt")
    )
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parent.parent), "OMP_NUM_THREADS": "1"}
    builder = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert builder.poll() is None, builder.stderr.read()
            assert time.monotonic() < deadline, "the builder never reached its passages"
            time.sleep(0.05)
        building = [p for p in tmp_path.iterdir() if p.name.startswith(".store.building-")]
        assert len(building) == 1 and (building[0] / "store").is_dir()
        # concurrent builds of the same store (creating it, then extending it) leave the live build's folder alone
        code, _, err = run_main(["build", target, tmp_path / "a.txt"], capsys)
        assert code == 0, err
        assert building[0].is_dir()
    finally:
        builder.kill()  # SIGKILL: no finally, no cleanup in the builder
        builder.wait(timeout=60)
    assert builder.returncode == -9
    assert building[0].is_dir()  # left behind by the dead builder ...
    code, out, err = run_main(["build", target, tmp_path / "b.txt"], capsys)
    assert code == 0 and out.startswith("added 2 entries"), err
    assert not building[0].exists()  # ... and removed by the next build
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "slow.txt", "stalled", "store"]
    assert json.loads((target / "store.json").read_text())["info"] == {"model": "demo"}


def test_an_internal_error_keeps_its_traceback(files, monkeypatch):
    # a bug is not a user error: it propagates (the console script prints its traceback, exit 1)
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "open_store", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["compact", str(files / "orphan")])


def test_stale_building_folders_without_a_lock_are_removed_and_young_starting_ones_kept(tmp_path):
    import os
    import time

    target = tmp_path / "store"
    legacy = tmp_path / ".store.building-old"  # left by a version without locks: no builder.lock
    (legacy / "store").mkdir(parents=True)
    old_start, young_start = tmp_path / ".store.starting-a", tmp_path / ".store.starting-b"
    old_start.mkdir()
    young_start.mkdir()
    an_hour_ago = time.time() - 3600
    os.utime(old_start, (an_hour_ago, an_hour_ago))
    other = tmp_path / ".other.building-x"  # another store's: not this build's business
    other.mkdir()
    assert sorted(p.name for p in cli._remove_stale_builds(target)) == [".store.building-old", ".store.starting-a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.building-x", ".store.starting-b"]


def test_a_store_created_meanwhile_is_reported_not_overwritten(tmp_path, capsys, monkeypatch):
    target = tmp_path / "store"

    class RacingBagOfWords(BagOfWords):  # another build lands the store while this one encodes
        def __call__(self, texts):
            if any("race" in text for text in texts):
                target.mkdir()
                (target / "store.json").write_text("{}")
            return super().__call__(texts)

    monkeypatch.setattr("hf_statecompose.retrieval.default_retriever", RacingBagOfWords)
    (tmp_path / "p.txt").write_text("a race to the store\n")
    code, _, err = run_main(["build", target, tmp_path / "p.txt"], capsys)
    last = err.split("\n")[-2]  # after the encoding progress, which is shown
    assert (
        code == 2
        and "Traceback" not in err
        and last.startswith(PROG_ERROR)
        and "was created meanwhile (by another build?)" in last
    ), err
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "store"] and (target / "store.json").read_text() == "{}"
    )
