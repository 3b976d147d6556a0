"""Fine-tune a Mamba / Mamba-2 for composition with a LoRA adapter: BPTC or BP2C (PICASO paper, Section 5).

    accelerate launch recipes/finetune.py --experiment bptc-mamba2        # or: python recipes/finetune.py ...
    accelerate launch recipes/finetune.py --experiment bp2c-mamba2 --set max_steps=300 --set lr=5e-4
    python recipes/finetune.py --list                                      # the experiments of the config

Experiments are data: ``recipes/configs/finetune.json`` holds default parameters and per-experiment
overrides; ``--set key=value`` (JSON values, dotted keys for nested ones: ``--set lora.r=8``) overrides
again. The run is seeded (``seed``) and runs on whatever accelerate gives it (CPU here, a GPU or
several processes elsewhere).

Data (offline): every step samples one k uniformly in [k_min, k_max] (the paper's k ∈ {0…10}) and a
batch of rows, each conditioned on the composition (``composition``, default PICASO-R) of its own k
contexts:

* ``1 - recall_fraction`` of the rows, **Wikipedia**: a 128-token segment of a *training* article
  (``segment_tokens``); the query is its first 64 tokens, the target (the loss) its last 64; the
  contexts are the k segments of the training pool most similar to the query text (all-MiniLM-L6-v2,
  the segment itself excluded), most relevant last: the evaluation's protocol on training data.
* ``recall_fraction``, **synthetic recall**: a fresh world of ``recall_towns`` fictional towns
  (``hf_statecompose.demo.corpora``); the query asks one town's fact (``"Gasol river"``), the target is the
  answer (``" Iron."``); the contexts are the passage holding the answer and k−1 other passages of
  the same world, in random order (k = 0: no context).

Objectives: ``bptc`` keeps the graph through the context encodings, ``bp2c`` stops the gradient at the
composed state (:mod:`hf_statecompose.training`). LoRA (PEFT) on ``in_proj`` (Mamba-2) and
``in_proj`` + ``x_proj`` (Mamba-1): the linear layers PEFT accepts on these models whose weights the
forward uses through the module (``out_proj`` and ``conv1d`` are refused by PEFT; ``dt_proj``'s weight
is read directly by the mixers, so a LoRA there would be silently ignored).

Output (``out``, default ``adapters/<experiment>``; a relative folder is under the working directory, the
smoke experiment's ``hsc-finetune-smoke``): the adapter (``save_pretrained``), ``results.json`` (config,
per-step log, time per step, evaluation before and after through lm-eval: the composition tasks at
k = ``eval.k`` and the plain held-out LM loss without contexts), and a model card naming that folder, also
written to ``model_cards/`` for the repository's own ``adapters/``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

from model_card import write_adapter_card  # recipes/ (this script's folder)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "finetune.json"


# ---------------------------------------------------------------------------------------------- config
def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(name: str, path=CONFIG, overrides=()) -> dict:
    """``defaults`` updated with experiment ``name``'s overrides, then ``key=value`` strings."""
    spec = json.loads(Path(path).read_text())
    if name not in spec["experiments"]:
        raise SystemExit(f"unknown experiment {name!r}; {path} defines: {', '.join(spec['experiments'])}")
    cfg = _merge(spec["defaults"], spec["experiments"][name])
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SystemExit(f"--set takes key=value, got {item!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        target = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value
    cfg["name"] = name
    out = Path(str(cfg["out"]).format(name=name))
    cfg["out"] = str(out if out.is_absolute() else Path.cwd() / out)  # a relative folder is under the working directory
    if cfg["objective"] not in ("bptc", "bp2c"):
        raise SystemExit(f"objective must be bptc or bp2c, got {cfg['objective']!r}")
    if not 0 <= cfg["k_min"] <= cfg["k_max"]:
        raise SystemExit("need 0 <= k_min <= k_max")
    return cfg


# ------------------------------------------------------------------------------------------------ data
def _cache_dir() -> Path:
    return Path(os.environ.get("HF_STATECOMPOSE_CACHE", Path.home() / ".cache" / "hf_statecompose")) / "finetune"


def wiki_pool(tokenizer, segments_wanted: int, segment_tokens: int, seed: int, neighbours: int = 10, log=print):
    """Segments of randomly chosen *training* articles and, for each, its ``neighbours`` most similar
    other segments by the retriever (cached on disk as JSON: the texts and the neighbour indices)."""
    from hf_statecompose.demo.corpora import segments, wikipedia_split

    train, _ = wikipedia_split()
    rng = random.Random(seed)
    order = list(range(len(train)))
    rng.shuffle(order)
    pool = []
    for index in order:
        pool += segments(train[index][1], tokenizer, segment_tokens)
        if len(pool) >= segments_wanted:
            break
    pool = pool[:segments_wanted]
    key = hashlib.sha256(json.dumps([pool, neighbours]).encode()).hexdigest()[:16]
    path = _cache_dir() / f"wiki_pool_{key}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("segments") == pool:
            return pool, data["neighbours"]
    from hf_statecompose.retrieval import default_retriever

    start = time.time()
    embeddings = default_retriever()(pool)
    similarity = embeddings @ embeddings.T
    similarity.fill_diagonal_(-float("inf"))
    top = similarity.topk(min(neighbours, len(pool) - 1), dim=1).indices.tolist()
    log(f"wiki pool: embedded {len(pool)} segments in {time.time() - start:.0f}s (cached in {path})")
    from hf_statecompose.state.files import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps({"segments": pool, "neighbours": top}).encode())
    return pool, top


