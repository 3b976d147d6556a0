"""PICASO-style evaluation of composition on the demo models (paper arXiv 2502.17605, Section 6 / Fig. 3).

    python -m hf_statecompose.demo.eval --arch mamba2 --dataset wikipedia --queries 40 --out benchmarks/results/eval
    python -m hf_statecompose.demo.eval --all --out benchmarks/results/eval        # both models, both datasets, plot

Protocol, per dataset:

* **wikipedia**: the held-out articles of the gensim Wikipedia excerpt (never trained on), cut into
  segments of ``2 × half`` tokens. The database holds every segment. An evaluation sample is a segment:
  its first half is the query, its second half the continuation; it is retrieved from the *other*
  segments (its own is excluded, it would contain the answer).
* **recall**: a fresh synthetic world (fictional towns, four facts in two passages each; seed 2026,
  never seen in training); the database holds every passage; the query is a fact's statement without
  its value (``"Velmora product"``), the continuation is the value (``" wool."``).

For each sample, the ``k_max`` most similar entries are retrieved once with the store's retriever
(all-MiniLM-L6-v2); for k = 0 … k_max the top k are composed, most relevant last (next to the query),
and we measure the continuation's mean cross-entropy (nats/token) and the **time to obtain the
conditioning state** from the stored states (retrieval and reading them are common to all methods and
reported apart): baseline (no context), concat (re-encode the concatenated tokens), soup, CASO,
PICASO-S, PICASO-R, PIConcat-R (re-encode the k cyclic concatenations, averaged).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from ..composition import MODEL_FREE_METHODS

# every method but user-weighted, baselines around the model-free ones
EVALUATED_METHODS = ("concat",) + tuple(m for m in MODEL_FREE_METHODS if m != "weighted") + ("piconcat_r",)
COLORS = {
    "baseline": "black",
    "concat": "tab:blue",
    "soup": "tab:orange",
    "caso": "tab:green",
    "picaso_s": "tab:red",
    "picaso_r": "tab:purple",
    "piconcat_r": "tab:brown",
}
LABELS = {
    "baseline": "Baseline",
    "concat": "Concat",
    "soup": "Soup",
    "caso": "CASO",
    "picaso_s": "PICASO-S",
    "picaso_r": "PICASO-R",
    "piconcat_r": "PIConcat-R",
}
DATASETS = ("wikipedia", "recall")


def build_samples(dataset: str, tokenizer, queries: int, half: int = 64, seed: int = 0):
    """``(database texts, samples)``; a sample is ``{query_ids, continuation_ids, query_text, own}``,
    ``own`` the database index to exclude (or None) and ``gold`` the indices holding the answer."""
    from .corpora import recall_world, segments, wikipedia_split

    rng = random.Random(seed)
    samples = []
    if dataset == "wikipedia":
        _, held_out = wikipedia_split()
        database = [seg for _, text in held_out for seg in segments(text, tokenizer, 2 * half)]
        for index in sorted(rng.sample(range(len(database)), min(queries, len(database)))):
            ids = tokenizer(database[index], add_special_tokens=False)["input_ids"]
            if len(ids) < half + 8:
                continue
            query, continuation = ids[:half], ids[half:]
            samples.append(
                {
                    "query_ids": torch.tensor(query),
                    "continuation_ids": torch.tensor(continuation),
                    "query_text": tokenizer.decode(query),
                    "own": index,
                    "gold": None,
                }
            )
    elif dataset == "recall":
        world = recall_world(2026, towns=60)
        database = list(world.passages)
        for q in rng.sample(world.questions, min(queries, len(world.questions))):
            samples.append(
                {
                    "query_ids": torch.tensor(tokenizer(q.query, add_special_tokens=False)["input_ids"]),
                    "continuation_ids": torch.tensor(tokenizer(q.answer, add_special_tokens=False)["input_ids"]),
                    "query_text": q.query,
                    "own": None,
                    "gold": list(q.passages),
                }
            )
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {DATASETS}")
    return database, samples


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    dataset: str,
    queries: int = 40,
    k_max: int = 10,
    store_dir=None,
    storage_dtype: str = "fp32",
    methods=EVALUATED_METHODS,
    retriever=None,
    log=print,
) -> dict:
    """Run the protocol; returns the result dict (per method and k: mean loss, mean seconds)."""
    from ..composition.composer import StateComposer
    from ..pipeline import context_order, continuation_losses
    from ..store import StateStore

    database, samples = build_samples(dataset, tokenizer, queries)
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(
            Path(store_dir or tmp) / f"{dataset}-{storage_dtype}",
            model,
            tokenizer,
            retriever=retriever,
            storage_dtype=storage_dtype,
        )
        if len(store) == 0:
            _, build_seconds = _timed(
                lambda: store.add(database, [{"index": i} for i in range(len(database))], show_progress=False)
            )
        else:
            build_seconds = None
        id_of = {entry.metadata["index"]: entry.id for entry in store.entries()}
        log(
            f"{dataset}: {len(database)} database entries, {len(samples)} samples, store {store.stats()['bytes'] / 1e6:.1f} MB"
        )
        loss: dict[str, list[list[float]]] = {m: [[] for _ in range(k_max + 1)] for m in ("baseline",) + tuple(methods)}
        seconds: dict[str, list[list[float]]] = {m: [[] for _ in range(k_max + 1)] for m in methods}
        retrieval_seconds, hits = [], [0] * (k_max + 1)
        composers = {m: StateComposer(m) for m in methods}
        for number, sample in enumerate(samples):
            exclude = [id_of[sample["own"]]] if sample["own"] is not None else []
            retrieved, t = _timed(lambda: store.retrieve(sample["query_text"], k_max, exclude=exclude))  # noqa: B023 - _timed calls it at once
            retrieval_seconds.append(t)
            base = continuation_losses(model, [None], sample["query_ids"], sample["continuation_ids"])[0].item()
            for k in range(k_max + 1):
                loss["baseline"][k].append(base)
            if sample["gold"] is not None:
                ranks = [entry.metadata["index"] for entry in retrieved]
                for k in range(1, k_max + 1):
                    hits[k] += any(g in ranks[:k] for g in sample["gold"])
            for k in range(1, len(retrieved) + 1):
                contexts = context_order(retrieved[:k])
                composed = []
                for m in methods:
                    state, t = _timed(lambda: composers[m].compose(contexts, model=model))  # noqa: B023 - _timed calls it at once
                    seconds[m][k].append(t)
                    composed.append(state)
                for m, value in zip(
                    methods,
                    continuation_losses(model, composed, sample["query_ids"], sample["continuation_ids"]).tolist(),
                ):
                    loss[m][k].append(value)
            if (number + 1) % 10 == 0:
                log(f"  {number + 1}/{len(samples)} samples")
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    result = {
        "dataset": dataset,
        "samples": len(samples),
        "database_entries": len(database),
        "k": list(range(k_max + 1)),
        "storage_dtype": storage_dtype,
        "store_build_seconds": build_seconds,
        "retrieval_and_read_seconds_mean": mean(retrieval_seconds),
        "loss": {m: [mean(v) for v in per_k] for m, per_k in loss.items()},
        "seconds": {m: [mean(v) for v in per_k] for m, per_k in seconds.items()},
    }
    if dataset == "recall":
        result["retrieval_hit_rate"] = [None] + [h / len(samples) for h in hits[1:]]
    base = result["loss"]["baseline"][0]
    result["improvement_over_baseline_at_k_max"] = {m: (base - result["loss"][m][k_max]) / base for m in methods}
    result["improvement_over_baseline_best_k"] = {
        m: max((base - v) / base for v in result["loss"][m][1:] if v is not None) for m in methods
    }
    return result


def plot(results: list[dict], path: Path) -> None:
    """Figure-3-style panels: loss vs k and time vs k, one row per (model, dataset)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(10, 3.2 * len(results)), squeeze=False)
    for row, result in enumerate(results):
        ks = result["k"]
        title = f"{result['model']} · {result['dataset']} ({result['samples']} samples)"
        for method, values in result["loss"].items():
            style = "--" if method == "baseline" else "-o"
            axes[row][0].plot(ks, values, style, label=LABELS[method], markersize=3, color=COLORS[method])
        axes[row][0].set(xlabel="retrieved contexts k", ylabel="continuation loss (nats/token)", title=title)
        for method, values in result["seconds"].items():
            axes[row][1].plot(
                ks[1:], [v * 1e3 for v in values[1:]], "-o", label=LABELS[method], markersize=3, color=COLORS[method]
            )
        axes[row][1].set(xlabel="retrieved contexts k", ylabel="time to the state (ms)", yscale="log", title=title)
        axes[row][0].legend(fontsize=7)
        axes[row][1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: list[dict]) -> str:
    """Markdown: loss at k = 0 (baseline), at k_max, best over k, and relative improvement."""
    lines = [
        "| model | dataset | method | loss k=0 | loss k=max | improvement at k=max | best improvement (k) | ms to state at k=max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = r["loss"]["baseline"][0]
        k_max = r["k"][-1]
        for m in r["seconds"]:
            values = r["loss"][m]
            best_k = min(range(1, len(values)), key=lambda k: values[k])
            lines.append(
                f"| {r['model']} | {r['dataset']} | {LABELS[m]} | {base:.3f} | {values[k_max]:.3f} | "
                f"{(base - values[k_max]) / base:+.1%} | {(base - values[best_k]) / base:+.1%} ({best_k}) | {r['seconds'][m][k_max] * 1e3:.1f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    from . import load_demo

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mamba2", choices=["mamba2", "mamba"])
    parser.add_argument("--dataset", default="wikipedia", choices=DATASETS)
    parser.add_argument("--all", action="store_true", help="both demo models on both datasets, one plot")
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--k-max", type=int, default=10)
    parser.add_argument("--storage-dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/eval")
    parser.add_argument(
        "--replot", action="store_true", help="only redraw the plot and table of --all from the JSON in --out"
    )
    args = parser.parse_args(argv)
    if args.replot:
        out = Path(args.out)
        results = [
            json.loads((out / f"picaso_eval_{a}_{d}.json").read_text()) for a in ("mamba2", "mamba") for d in DATASETS
        ]
        plot(results, out / "picaso_eval_all.png")
        (out / "picaso_eval_all.md").write_text(table(results) + "\n")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(a, d) for a in ("mamba2", "mamba") for d in DATASETS] if args.all else [(args.arch, args.dataset)]
    results = []
    for arch, dataset in runs:
        model, tokenizer = load_demo(arch)
        result = evaluate(model, tokenizer, dataset, args.queries, args.k_max, storage_dtype=args.storage_dtype)
        result.update(model=f"demo-{arch}", threads=torch.get_num_threads(), torch=torch.__version__)
        (out / f"picaso_eval_{arch}_{dataset}.json").write_text(json.dumps(result, indent=1))
        results.append(result)
        print(table([result]), flush=True)
    name = "picaso_eval_all" if args.all else f"picaso_eval_{args.arch}_{args.dataset}"
    plot(results, out / f"{name}.png")
    (out / f"{name}.md").write_text(table(results) + "\n")
    print(f"wrote {out}/{name}.png, .md and per-run JSON")


if __name__ == "__main__":
    main()
