"""Does the hybrid demo model (NemotronH: Mamba-2 layers + NoPE attention layers) use its contexts, and
how much of that survives composing their states?

    python recipes/eval_hybrid_demo.py                      # k = 1, 2, 4, every demo question
    python recipes/eval_hybrid_demo.py --k 4 --questions 8 --out /tmp/x
    python recipes/eval_hybrid_demo.py --arch mamba2        # the same harness on the Mamba-2 demo, for comparison
    python recipes/eval_hybrid_demo.py --k 2 4 --zero-attention   # ablation: the attention layers' output projections zeroed

Questions and passages: the demo's bundled ones (``hf_statecompose/demo/data/``, those of
``python -m hf_statecompose.demo`` and of the PICASO evaluation): each question's answer is in one
synthetic passage (two fictional towns, one fact each). For each question and each k, its k passages
are that passage and k - 1 others (distractors, other towns' facts), in an order drawn with ``--seed``
(the same for every condition). Conditions:

* ``none``: the query alone;
* ``concat``: the k passages' tokens then the query, one ordinary forward / ``generate`` of the stock model;
* ``composed``: ``model.generate(query, past_states=[hsc.encode(model, p) for p in passages],
  composition=hsc.StateComposer("picaso_s"))`` (the SSM layers' states composed by PICASO-S, the
  attention layers attend to every context's keys / values);
* ``ssm_only``: the same with ``hsc.StateComposer("picaso_s", attention="none")`` (the attention layers
  see the query only).

``composed`` and ``ssm_only`` need hf_statecompose's hybrid support; while ``hsc.encode`` (or the
composer) refuses the model they are reported "not available" and the rest still runs.

``--zero-attention`` zeroes the attention layers' output projections first (they then add nothing to the
residual stream): the drop from the plain run is how much of the recall goes through attention.

Metrics per condition: accuracy (the greedy answer, as many tokens as the reference, equals it exactly)
and the answer's mean cross-entropy (nats/token; lower is better). Prints a markdown table; writes
``eval_hybrid_demo_<arch>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONDITIONS = ("none", "concat", "composed", "ssm_only")
COMPOSERS = {"composed": {}, "ssm_only": {"attention": "none"}}  # StateComposer("picaso_s", **these)


def questions_with_passages(k: int, seed: int = 0, limit: int | None = None) -> list[dict]:
    """The demo questions, each with its k passages (the one holding the answer and k - 1 other
    synthetic passages, shuffled): ``{query, answer, passages, gold}`` (``gold`` the answer's index)."""
    from hf_statecompose.demo.run import bundled

    synthetic = [p["text"] for p in bundled("passages.jsonl") if p["source"] == "synthetic"]
    if not 1 <= k <= len(synthetic):
        raise ValueError(f"k must be between 1 and {len(synthetic)} (the demo's synthetic passages), got {k}")
    rng = random.Random(seed)
    out = []
    for q in bundled("questions.jsonl")[:limit]:
        gold = next(p for p in synthetic if f"{q['query']}{q['answer']}" in p)
        chosen = [gold] + rng.sample([p for p in synthetic if p != gold], k - 1)
        rng.shuffle(chosen)
        out.append({"query": q["query"], "answer": q["answer"], "passages": chosen, "gold": chosen.index(gold)})
    return out


def _answer_loss(logits: torch.Tensor, answer: list[int]) -> float:
    """Mean cross-entropy of ``answer``, the last ``len(answer)`` tokens of the sequence ``logits`` scored."""
    n = len(answer)
    scored = logits[0, -n - 1 : -1].double()
    return float(torch.nn.functional.cross_entropy(scored, torch.tensor(answer, device=scored.device)))


@torch.no_grad()
def stock_condition(model, tokenizer, item: dict, with_context: bool) -> dict:
    """``none`` / ``concat``: the stock model's forward (answer loss) and greedy ``generate`` (accuracy)."""
    prefix = [t for p in item["passages"] for t in tokenizer(p)["input_ids"]] if with_context else []
    query, answer = tokenizer(item["query"])["input_ids"], tokenizer(item["answer"])["input_ids"]
    device = next(model.parameters()).device
    ids = torch.tensor([prefix + query], device=device)
    loss = _answer_loss(model(input_ids=torch.tensor([prefix + query + answer], device=device)).logits, answer)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=len(answer),
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return {"correct": tokenizer.decode(out[0, ids.shape[1] :]) == item["answer"], "loss": loss}


@torch.no_grad()
def composed_condition(model, tokenizer, item: dict, composer) -> dict:
    """``composed`` / ``ssm_only``: each passage encoded alone (``hsc.encode``), the states composed by
    ``composer`` under the query (``generate`` for accuracy, ``forward`` for the answer loss)."""
    import hf_statecompose as hsc

    device = next(model.parameters()).device
    states = [hsc.encode(model, torch.tensor([tokenizer(p)["input_ids"]], device=device)) for p in item["passages"]]
    query, answer = tokenizer(item["query"])["input_ids"], tokenizer(item["answer"])["input_ids"]
    ids = torch.tensor([query], device=device)
    logits = model(
        input_ids=torch.tensor([query + answer], device=device), past_states=states, composition=composer
    ).logits
    out = model.generate(
        ids,
        past_states=states,
        composition=composer,
        max_new_tokens=len(answer),
        do_sample=False,
        pad_token_id=tokenizer.eos_token_id,
    )
    return {"correct": tokenizer.decode(out[0, -len(answer) :]) == item["answer"], "loss": _answer_loss(logits, answer)}


def composers_available(model, tokenizer) -> dict:
    """``{condition: StateComposer or the reason it is not available}`` for ``composed`` / ``ssm_only``:
    tried once on a short context (this library's hybrid support may not be there yet)."""
    import hf_statecompose as hsc

    out = {}
    for condition, options in COMPOSERS.items():
        try:
            composer = hsc.StateComposer("picaso_s", **options)
            composed_condition(
                model,
                tokenizer,
                {"query": "Sollo river", "answer": " North.", "passages": ["Sollo river North.\n"]},
                composer,
            )
            out[condition] = composer
        except (TypeError, ValueError, NotImplementedError) as error:
            out[condition] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return out


def evaluate(model, tokenizer, ks=(1, 4), seed: int = 0, limit: int | None = None, log=print) -> dict:
    """Every condition at every k: ``{"k": {k: {condition: {accuracy, answer_loss, questions} or
    {"not_available": reason}}}, "composers": ...}``."""
    composers = composers_available(model, tokenizer)
    for condition, value in composers.items():
        if isinstance(value, str):
            log(f"{condition}: not available ({value})")
    result = {"k": {}, "composers": {c: ("available" if not isinstance(v, str) else v) for c, v in composers.items()}}
    for k in ks:
        items = questions_with_passages(k, seed, limit)
        rows = {c: [] for c in CONDITIONS}
        start = time.time()
        for item in items:
            rows["none"].append(stock_condition(model, tokenizer, item, with_context=False))
            rows["concat"].append(stock_condition(model, tokenizer, item, with_context=True))
            for condition, composer in composers.items():
                if not isinstance(composer, str):
                    rows[condition].append(composed_condition(model, tokenizer, item, composer))
        per_k = {}
        for condition, values in rows.items():
            if not values:
                per_k[condition] = {"not_available": composers[condition]}
                continue
            per_k[condition] = {
                "accuracy": sum(v["correct"] for v in values) / len(values),
                "answer_loss": sum(v["loss"] for v in values) / len(values),
                "questions": len(values),
            }
        result["k"][k] = per_k
        log(f"k={k}: {len(items)} questions in {time.time() - start:.0f}s")
    return result


@torch.no_grad()
def zero_attention(model) -> None:
    """Zero the output projection of every attention layer (NemotronH's ``full_attention`` blocks), in place."""
    layers = [
        layer
        for layer in getattr(getattr(model, "model", None), "layers", [])
        if getattr(layer, "block_type", None) == "full_attention"
    ]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no attention layers to zero: --zero-attention is for the hybrid demo"
        )
    for layer in layers:
        layer.mixer.o_proj.weight.zero_()


