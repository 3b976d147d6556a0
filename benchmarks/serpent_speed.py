"""SeRpEnt vs Mamba-1 at matched size: forward (prefill) tokens/s and one decode step, as ratios.

The models are the language-modelling pair of ``recipes/configs/serpent.json`` (same shapes as the
trained ``checkpoints/serpent/lm-*``, randomly initialised, float32, eval mode), measured in the same run,
in interleaved rounds (every model once per round, in turn), each a median of ``--repeats`` calls; the
figure is the median over ``--rounds``. Two Mamba-1 baselines:

* ``mamba`` — transformers' ``MambaForCausalLM`` as it runs out of the box (on CPU without
  ``mamba_ssm``: its reference PyTorch fallback);
* ``mamba (hsc path)`` — the same model through hf_statecompose's state-aware path (``hsc.enable`` +
  a ``ComposableMambaCache``; native CPU kernels), the path ``recipes/serpent.py`` trains Mamba-1 on.

Forward: ``model(input_ids)`` on ``B × L`` tokens under ``torch.no_grad()`` (full logits, no cache),
tokens/s = B·L / time. Decode: after a prefill of ``L`` tokens with ``use_cache=True``, one step
``model(input_ids=next_token, cache=cache, use_cache=True)``. Ratios: SeRpEnt tokens/s ÷ baseline
tokens/s (> 1: SeRpEnt faster) and SeRpEnt decode time ÷ baseline decode time (< 1: SeRpEnt faster).

    python benchmarks/serpent_speed.py [--lengths 128 512 2048] [--batch 4] [--rounds 3] [--repeats 3] [--threads 2]
    python benchmarks/serpent_speed.py --smoke --out /tmp/serpent_speed.json     # tiny models, one round (tests)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "serpent.json"
SMOKE_MODELS = {
    "serpent": {"hidden_size": 24, "num_hidden_layers": 2, "intermediate_size": 48},
    "mamba": {"hidden_size": 24, "num_hidden_layers": 2},
}


def build_models(config_path: Path, smoke: bool, vocab_size: int = 4096):
    """``{name: (model, call kwargs maker)}`` for SeRpEnt and the two Mamba-1 baselines (same weights)."""
    import torch
    import transformers

    import hf_statecompose as hsc

    specs = copy.deepcopy(json.loads(Path(config_path).read_text())["tasks"]["lm"]["models"])
    if smoke:
        for name, override in SMOKE_MODELS.items():
            specs[name]["config"].update(override)
    built = {}
    for name, spec in specs.items():
        cls = getattr(hsc, spec["class"], None) or getattr(transformers, spec["class"])
        torch.manual_seed(0)
        built[name] = cls(cls.config_class(**spec["config"], vocab_size=vocab_size)).eval()
    stock = built["mamba"]
    enabled = hsc.enable(copy.deepcopy(stock))
    return {"serpent": built["serpent"], "mamba": stock, "mamba (hsc path)": enabled}, specs


def serpent_source_digest() -> str:
    """sha256 (first 12 hex digits) of the SeRpEnt model's source files (as recipes/serpent.py records it)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "hf_statecompose" / "models" / "serpent").glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def call_kwargs(name: str, model):
    """Extra forward kwargs: an empty ComposableMambaCache routes the enabled Mamba onto the hsc path."""
    import hf_statecompose as hsc

    if name == "mamba (hsc path)":
        return dict(use_cache=True, **hsc.compat.cache_kwargs(hsc.ComposableMambaCache.empty_for(model)))
    return {}


