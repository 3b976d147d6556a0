"""Storage dtype of a StateStore: fp32 vs bf16, size and quality, on the demo models.

    python benchmarks/store_dtype.py [--queries 20] [--k 5]

For each demo model and dataset (the evaluation's held-out Wikipedia segments and synthetic recall
passages) we build the same store twice, fp32 and bf16, and report: bytes of one entry's state and of
the store (bf16 / fp32), the relative error of the bf16 states, and the continuation loss with k
retrieved contexts composed by PICASO-R and Soup from either store (the same samples, the same run).
Writes benchmarks/results/store_dtype.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import tempfile

import torch

import hf_statecompose as hsc
from hf_statecompose.benchmarking import write_result
from hf_statecompose.demo.eval import build_samples, evaluate


def state_error(store32, store16) -> float:
    """max over entries and layers of ||bf16 - fp32|| / ||fp32|| (SSM states), matching entries by text."""
    by_text = {e.text: e.id for e in store16.entries()}
    worst = 0.0
    for entry in store32.entries():
        a, b = store32.get(entry.id), store16.get(by_text[entry.text])
        for layer in range(a.num_layers):
            worst = max(worst, float((b.ssm_states[layer] - a.ssm_states[layer]).norm() / a.ssm_states[layer].norm()))
    return worst


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "store_dtype.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    rows = []
    for arch in ("mamba2", "mamba"):
        model, tok = hsc.load_demo(arch)
        for dataset in ("wikipedia", "recall"):
            with tempfile.TemporaryDirectory() as tmp:
                runs = {
                    dtype: evaluate(
                        model,
                        tok,
                        dataset,
                        args.queries,
                        args.k,
                        store_dir=tmp,
                        storage_dtype=dtype,
                        methods=("soup", "picaso_r"),
                        log=lambda *a: None,
                    )
                    for dtype in ("fp32", "bf16")
                }
                stores = {dtype: hsc.StateStore(Path(tmp) / f"{dataset}-{dtype}", model, tok) for dtype in runs}
                stats = {dtype: store.stats() for dtype, store in stores.items()}
                error = state_error(stores["fp32"], stores["bf16"])
            database, _ = build_samples(dataset, tok, args.queries)
            row = {
                "model": f"demo-{arch}",
                "dataset": dataset,
                "entries": len(database),
                "k": args.k,
                "samples": runs["fp32"]["samples"],
                "state_bytes_per_entry": {d: s["state_bytes_per_entry"] for d, s in stats.items()},
                "store_bytes": {d: s["bytes"] for d, s in stats.items()},
                "bf16_state_relative_error_max": error,
                "loss": {d: {m: r["loss"][m][args.k] for m in ("soup", "picaso_r")} for d, r in runs.items()},
                "baseline_loss": runs["fp32"]["loss"]["baseline"][0],
            }
            rows.append(row)
    print(
        "| model | dataset | entry bytes fp32 | bf16/fp32 entry | bf16/fp32 store | max rel. state error | PICASO-R loss fp32 → bf16 | Soup loss fp32 → bf16 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, s, lo = r["state_bytes_per_entry"], r["store_bytes"], r["loss"]
        print(
            f"| {r['model']} | {r['dataset']} | {b['fp32']} | {b['bf16'] / b['fp32']:.3f} | {s['bf16'] / s['fp32']:.3f} | "
            f"{r['bf16_state_relative_error_max']:.1e} | {lo['fp32']['picaso_r']:.4f} → {lo['bf16']['picaso_r']:.4f} | "
            f"{lo['fp32']['soup']:.4f} → {lo['bf16']['soup']:.4f} |"
        )
    write_result({"rows": rows, "threads": torch.get_num_threads(), "torch": torch.__version__}, args.out)
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "store_dtype.json")


if __name__ == "__main__":
    main()
