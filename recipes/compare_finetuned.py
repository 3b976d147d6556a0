"""Loss vs k: zero-shot composition against BP2C / BPTC adapters and concatenation (PICASO paper, Table 1 / Fig. 4).

    python recipes/compare_finetuned.py --arch mamba2 --adapters adapters/bp2c-mamba2 adapters/bptc-mamba2

For the base demo model and for the base model with each adapter, runs the evaluation protocol of
``python -m hf_statecompose.demo.eval`` (held-out Wikipedia segments and an unseen synthetic recall world;
k = 0…k_max retrieved contexts, composed most relevant last) with ``picaso_r`` and ``concat``. Each
variant encodes its own store (a state belongs to the model that encoded it; the adapter changes the
states). Writes ``finetune_<arch>.json``, ``.md`` (table) and ``.png`` (loss vs k) to ``--out``, with
the training time per step of each adapter (from its ``results.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_variant(arch: str, adapter: str | None):
    import hf_statecompose as hsc

    model, tok = hsc.load_demo(arch)
    if adapter is None:
        return model, tok
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).eval(), tok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mamba2", choices=["mamba2", "mamba"])
    parser.add_argument("--adapters", nargs="*", default=[], help="adapter folders written by recipes/finetune.py")
    parser.add_argument("--datasets", nargs="*", default=["wikipedia", "recall"])
    parser.add_argument("--queries", type=int, default=40)
    parser.add_argument("--k-max", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "finetune"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(args.threads)
    from hf_statecompose.demo.eval import evaluate

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [("zero-shot", None)] + [(Path(a).name, a) for a in args.adapters]
    result = {
        "arch": args.arch,
        "queries": args.queries,
        "k": list(range(args.k_max + 1)),
        "variants": {},
        "training": {},
    }
    for name, adapter in variants:
        if adapter:
            trained = json.loads((Path(adapter) / "results.json").read_text())
            result["training"][name] = {
                k: trained["training"][k]
                for k in ("steps", "train_seconds", "seconds_per_step_mean", "seconds_per_step_by_k")
            }
            result["training"][name]["objective"] = trained["config"]["objective"]
        model, tok = load_variant(args.arch, adapter)
        for dataset in args.datasets:
            start = time.time()
            r = evaluate(
                model, tok, dataset, args.queries, args.k_max, methods=("concat", "picaso_r"), log=lambda *a: None
            )
            result["variants"].setdefault(name, {})[dataset] = {"loss": r["loss"], "samples": r["samples"]}
            print(
                f"{name:>14s} {dataset:9s} baseline {r['loss']['baseline'][0]:.3f}  picaso_r k=1/5/10 "
                f"{r['loss']['picaso_r'][1]:.3f}/{r['loss']['picaso_r'][5]:.3f}/{r['loss']['picaso_r'][args.k_max]:.3f}  concat "
                f"{r['loss']['concat'][1]:.3f}/{r['loss']['concat'][5]:.3f}/{r['loss']['concat'][args.k_max]:.3f}  ({time.time() - start:.0f}s)",
                flush=True,
            )
    stem = out / f"finetune_{args.arch}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(table(result) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(table(result))
    print(f"wrote {stem}.json, .md, .png")


def table(result: dict) -> str:
    from hf_statecompose.demo.eval import LABELS

    ks = [k for k in (1, 2, 5, 10) if k < len(result["k"])]
    lines = [
        f"| dataset | model | method | k=0 | {' | '.join(f'k={k}' for k in ks)} |",
        "|---|---|---|---:|" + "---:|" * len(ks),
    ]
    datasets = next(iter(result["variants"].values())).keys()
    for dataset in datasets:
        for name, per in result["variants"].items():
            loss = per[dataset]["loss"]
            for method in ("picaso_r", "concat"):
                label = LABELS[method]
                lines.append(
                    f"| {dataset} | {name} | {label} | {loss['baseline'][0]:.3f} | "
                    + " | ".join(f"{loss[method][k]:.3f}" for k in ks)
                    + " |"
                )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(next(iter(result["variants"].values())).keys())
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 3.6), squeeze=False)
    colors = ["tab:purple", "tab:orange", "tab:green", "tab:red", "tab:brown"]
    for col, dataset in enumerate(datasets):
        ax = axes[0][col]
        for i, (name, per) in enumerate(result["variants"].items()):
            loss = per[dataset]["loss"]
            ax.plot(
                result["k"],
                loss["picaso_r"],
                "-o",
                markersize=3,
                color=colors[i % len(colors)],
                label=f"{name} · PICASO-R",
            )
            ax.plot(result["k"], loss["concat"], "--", color=colors[i % len(colors)], label=f"{name} · Concat")
        ax.set(
            xlabel="retrieved contexts k",
            ylabel="continuation loss (nats/token)",
            title=f"demo {result['arch']} · {dataset}",
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
