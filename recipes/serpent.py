"""SeRpEnt vs Mamba-1 in miniature: the SeRpEnt paper's Table 2 (language modelling) and Table 1's ListOps
row, on a 2-core CPU, at matched parameter count.

    python recipes/serpent.py --task all                 # both tasks, both models, seeds of the config (~40 min)
    python recipes/serpent.py --task lm & python recipes/serpent.py --task listops   # side by side (~25 min)
    python recipes/serpent.py --task lm --seeds 0        # one task, one seed
    python recipes/serpent.py --task all --smoke --out /tmp/serpent-smoke   # a few steps (the tests run this)

Experiments are data: ``recipes/configs/serpent.json`` (model configs, steps, batch, sequence length,
weight decay 0.05 as the paper's App. B.2, lr 2e-3 (the paper's 5e-4 is for 50 epochs), seeds). For every task and seed both models are
initialised from ``torch.manual_seed(seed)`` and see **the same batches in the same order** (the data
stream is seeded by the seed alone), with the same optimiser and schedule (AdamW, linear warm-up, cosine
to ``final_lr_fraction`` of lr, gradient clipping). The pair must be within ``match_tolerance`` (3 %)
in parameter count, counted on the instantiated models, or the run stops before training.

* ``lm``: next-token prediction on the training articles of the demo models' Wikipedia
  (:mod:`hf_statecompose.demo.corpora`, the held-out articles chosen by title hash as in
  ``recipes/train_demo.py``), tokenised with the demo models' 4096-token BPE; random ``seq_len``
  windows of the training stream. Metrics on every full ``seq_len`` window of the held-out articles (no
  context carried): mean token loss (nats), top-1 and top-5 next-token accuracy.
* ``listops``: :mod:`hf_statecompose.demo.listops` (LRA's generator; lengths in the config), as
  ``expression = answer`` with the loss on the answer token only; accuracy = argmax over the 10 digits
  at the ``=`` position, on a held-out set never trained on; majority-class baseline reported.

Mamba-1 trains through hf_statecompose's state-aware path (``hsc.enable`` + an empty
``ComposableMambaCache``, as ``train_demo.py``: the same maths as transformers' forward, whose CPU
fallback is ~15x slower); SeRpEnt through its own forward.

Output: ``<out>/<task>-<model>-seed<seed>.json`` per run (config, parameter counts, seed, steps, wall
time, metrics, git commit, training-loss log), ``<out>/summary.md`` (the table, also printed; runs of
the other task already in ``<out>`` are kept in it), and the seed-0 checkpoints
``<checkpoints>/<task>-<model>/`` (safetensors + tokenizer + model card, the card also written to
``model_cards/serpent-<task>-<model>.md`` for checkpoints inside the repository).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "serpent.json"
TASKS = ("lm", "listops")
MODELS = ("serpent", "mamba")
NAMES = {"serpent": "SeRpEnt", "mamba": "Mamba-1"}


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


def load_experiments(path: Path, smoke: bool) -> dict:
    """``{task: its full settings}``: defaults, then the task's entries, then (``smoke``) the smoke overrides."""
    data = json.loads(Path(path).read_text())
    smoke_over = data.get("smoke", {}) if smoke else {}
    top_smoke = {k: v for k, v in smoke_over.items() if k != "tasks"}
    out = {}
    for task, settings in data["tasks"].items():
        merged = merge(merge(data["defaults"], settings), top_smoke)
        out[task] = merge(merged, smoke_over.get("tasks", {}).get(task, {}))
    return out


# ------------------------------------------------------------------------------------------- models
def model_class(name: str):
    import transformers

    import hf_statecompose as hsc

    for home in (hsc, transformers):
        try:
            return getattr(home, name)
        except AttributeError:
            continue
    raise SystemExit(f"model class {name!r} is neither in hf_statecompose nor in transformers")


def build_model(spec: dict, vocab_size: int, special_id: int):
    """The causal LM of ``spec`` ({"class": ..., "config": {...}}) with the task's vocabulary."""
    cls = model_class(spec["class"])
    kwargs = dict(
        spec["config"], vocab_size=vocab_size, pad_token_id=special_id, bos_token_id=special_id, eos_token_id=special_id
    )
    return cls(cls.config_class(**kwargs))


def is_stock_mamba(model) -> bool:
    from transformers import MambaForCausalLM

    return isinstance(model, MambaForCausalLM)