class Sampler:
    """Batches of :class:`~hf_statecompose.training.CompositionExample`, one k per batch."""

    def __init__(self, tokenizer, cfg: dict, log=print, process_index: int = 0):
        self.tok, self.cfg = tokenizer, cfg
        self.rng = random.Random(cfg["seed"] * 1000 + process_index)  # each process its own data
        self.pool, self.neighbours = wiki_pool(
            tokenizer, cfg["wiki_pool_segments"], cfg["segment_tokens"], cfg["seed"], log=log
        )
        self.pool_ids = [torch.tensor(self.ids(text)) for text in self.pool]

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def wiki_row(self, k: int):
        from hf_statecompose.training import CompositionExample

        q = self.cfg["query_tokens"]
        while True:
            index = self.rng.randrange(len(self.pool))
            ids = self.pool_ids[index]
            if len(ids) > q + 8:
                break
        contexts = [self.pool_ids[j] for j in reversed(self.neighbours[index][:k])]  # most relevant last
        return CompositionExample(ids[:q], ids[q:], contexts)

    def recall_row(self, k: int):
        from hf_statecompose.demo.corpora import recall_world
        from hf_statecompose.training import CompositionExample

        world = recall_world(self.rng.randrange(1 << 30), towns=self.cfg["recall_towns"])
        question = self.rng.choice(world.questions)
        gold = question.passages[0]
        others = [i for i in range(len(world.passages)) if i != gold]
        chosen = ([gold] + self.rng.sample(others, min(k - 1, len(others)))) if k else []
        self.rng.shuffle(chosen)
        return CompositionExample(
            torch.tensor(self.ids(question.query)),
            torch.tensor(self.ids(question.answer)),
            [torch.tensor(self.ids(world.passages[i])) for i in chosen],
        )

    def batch(self):
        k = self.rng.randint(self.cfg["k_min"], self.cfg["k_max"])
        rows = [
            self.recall_row(k) if self.rng.random() < self.cfg["recall_fraction"] else self.wiki_row(k)
            for _ in range(self.cfg["batch_size"])
        ]
        return k, rows


# ------------------------------------------------------------------------------------------------ model
def load_base(cfg: dict):
    """The model to adapt, enabled: ``model`` = ``demo`` (the embedded checkpoint of ``arch``), any
    ``--model`` spec of the CLI (``demo-mamba``, ...) or a local checkpoint folder."""
    from hf_statecompose.cli import load_model

    spec = cfg.get("model", "demo")
    return load_model(f"demo-{cfg['arch']}" if spec == "demo" else spec)


