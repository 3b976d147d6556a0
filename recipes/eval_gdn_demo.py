"""How well does the GDN demo model (Qwen3.5: gated DeltaNet layers + one attention layer) answer from composed
context states, against no context and the concatenated text?

    python recipes/eval_gdn_demo.py                         # k = 1, 2, 4, every demo question
    python recipes/eval_gdn_demo.py --k 2 --questions 8 --out /tmp/x
    python recipes/eval_gdn_demo.py --methods soup caso picaso_s picaso_r concat   # concat: re-encode, as a check
    python recipes/eval_gdn_demo.py --zero-attention        # ablation: the attention layer's output projection zeroed
    python recipes/eval_gdn_demo.py --card                  # then rewrite the model card with this table

The protocol of ``recipes/eval_hybrid_demo.py`` (whose helpers it uses): the demo's bundled questions and
passages (``hf_statecompose/demo/data/``), each question with k passages, the one holding its answer and k - 1
other synthetic passages, in an order drawn with ``--seed`` (the same for every condition). Conditions:

* ``none``: the query alone;
* ``concat``: the k passages' tokens then the query, one ordinary forward / ``generate`` of the stock model;
* one per ``--methods`` (default soup, CASO, PICASO-S, PICASO-R): each passage encoded alone
  (``hsc.encode(model, ids)``), then ``model.generate(query, past_states=states, composition=method)``: the GDN
  layers' states composed as affine maps by the method, the attention layer attending to every context's keys
  and values (``attention="concat"``: in list order, RoPE keys re-rotated; ``--attention`` to change it).

Metrics: accuracy (the greedy answer, as many tokens as the reference, equals it exactly) and the answer's mean
cross-entropy (nats/token; lower is better). Prints a markdown table; writes ``eval_gdn_demo.json`` and ``.md``
(``_zero_attention`` appended for the ablation) to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("soup", "caso", "picaso_s", "picaso_r")
LABELS = {
    "none": "no context",
    "concat": "concatenated text",
    "soup": "soup",
    "caso": "CASO",
    "picaso_s": "PICASO-S",
    "picaso_r": "PICASO-R",
    "state:concat": "concat (re-encoded)",
    "piconcat_r": "PIConcat-R",
}


def _hybrid_recipe():
    spec = importlib.util.spec_from_file_location("eval_hybrid_demo", ROOT / "recipes" / "eval_hybrid_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def condition_names(methods) -> list[str]:
    """The table's columns: ``none``, ``concat`` (the text), then the methods (``concat`` among the methods is the
    composer's re-encoding, ``state:concat``)."""
    return ["none", "concat"] + [f"state:{m}" if m == "concat" else m for m in methods]