def prepare(model):
    """Mamba-1 on the state-aware path (see the module docstring); anything else as it is."""
    import hf_statecompose as hsc

    return hsc.enable(model) if is_stock_mamba(model) else model


def forward(model, input_ids, attention_mask=None, labels=None):
    import hf_statecompose as hsc

    kwargs = {}
    if is_stock_mamba(model):
        kwargs = dict(use_cache=True, **hsc.compat.cache_kwargs(hsc.ComposableMambaCache.empty_for(model)))
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)


def serpent_source_digest() -> str:
    """sha256 (first 12 hex digits) of the SeRpEnt model's source files: which code a result came from,
    even when it was run before that code was committed."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "hf_statecompose" / "models" / "serpent").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def check_matched(counts: dict, tolerance: float) -> float:
    """Relative difference SeRpEnt vs Mamba; refuses a pair further apart than ``tolerance``."""
    difference = counts["serpent"] / counts["mamba"] - 1
    if abs(difference) > tolerance:
        raise SystemExit(
            f"parameter counts not matched: SeRpEnt {counts['serpent']:,} vs Mamba {counts['mamba']:,} ({difference:+.1%}, "
            f"tolerance ±{tolerance:.0%}); change SeRpEnt's intermediate_size or Mamba's expand/hidden_size in {CONFIG.name}"
        )
    return difference


# --------------------------------------------------------------------------------------------- data
class LMTask:
    def __init__(self, settings: dict):
        from transformers import AutoTokenizer

        from hf_statecompose.demo.corpora import wikipedia_split

        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(ROOT / settings["tokenizer"], local_files_only=True)
        train, held_out = wikipedia_split()
        train = train[: settings.get("train_articles")]
        self.held_out_titles = [title for title, _ in held_out]
        eos = self.tokenizer.eos_token_id
        self.train_stream = self._stream(train, eos)
        self.held_out_stream = [self._stream([article], eos) for article in held_out]
        self.vocab_size, self.special_id = len(self.tokenizer), eos

    def _stream(self, articles, eos):
        import torch

        ids: list[int] = []
        for _, text in articles:
            ids += self.tokenizer(text)["input_ids"] + [eos]
        return torch.tensor(ids)

    def batches(self, seed: int):
        """Endless ``(input_ids, attention_mask, labels)``: random windows of the training stream."""
        import torch

        rng, length, size = random.Random(seed), self.settings["seq_len"], self.settings["batch_size"]
        while True:
            starts = [rng.randrange(len(self.train_stream) - length) for _ in range(size)]
            ids = torch.stack([self.train_stream[s : s + length] for s in starts])
            yield ids, None, ids

    def evaluate(self, model) -> dict:
        """Mean token loss, top-1 / top-5 accuracy over every full window of the held-out articles."""
        import torch

        length = self.settings["seq_len"]
        windows = torch.cat([s[: len(s) // length * length].view(-1, length) for s in self.held_out_stream])
        windows = windows[: self.settings.get("eval_windows")]
        total_loss, top1, top5, count = 0.0, 0, 0, 0
        with torch.no_grad():
            for chunk in windows.split(self.settings["eval_batch_size"]):
                logits = forward(model, chunk).logits[:, :-1].float()
                targets = chunk[:, 1:]
                total_loss += float(
                    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
                )
                best = logits.topk(5, dim=-1).indices
                top1 += int((best[..., 0] == targets).sum())
                top5 += int((best == targets[..., None]).any(-1).sum())
                count += targets.numel()
        loss = total_loss / count
        return {
            "loss": loss,
            "perplexity": math.exp(loss),
            "top1": top1 / count,
            "top5": top5 / count,
            "tokens": count,
            "windows": len(windows),
        }

    def data_info(self) -> dict:
        return {
            "train_tokens": len(self.train_stream),
            "held_out_articles": self.held_out_titles,
            "held_out_tokens": sum(len(s) for s in self.held_out_stream),
        }

    def save_extras(self, out: Path) -> None:
        self.tokenizer.save_pretrained(out)


class ListOpsTask:
    def __init__(self, settings: dict):
        from hf_statecompose.demo import listops

        self.settings, self.listops = settings, listops
        self.config = listops.ListOpsConfig(**settings["generator"])
        self.held_out = listops.examples(settings["eval_seed"], settings["eval_examples"], self.config)
        self.exclude = frozenset(e.tokens for e in self.held_out)
        self.vocab_size, self.special_id = len(listops.VOCAB), listops.PAD_ID

    def batches(self, seed: int):
        """Endless left-padded ``(input_ids, attention_mask, labels)`` of fresh examples (held-out excluded)."""
        examples = self.listops.stream(seed, self.config, self.exclude)
        while True:
            yield self.listops.collate([next(examples) for _ in range(self.settings["batch_size"])])

    def evaluate(self, model) -> dict:
        """Answer loss and accuracy (argmax over the 10 digits at the ``=`` position) on the held-out set."""
        import torch

        digits = torch.tensor(self.listops.DIGIT_IDS)
        total_loss, correct = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(self.held_out), self.settings["eval_batch_size"]):
                batch = self.held_out[start : start + self.settings["eval_batch_size"]]
                ids, mask, _ = self.listops.collate(batch)
                logits = forward(model, ids, attention_mask=mask).logits[:, -2].float()  # predicts the answer
                answers = torch.tensor([e.answer for e in batch])
                total_loss += float(torch.nn.functional.cross_entropy(logits, digits[answers], reduction="sum"))
                correct += int((logits[:, digits].argmax(-1) == answers).sum())
        majority, baseline = self.listops.majority_baseline(self.held_out)
        return {
            "answer_loss": total_loss / len(self.held_out),
            "accuracy": correct / len(self.held_out),
            "majority_class": majority,
            "majority_baseline_accuracy": baseline,
            "examples": len(self.held_out),
        }

    def data_info(self) -> dict:
        lengths = [len(e.tokens) for e in self.held_out]
        return {
            "generator": self.settings["generator"],
            "held_out_examples": len(self.held_out),
            "held_out_mean_length": statistics.mean(lengths),
        }

    def save_extras(self, out: Path) -> None:
        self.listops.hf_tokenizer().save_pretrained(out)


# ------------------------------------------------------------------------------------------ training
def train_one(task, task_name: str, arch: str, seed: int, settings: dict) -> tuple[dict, object]:
    import torch

    torch.manual_seed(seed)
    model = prepare(build_model(settings["models"][arch], task.vocab_size, task.special_id)).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings["weight_decay"]}, {"params": rest, "weight_decay": 0.0}],
        lr=settings["lr"],
        betas=tuple(settings["betas"]),
    )
    steps, warmup, floor = settings["steps"], settings["warmup_steps"], settings["final_lr_fraction"]
    batches, log, start = task.batches(seed), [], time.time()
    for step in range(steps):
        progress = step / steps
        lr = (
            settings["lr"]
            * min(1.0, (step + 1) / warmup)
            * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask, labels = next(batches)
        loss = forward(model, ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log.append(round(loss.item(), 4))
        if (step + 1) % settings["log_every"] == 0 or step + 1 == steps:
            window = log[-settings["log_every"] :]
            print(
                f"  [{task_name} {arch} seed {seed}] step {step + 1}/{steps} loss {sum(window) / len(window):.3f} "
                f"lr {lr:.2e} {time.time() - start:.0f}s",
                flush=True,
            )
    train_seconds = time.time() - start
    model.eval()
    start = time.time()
    metrics = task.evaluate(model)
    eval_seconds = time.time() - start
    tail = log[-max(1, steps // 10) :]
    return {
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "seconds_per_step": round(train_seconds / steps, 3),
        "train_loss_last_10pct": sum(tail) / len(tail),
        "metrics": metrics,
        "train_loss_log": log[:: max(1, steps // 200)],
    }, model


def save_checkpoint(model, task, out: Path) -> None:
    import hf_statecompose as hsc

    out.mkdir(parents=True, exist_ok=True)
    if is_stock_mamba(model):
        hsc.disable(model)  # the stock class and mixers: the checkpoint loads with transformers alone
    model.save_pretrained(out)
    _drop_code_copies(out)
    task.save_extras(out)


def _drop_code_copies(out: Path) -> None:
    """These checkpoints ship inside this repository, next to the package: they load through the classes
    ``import hf_statecompose`` registers, so the copies of the modeling / config files that
    ``save_pretrained`` writes for ``trust_remote_code`` (and the ``auto_map`` naming them) would only be
    stale duplicates of the package's code. A checkpoint meant for the Hub keeps them (plain
    ``save_pretrained``)."""
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    if config.pop("auto_map", None) is None:
        return
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("modeling_serpent.py", "configuration_serpent.py"):
        (out / name).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------- report
def headline(task: str, metrics: dict) -> list[str]:
    if task == "lm":
        return [f"{metrics['loss']:.4f}", f"{metrics['top1']:.2%}", f"{metrics['top5']:.2%}"]
    return [f"{metrics['answer_loss']:.4f}", f"{metrics['accuracy']:.2%}"]


HEADERS = {"lm": ["held-out loss", "top-1", "top-5"], "listops": ["answer loss", "accuracy"]}
KEYS = {"lm": ["loss", "top1", "top5"], "listops": ["answer_loss", "accuracy"]}


def summary_table(results: list[dict]) -> str:
    """Markdown: one table per task, a row per model and seed, then the mean over seeds."""
    parts = []
    for task in TASKS:
        runs = [r for r in results if r["task"] == task]
        if not runs:
            continue
        rows = [
            f"### {task}",
            "",
            "| model | parameters | seed | steps | train min | " + " | ".join(HEADERS[task]) + " |",
            "|---|---:|---:|---:|---:|" + "---:|" * len(HEADERS[task]),
        ]
        for arch in MODELS:
            mine = sorted((r for r in runs if r["model"] == arch), key=lambda r: r["seed"])
            for r in mine:
                rows.append(
                    f"| {NAMES[arch]} | {r['parameters'][arch]:,} | {r['seed']} | {r['steps']} | {r['train_seconds'] / 60:.1f} | "
                    + " | ".join(headline(task, r["metrics"]))
                    + " |"
                )
            if len(mine) > 1:
                mean = {k: statistics.mean(r["metrics"][k] for r in mine) for k in KEYS[task]}
                rows.append(
                    f"| **{NAMES[arch]}, mean** | {mine[0]['parameters'][arch]:,} | {len(mine)} seeds | {mine[0]['steps']} | "
                    f"{statistics.mean(r['train_seconds'] for r in mine) / 60:.1f} | "
                    + " | ".join(f"**{v}**" for v in headline(task, mean))
                    + " |"
                )
        if task == "listops":
            rows += [
                "",
                f"Majority-class baseline on the held-out set: {runs[0]['metrics']['majority_baseline_accuracy']:.2%} "
                f"(always answering {runs[0]['metrics']['majority_class']}; {runs[0]['metrics']['examples']} examples).",
            ]
        parts.append("\n".join(rows))
    return "\n\n".join(parts) + "\n"


def render_card(result: dict, task_runs: list[dict], relative_out: str) -> str:
    task, arch = result["task"], result["model"]
    cls = result["config"]["models"][arch]["class"]
    counts = result["parameters"]
    load = (
        f'import hf_statecompose as hsc  # registers serpent_mamba\nmodel = hsc.{cls}.from_pretrained("{relative_out}")'
        if arch == "serpent"
        else f'from transformers import {cls}\nmodel = {cls}.from_pretrained("{relative_out}")'
    )
    s = result["config"]
    if task == "lm":
        what = (
            f"a next-token language model of Wikipedia text ({s['seq_len']}-token windows), trained on the training "
            f"articles of the Wikipedia excerpt in the `gensim` wheel (held out: {', '.join(result['data']['held_out_articles'])}) "
            "with the demo models' 4096-token byte-level BPE (saved here)."
        )
        licence = "cc-by-sa-4.0"
        licence_text = "Trained on Wikipedia text (© Wikipedia contributors, CC BY-SA 4.0); the weights are released under the same licence."
        tokenizer = (
            'from transformers import AutoTokenizer\ntok = AutoTokenizer.from_pretrained("' + relative_out + '")'
        )
    else:
        g = s["generator"]
        what = (
            f"ListOps (Long Range Arena's generator, `hf_statecompose.demo.listops`: MAX / MIN / MED / SM, max depth "
            f"{g['max_depth']}, max {g['max_args']} arguments, {g['min_length']}–{g['max_length']} tokens) as `expression = answer`, "
            "the answer digit predicted at the `=` position; a 17-token word-level tokenizer (saved here)."
        )
        licence = "apache-2.0"
        licence_text = "Synthetic data; Apache-2.0 like the package."
        tokenizer = (
            "from hf_statecompose.demo import listops\n"
            'ids, mask, _ = listops.collate([listops.ListOpsExample(tuple("[SM [MAX 3 8 ] [MIN 4 7 ] [MED 1 9 ] ]".split()), 7)])\n'
            "answer = model(input_ids=ids, attention_mask=mask).logits[0, -2, list(listops.DIGIT_IDS)].argmax()  # 7, if it learnt"
        )
    return f"""---
