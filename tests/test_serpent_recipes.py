"""The SeRpEnt recipe and benchmark run end to end (smoke sizes), and the committed pairs are matched."""

import json
import os
import subprocess
import sys

import pytest

hsc = pytest.importorskip("hf_statecompose")
if not hasattr(hsc, "SeRpEntMambaForCausalLM"):
    pytest.skip("hf_statecompose has no SeRpEnt model", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "recipes", "configs", "serpent.json")


def run(*args):
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("task", ["lm", "listops"])
def test_committed_pairs_are_matched_within_tolerance(task):
    import transformers

    config = json.load(open(CONFIG))
    settings = config["tasks"][task]
    vocab = 4096 if task == "lm" else 17
    counts = {}
    for name, spec in settings["models"].items():
        cls = getattr(hsc, spec["class"], None) or getattr(transformers, spec["class"])
        counts[name] = sum(p.numel() for p in cls(cls.config_class(**spec["config"], vocab_size=vocab)).parameters())
    assert isinstance(counts["serpent"], int) and settings["models"]["serpent"]["class"] == "SeRpEntMambaForCausalLM"
    assert abs(counts["serpent"] / counts["mamba"] - 1) <= config["defaults"]["match_tolerance"] == 0.03


def test_recipe_smoke_trains_both_models_on_both_tasks_and_saves_loadable_checkpoints(tmp_path):
    import torch

    stdout = run("recipes/serpent.py", "--task", "all", "--smoke", "--out", str(tmp_path), "--threads", "1")
    assert "| SeRpEnt |" in stdout and "| Mamba-1 |" in stdout
    results = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("*-seed0.json")}
    assert sorted(results) == sorted(f"{t}-{m}-seed0.json" for t in ("lm", "listops") for m in ("serpent", "mamba"))
    for result in results.values():
        assert (
            result["steps"] == 3
            and result["train_seconds"] >= 0
            and result["git_commit"]
            and result["serpent_source_sha256"]
        )
        assert set(result["parameters"]) == {"serpent", "mamba"}
    lm = results["lm-serpent-seed0.json"]["metrics"]
    assert 0 <= lm["top1"] <= lm["top5"] <= 1 and lm["loss"] > 0
    assert 0 <= results["listops-mamba-seed0.json"]["metrics"]["accuracy"] <= 1
    assert (tmp_path / "summary.md").read_text().count("###") == 2

    folder = tmp_path / "checkpoints" / "lm-serpent"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "serpent_mamba"
    # nothing to fetch: any auto_map points at the code files saved beside the weights, not at a Hub repo
    assert all(
        "--" not in ref and (folder / f"{ref.split('.')[0]}.py").is_file()
        for ref in config.get("auto_map", {}).values()
    )
    model = hsc.SeRpEntMambaForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder, local_files_only=True)("The river", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    assert (tmp_path / "checkpoints" / "listops-mamba" / "tokenizer.json").is_file()
    card = folder / "README.md"
    assert "| SeRpEnt | " in card.read_text() and "Mamba-1" in card.read_text()
    card.unlink()
    (tmp_path / "summary.md").unlink()
    run("recipes/serpent.py", "--smoke", "--report-only", "--out", str(tmp_path))  # rebuilds both from the JSON results
    assert card.is_file() and (tmp_path / "summary.md").read_text().count("###") == 2


def test_speed_benchmark_smoke_writes_ratios(tmp_path):
    out = tmp_path / "speed.json"
    run("benchmarks/serpent_speed.py", "--smoke", "--out", str(out), "--threads", "1")
    rows = json.loads(out.read_text())["rows"]
    assert {r["model"] for r in rows} == {"serpent", "mamba", "mamba (hsc path)"}
    for row in rows:
        assert row["forward_tokens_per_second"] > 0 and row["decode_step_seconds"] > 0
        if row["model"] != "serpent":
            assert row["serpent_forward_speed_ratio"] > 0 and row["serpent_decode_time_ratio"] > 0