def table(result: dict) -> str:
    lines = ["| k | condition | accuracy | answer loss (nats/token) |", "|---|---|---:|---:|"]
    for k, per_k in result["k"].items():
        for condition in CONDITIONS:
            r = per_k[condition]
            if "not_available" in r:
                lines.append(f"| {k} | {condition} | not available | not available |")
            else:
                lines.append(f"| {k} | {condition} | {r['accuracy']:.1%} ({r['questions']}) | {r['answer_loss']:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--arch", default="hybrid", choices=["hybrid", "mamba2", "mamba"], help="which demo model (hsc.load_demo)"
    )
    parser.add_argument(
        "--k", type=int, nargs="+", default=[1, 2, 4], help="passages per question (the answer's and k - 1 others)"
    )
    parser.add_argument("--questions", type=int, default=None, help="the first N demo questions (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="picks the distractors and the passages' order")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--zero-attention", action="store_true", help="ablation: zero the attention layers' output projections (hybrid)"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    import hf_statecompose as hsc

    model, tokenizer = hsc.load_demo(args.arch)
    if args.zero_attention:
        zero_attention(model)
    result = evaluate(model, tokenizer, args.k, args.seed, args.questions)
    result.update(
        model=f"demo-{args.arch}",
        seed=args.seed,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        attention_zeroed=args.zero_attention,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"eval_hybrid_demo_{args.arch}" + ("_zero_attention" if args.zero_attention else "")
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(table(result) + "\n")
    print(table(result))
    print(f"wrote {out}/{name}.json and .md")
    if args.plot:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _plot import plot_docs

        plot_docs(out / f"{name}.json", f"{name}.json")


if __name__ == "__main__":
    main()