license: {licence}
library_name: transformers
tags: [{"serpent" if arch == "serpent" else "mamba"}, state-space-model, hf_statecompose, {task}, miniature-reproduction]
---

# serpent-{task}-{arch}: {NAMES[arch]}, {counts[arch] / 1e6:.2f}M parameters, {"language modelling" if task == "lm" else "ListOps"} (seed 0)

One of the four checkpoints of `hf_statecompose`'s miniature reproduction of the SeRpEnt paper
({"Table 2, language modelling" if task == "lm" else "Table 1, ListOps"}): SeRpEnt ({counts["serpent"]:,} parameters) vs
Mamba-1 ({counts["mamba"]:,}) at matched parameter count ({result["parameter_difference"]:+.1%}), same data, steps
and schedule. This is the **{NAMES[arch]}** one: {what} A tiny CPU model for comparing the two
architectures, not for use.

```python
{load}
{tokenizer}
```

## Training
`python recipes/serpent.py --task {task}` (config `recipes/configs/serpent.json`): {result["steps"]} steps of
{s["batch_size"]} sequences, AdamW lr {s["lr"]}, weight decay {s["weight_decay"]}, betas {tuple(s["betas"])}, {s["warmup_steps"]} warm-up
steps then cosine to {s["final_lr_fraction"]} × lr, gradient clipping {s["max_grad_norm"]}; seed {result["seed"]};
{result["train_seconds"] / 60:.1f} min on {result["device"]} with {result["threads"]} thread{"s" if result["threads"] > 1 else ""} (commit {result["git_commit"]},
SeRpEnt source sha256 {result.get("serpent_source_sha256", "?")}).
Model config: `{json.dumps(s["models"][arch]["config"])}`.