@torch.no_grad()
def composed(model, tokenizer, states, item: dict, composer) -> dict:
    """Greedy answer and answer loss with ``past_states=states`` composed by ``composer``."""
    recipe = _hybrid_recipe()
    device = next(model.parameters()).device
    query, answer = tokenizer(item["query"])["input_ids"], tokenizer(item["answer"])["input_ids"]
    logits = model(
        input_ids=torch.tensor([query + answer], device=device), past_states=states, composition=composer
    ).logits
    out = model.generate(
        torch.tensor([query], device=device),
        past_states=states,
        composition=composer,
        max_new_tokens=len(answer),
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return {
        "correct": tokenizer.decode(out[0, -len(answer) :]) == item["answer"],
        "loss": recipe._answer_loss(logits, answer),
    }


def evaluate(
    model, tokenizer, ks=(1, 2, 4), methods=METHODS, seed: int = 0, limit=None, attention: str = "concat", log=print
) -> dict:
    """Every condition at every k: ``{"k": {k: {condition: {accuracy, answer_loss, questions}}}}``."""
    import hf_statecompose as hsc

    recipe = _hybrid_recipe()
    composers = {
        name: hsc.StateComposer(m, attention=attention) for name, m in zip(condition_names(methods)[2:], methods)
    }
    device = next(model.parameters()).device
    result = {"k": {}, "methods": list(methods), "attention": attention}
    for k in ks:
        items = recipe.questions_with_passages(k, seed, limit)
        rows = {c: [] for c in condition_names(methods)}
        start = time.time()
        for item in items:
            rows["none"].append(recipe.stock_condition(model, tokenizer, item, with_context=False))
            rows["concat"].append(recipe.stock_condition(model, tokenizer, item, with_context=True))
            states = [
                hsc.encode(model, torch.tensor([tokenizer(p)["input_ids"]], device=device)) for p in item["passages"]
            ]
            for name, composer in composers.items():
                rows[name].append(composed(model, tokenizer, states, item, composer))
        result["k"][k] = {
            c: {
                "accuracy": sum(v["correct"] for v in values) / len(values),
                "answer_loss": sum(v["loss"] for v in values) / len(values),
                "questions": len(values),
            }
            for c, values in rows.items()
        }
        log(f"k={k}: {len(items)} questions in {time.time() - start:.0f}s")
    result["summary"] = ordering(result)
    return result


def ordering(result: dict) -> str:
    """One line per k: the conditions from the lowest answer loss to the highest."""
    lines = []
    for k, per_k in result["k"].items():
        ranked = sorted(per_k, key=lambda c: per_k[c]["answer_loss"])
        lines.append(
            f"k = {k}, by answer loss: "
            + " < ".join(f"{LABELS.get(c, c)} {per_k[c]['answer_loss']:.3f}" for c in ranked)
            + "."
        )
    return "\n".join(f"- {line}" for line in lines)


def table(result: dict) -> str:
    """Long form: one row per k and condition."""
    lines = ["| k | condition | accuracy | answer loss (nats/token) |", "|---|---|---:|---:|"]
    for k, per_k in result["k"].items():
        for condition, r in per_k.items():
            lines.append(
                f"| {k} | {LABELS.get(condition, condition)} | {r['accuracy']:.1%} ({r['questions']}) | {r['answer_loss']:.3f} |"
            )
    return "\n".join(lines)


def wide_table(result: dict) -> str:
    """One row per k, one column per condition: ``accuracy / answer loss``."""
    conditions = list(next(iter(result["k"].values())))
    lines = [
        "| k | " + " | ".join(LABELS.get(c, c) for c in conditions) + " |",
        "|---|" + "---:|" * len(conditions),
    ]
    for k in sorted(result["k"], key=int):
        per_k = result["k"][k]
        lines.append(
            f"| {k} | "
            + " | ".join(f"{per_k[c]['accuracy']:.1%} / {per_k[c]['answer_loss']:.3f}" for c in conditions)
            + " |"
        )
    return "\n".join(lines)


@torch.no_grad()
def zero_attention(model) -> None:
    """Zero the output projection of every attention layer (Qwen3.5's ``full_attention`` layers), in place."""
    layers = [
        layer
        for layer in getattr(getattr(model, "model", None), "layers", [])
        if getattr(layer, "block_type", None) == "full_attention" and hasattr(layer, "self_attn")
    ]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no Qwen3.5 attention layers to zero: --zero-attention is for the GDN demo"
        )
    for layer in layers:
        layer.self_attn.o_proj.weight.zero_()


def write_card() -> Path:
    """Rewrite the GDN demo's model card (its README.md and ``model_cards/demo-gdn.md``) from its training log and
    this evaluation's JSON (``benchmarks/results/eval_gdn_demo.json``)."""
    from hf_statecompose.demo import DEMO_DIR

    sys.path.insert(0, str(ROOT / "recipes"))
    from model_card import write_model_card

    folder = DEMO_DIR / "gdn"
    write_model_card(folder, json.loads((folder / "training_log.json").read_text())["summary"])
    return folder / "README.md"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--k", type=int, nargs="+", default=[1, 2, 4], help="passages per question (the answer's and k - 1 others)"
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help="composition methods (StateComposer names)")
    parser.add_argument(
        "--attention", default="concat", help="the attention layer's key placement (concat, shared, none)"
    )
    parser.add_argument("--questions", type=int, default=None, help="the first N demo questions (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="picks the distractors and the passages' order")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--zero-attention", action="store_true", help="ablation: zero the attention layer's output projection"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument(
        "--card", action="store_true", help="then rewrite the model card (the JSON in benchmarks/results/ it reads)"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    import hf_statecompose as hsc

    model, tokenizer = hsc.load_demo("gdn")
    if args.zero_attention:
        zero_attention(model)
    result = evaluate(model, tokenizer, args.k, args.methods, args.seed, args.questions, args.attention)
    result.update(
        model="demo-gdn",
        seed=args.seed,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        attention_zeroed=args.zero_attention,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "eval_gdn_demo" + ("_zero_attention" if args.zero_attention else "")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(wide_table(result) + "\n\n" + result["summary"] + "\n")
    print(table(result))
    print()
    print(wide_table(result))
    print(result["summary"])
    print(f"wrote {out}/{name}.json and .md")
    if args.card:
        print(f"wrote {write_card()}")


if __name__ == "__main__":
    main()