def add_lora(model, cfg: dict):
    from peft import LoraConfig, get_peft_model

    lora = cfg["lora"]
    targets = lora["target_modules"]
    if isinstance(targets, dict):
        targets = targets[model.config.model_type]
    config = LoraConfig(
        r=lora["r"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=targets,
        task_type="CAUSAL_LM",
        bias="none",
    )
    return get_peft_model(model, config)


# ------------------------------------------------------------------------------------------- evaluation
def lm_eval_suite(model, tokenizer, cfg: dict, log=print) -> dict:
    """The bundled lm-eval tasks through the ``statecompose`` model: the composition tasks with
    k = ``eval.k`` contexts (``composition``), and the plain held-out LM loss with none."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hf_statecompose.lmeval import TASKS_DIR
    from hf_statecompose.lmeval.model import StateComposeLM

    limit = cfg["eval"].get("limit")
    manager = TaskManager(include_path=str(TASKS_DIR))
    out = {}
    for k, tasks in (
        (cfg["eval"]["k"], ["statecompose_wikipedia", "statecompose_recall_mc"]),
        (0, ["statecompose_wikipedia_rolling"]),
    ):
        start = time.time()
        lm = StateComposeLM(
            pretrained=model, tokenizer=tokenizer, passages="bundled", k=k, composition=cfg["composition"], batch_size=8
        )
        result = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=False)
        for task, metrics in result["results"].items():
            out[task] = {
                "k": k,
                **{m: v for m, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in m},
            }
        log(f"  lm-eval k={k} {tasks}: {time.time() - start:.0f}s")
    return out


# ---------------------------------------------------------------------------------------------- training
def train(cfg: dict, log=print) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from hf_statecompose.training import composition_loss

    torch.set_num_threads(cfg["threads"])
    set_seed(cfg["seed"])
    accelerator = Accelerator(gradient_accumulation_steps=cfg["gradient_accumulation_steps"])
    say = log if accelerator.is_main_process else (lambda *a, **k: None)
    base, tokenizer = load_base(cfg)
    results = {"config": cfg, "device": str(accelerator.device), "processes": accelerator.num_processes}
    if cfg["eval"].get("lm_eval") and cfg["eval"].get("before") and accelerator.is_main_process:
        say("evaluating before fine-tuning (lm-eval)")
        results["before"] = lm_eval_suite(base, tokenizer, cfg, log=say)

    model = add_lora(base, cfg)
    trainable, total = model.get_nb_trainable_parameters()
    say(
        f"{cfg['name']}: {cfg['arch']} + LoRA {cfg['lora']['r']} ({trainable:,} of {total:,} parameters trainable), objective {cfg['objective']}"
    )
    with accelerator.main_process_first():  # the main process embeds and caches the pool, the others read it
        sampler = Sampler(tokenizer, cfg, log=say, process_index=accelerator.process_index)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg["lr"], weight_decay=cfg["weight_decay"]
    )
    steps, warmup = cfg["max_steps"], cfg["warmup_steps"]
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup)) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    model.train()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    log_rows, start = [], time.time()
    for step in range(1, steps * cfg["gradient_accumulation_steps"] + 1):
        k, rows = sampler.batch()
        t0 = time.perf_counter()
        with accelerator.accumulate(model):
            loss = composition_loss(
                model,
                rows,
                cfg["objective"],
                cfg["composition"],
                pad_id=pad,
                checkpoint_contexts=cfg["checkpoint_contexts"],
                reduction=cfg["loss_reduction"],
            )
            accelerator.backward(loss)
            if accelerator.sync_gradients and cfg["max_grad_norm"]:
                accelerator.clip_grad_norm_(model.parameters(), cfg["max_grad_norm"])
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0
        log_rows.append(
            {"step": step, "k": k, "loss": loss.item(), "seconds": seconds, "lr": schedule.get_last_lr()[0]}
        )
        if step % cfg["log_every"] == 0 or step == 1:
            say(f"step {step}/{steps} k={k:2d} loss {loss.item():.3f} {seconds:.2f}s/step ({time.time() - start:.0f}s)")
    train_seconds = time.time() - start
    timed = log_rows[3:] or log_rows  # the first steps compile / warm caches
    per_k: dict[int, list[float]] = {}
    for row in timed:
        per_k.setdefault(row["k"], []).append(row["seconds"])
    results["training"] = {
        "steps": steps,
        "train_seconds": round(train_seconds, 1),
        "seconds_per_step_mean": sum(r["seconds"] for r in timed) / len(timed),
        "seconds_per_step_by_k": {k: sum(v) / len(v) for k, v in sorted(per_k.items())},
        "loss_first_10": sum(r["loss"] for r in log_rows[:10]) / len(log_rows[:10]),
        "loss_last_10": sum(r["loss"] for r in log_rows[-10:]) / len(log_rows[-10:]),
        "trainable_parameters": trainable,
        "total_parameters": total,
    }
    accelerator.wait_for_everyone()
    model = accelerator.unwrap_model(model)
    model.eval()
    out = Path(cfg["out"])
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        if cfg["eval"].get("lm_eval"):
            say("evaluating after fine-tuning (lm-eval)")
            results["after"] = lm_eval_suite(model, tokenizer, cfg, log=say)
        results["log"] = log_rows
        (out / "results.json").write_text(json.dumps(results, indent=1))
        write_adapter_card(out, results)
        say(f"saved adapter, results.json and model card to {out}")
    return results


def evaluate_adapters(folders: list[str], log=print) -> list[dict]:
    """Run (or re-run) the before/after lm-eval evaluation of adapters this recipe saved, updating their
    ``results.json`` and model cards (for runs made with ``--set eval.lm_eval=false``). The base model is
    evaluated once per base checkpoint and evaluation setting."""
    from peft import PeftModel

    before_cache: dict[str, dict] = {}
    out = []
    for folder in map(Path, folders):
        results = json.loads((folder / "results.json").read_text())
        cfg = results["config"]
        torch.set_num_threads(cfg["threads"])
        base, tokenizer = load_base(cfg)
        key = json.dumps([cfg.get("model", "demo"), cfg["arch"], cfg["eval"], cfg["composition"]], sort_keys=True)
        if key not in before_cache:
            log(f"evaluating the base {cfg['arch']} (lm-eval)")
            before_cache[key] = lm_eval_suite(base, tokenizer, cfg, log=log)
        results["before"] = before_cache[key]
        log(f"evaluating {folder} (lm-eval)")
        results["after"] = lm_eval_suite(PeftModel.from_pretrained(base, folder).eval(), tokenizer, cfg, log=log)
        (folder / "results.json").write_text(json.dumps(results, indent=1))
        write_adapter_card(folder, results)
        out.append(results)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", help="a name from the config's `experiments`")
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a parameter (repeatable)"
    )
    parser.add_argument("--list", action="store_true", help="list the experiments and exit")
    parser.add_argument(
        "--evaluate",
        nargs="+",
        metavar="ADAPTER_DIR",
        help="only run the lm-eval evaluation (before/after) of saved adapters",
    )
    args = parser.parse_args(argv)
    if args.evaluate:
        sys.path.insert(0, str(ROOT))
        return evaluate_adapters(args.evaluate, log=lambda *a: print(*a, flush=True))
    if args.list or not args.experiment:
        spec = json.loads(Path(args.config).read_text())
        for name, override in spec["experiments"].items():
            print(f"{name:16s} {json.dumps(override)}")
        return None
    sys.path.insert(0, str(ROOT))
    cfg = load_config(args.experiment, args.config, args.set)
    return train(cfg, log=lambda *a: print(*a, flush=True))


if __name__ == "__main__":
    main()