def measure(models, lengths, batch, rounds, repeats, warmup=1):
    import torch

    import hf_statecompose as hsc
    from hf_statecompose.benchmarking import median_time

    per_round = {(name, kind, length): [] for name in models for kind in ("forward", "decode") for length in lengths}
    generator = torch.Generator().manual_seed(0)
    inputs = {length: torch.randint(0, 4096, (batch, length), generator=generator) for length in lengths}
    with torch.no_grad():
        for round_index in range(rounds):
            for length in lengths:
                ids = inputs[length]
                for name, model in models.items():

                    def prefill(name=name, model=model, ids=ids):
                        return model(input_ids=ids, **call_kwargs(name, model))

                    per_round[(name, "forward", length)].append(
                        median_time(prefill, repeats, warmup=warmup if round_index == 0 else 0)
                    )
                    out = model(input_ids=ids, **{**call_kwargs(name, model), "use_cache": True})
                    cache, next_token = hsc.compat.output_cache(out), out.logits[:, -1:].argmax(-1)

                    def decode(model=model, cache=cache, next_token=next_token):
                        return model(input_ids=next_token, use_cache=True, **hsc.compat.cache_kwargs(cache))

                    per_round[(name, "decode", length)].append(median_time(decode, max(repeats, 5), warmup=1))
    return {key: statistics.median(times) for key, times in per_round.items()}, per_round


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--config", default=str(CONFIG), help="the recipe config whose lm models are compared")
    parser.add_argument("--smoke", action="store_true", help="tiny models, one round, short lengths (for tests)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serpent_speed.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.lengths, args.batch, args.rounds, args.repeats = [16], 1, 1, 1
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    sys.path.insert(0, str(ROOT))
    from hf_statecompose.benchmarking import git_commit, write_result

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    models, specs = build_models(Path(args.config), args.smoke)
    params = {name: sum(p.numel() for p in model.parameters()) for name, model in models.items()}
    medians, per_round = measure(models, args.lengths, args.batch, args.rounds, args.repeats)

    rows = []
    print(
        f"\nSeRpEnt {params['serpent']:,} vs Mamba-1 {params['mamba']:,} parameters; batch {args.batch}, float32, "
        f"{args.threads} thread(s), {args.rounds} interleaved rounds"
    )
    print(
        f"{'L':>6} {'model':>18} {'forward tok/s':>14} {'decode ms':>10} {'SeRpEnt fwd ×':>14} {'SeRpEnt decode ×':>17}"
    )
    for length in args.lengths:
        for name in models:
            forward, decode = medians[(name, "forward", length)], medians[(name, "decode", length)]
            row = {
                "length": length,
                "batch": args.batch,
                "model": name,
                "forward_seconds": forward,
                "forward_tokens_per_second": args.batch * length / forward,
                "decode_step_seconds": decode,
                "forward_rounds": per_round[(name, "forward", length)],
                "decode_rounds": per_round[(name, "decode", length)],
            }
            if name != "serpent":
                # tokens/s ratio (> 1: SeRpEnt faster) and decode time ratio (< 1: SeRpEnt faster)
                row["serpent_forward_speed_ratio"] = forward / medians[("serpent", "forward", length)]
                row["serpent_decode_time_ratio"] = medians[("serpent", "decode", length)] / decode
            rows.append(row)
            ratios = (
                f"{row['serpent_forward_speed_ratio']:>14.2f} {row['serpent_decode_time_ratio']:>17.2f}"
                if name != "serpent"
                else f"{'':>14} {'':>17}"
            )
            print(f"{length:>6} {name:>18} {row['forward_tokens_per_second']:>14,.0f} {decode * 1e3:>10.2f} {ratios}")
    result = {
        "benchmark": "serpent_speed",
        "git_commit": git_commit(),
        "serpent_source_sha256": serpent_source_digest(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "processor": platform.processor(),
        "threads": args.threads,
        "dtype": "float32",
        "device": "cpu",
        "rounds": args.rounds,
        "repeats": args.repeats,
        "smoke": args.smoke,
        "parameters": params,
        "model_configs": {k: v["config"] for k, v in specs.items()},
        "rows": rows,
    }
    write_result(result, args.out)
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "serpent_speed.json")


if __name__ == "__main__":
    main()