## Measured by that run (held-out data; every run of the comparison)
{summary_table(task_runs).replace("### " + task + chr(10) + chr(10), "")}
{composition_table(relative_out)}{licence_text}
"""


def composition_table(relative_out: str) -> str:
    """How far this checkpoint's composed states are from the concatenation (``benchmarks/serpent_composition.py``'s
    JSON, where it measured this checkpoint); empty otherwise."""
    path = ROOT / "benchmarks" / "results" / "serpent_composition.json"
    d = json.loads(path.read_text()) if path.exists() else {}
    name = next((n for n, m in d.get("models", {}).items() if m.get("path") == relative_out), None)
    if name is None:
        return ""
    methods = ("soup", "caso", "picaso_r", "piconcat_r")
    rows = [
        f"| {n} | {r['none']['kl_from_concat']:.4f} | "
        + " | ".join(f"{r[m]['kl_from_concat']:.5f} ({r[m]['kl_share']:.0%})" for m in methods)
        + " |"
        for n, r in sorted(d["results"][name].items(), key=lambda item: int(item[0]))
        if int(n) > 1
    ]
    p = d["protocol"]
    return (
        f"## Composition (`python benchmarks/serpent_composition.py --examples {p['examples']}`)\n"
        f"Mean KL(concatenation ‖ composed) in nats over {p['examples']} held-out windows, n contexts of {p['context_tokens']} tokens, "
        f"{p['scored_tokens']} scored tokens; in brackets its share of KL(concatenation ‖ no context). One state (n = 1) is exact.\n\n"
        "| n | no context | "
        + " | ".join(methods)
        + " |\n|---:|---:|"
        + "---:|" * len(methods)
        + "\n"
        + "\n".join(rows)
        + "\n\nBoth architectures side by side: `docs/experiments/serpent.md` in the repository.\n\n"
    )


def write_card(result: dict, task_runs: list[dict], out: Path) -> None:
    relative = os.path.relpath(out, ROOT) if out.resolve().is_relative_to(ROOT) else str(out)
    text = render_card(result, task_runs, relative)
    (out / "README.md").write_text(text)
    if out.resolve().is_relative_to(ROOT):
        (ROOT / "model_cards").mkdir(exist_ok=True)
        (ROOT / "model_cards" / f"serpent-{result['task']}-{result['model']}.md").write_text(text)


# --------------------------------------------------------------------------------------------- main
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="all", choices=[*TASKS, "all"])
    parser.add_argument("--smoke", action="store_true", help="the config's smoke overrides: tiny models, a few steps")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: the config's seeds")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument(
        "--out",
        default=None,
        help="results folder (default benchmarks/results/serpent; --smoke: /tmp/hsc-serpent-smoke)",
    )
    parser.add_argument(
        "--checkpoints",
        default=None,
        help="checkpoint folder (default checkpoints/serpent; --smoke: <out>/checkpoints)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's)")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: rebuild summary.md and the seed-0 checkpoints' model cards from the JSON results in --out",
    )
    args = parser.parse_args(argv)

    experiments = load_experiments(Path(args.config), args.smoke)
    threads = args.threads or experiments["lm"]["threads"]
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    sys.path.insert(0, str(ROOT))
    from hf_statecompose.benchmarking import git_commit, write_result

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    out = Path(args.out or ("/tmp/hsc-serpent-smoke" if args.smoke else ROOT / "benchmarks" / "results" / "serpent"))
    checkpoints = Path(args.checkpoints or (out / "checkpoints" if args.smoke else ROOT / "checkpoints" / "serpent"))
    commit, source_digest = git_commit(), serpent_source_digest()
    tasks = TASKS if args.task == "all" else (args.task,)
    if args.report_only:
        rewrite_reports(out, checkpoints, tasks, args.smoke)
        return
    for task_name in tasks:
        settings = experiments[task_name]
        seeds = args.seeds if args.seeds is not None else settings["seeds"]
        start = time.time()
        task = LMTask(settings) if task_name == "lm" else ListOpsTask(settings)
        print(
            f"[{task_name}] data ready in {time.time() - start:.0f}s: {json.dumps(task.data_info())[:300]}", flush=True
        )
        counts = {
            arch: parameter_count(build_model(settings["models"][arch], task.vocab_size, task.special_id))
            for arch in MODELS
        }
        difference = check_matched(counts, settings["match_tolerance"])
        print(
            f"[{task_name}] parameters: SeRpEnt {counts['serpent']:,}, Mamba-1 {counts['mamba']:,} ({difference:+.2%})",
            flush=True,
        )
        task_runs, models = [], {}
        for seed in seeds:
            for arch in args.models:
                run, model = train_one(task, task_name, arch, seed, settings)
                result = {
                    "task": task_name,
                    "model": arch,
                    "seed": seed,
                    "steps": settings["steps"],
                    "parameters": counts,
                    "parameter_difference": difference,
                    **run,
                    "config": settings,
                    "data": task.data_info(),
                    "git_commit": commit,
                    "serpent_source_sha256": source_digest,
                    "device": "cpu",
                    "threads": threads,
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "smoke": args.smoke,
                }
                print(
                    f"[{task_name}] {NAMES[arch]} seed {seed}: {json.dumps(run['metrics'])} ({run['train_seconds']:.0f}s training)",
                    flush=True,
                )
                write_result(result, out / f"{task_name}-{arch}-seed{seed}.json")
                task_runs.append(result)
                if seed == seeds[0]:
                    models[arch] = (model, result)
        for arch, (model, result) in models.items():
            folder = checkpoints / f"{task_name}-{arch}"
            save_checkpoint(model, task, folder)
            write_card(result, task_runs, folder)
            print(f"[{task_name}] saved {folder}", flush=True)
    write_summary(out, args.smoke)


def write_summary(out: Path, smoke: bool) -> list[dict]:
    """``summary.md`` of every run in the results folder (a ``--task lm`` run keeps the listops rows)."""
    results = [
        r for r in (json.loads(p.read_text()) for p in sorted(out.glob("*-seed*.json"))) if r.get("smoke") == smoke
    ]
    table = summary_table(results)
    (out / "summary.md").write_text(table)
    print("\n" + table)
    return results


def rewrite_reports(out: Path, checkpoints: Path, tasks, smoke: bool) -> None:
    results = write_summary(out, smoke)
    for task_name in tasks:
        task_runs = [r for r in results if r["task"] == task_name]
        first_seed = min((r["seed"] for r in task_runs), default=None)
        for result in task_runs:
            folder = checkpoints / f"{task_name}-{result['model']}"
            if result["seed"] == first_seed and folder.is_dir():
                write_card(result, task_runs, folder)
                print(f"[{task_name}] card rewritten: {folder / 'README.md'}")


if __name__ == "__main__":
    main()
