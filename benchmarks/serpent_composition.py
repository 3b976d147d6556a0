"""How far is composition from concatenation, for SeRpEnt-Mamba vs its matched Mamba-1 (issue 12)?

Both trained miniature LMs of ``recipes/serpent.py`` (``checkpoints/serpent/lm-serpent`` and ``lm-mamba``:
same data, tokenizer, steps, about 0.67M parameters each), the same protocol for both:

* held-out Wikipedia articles (``hf_statecompose.demo.corpora.wikipedia_split``: the title-hash rule of
  ``recipes/train_demo.py``, never trained on); ``--examples`` windows of ``4 * 64 + 32`` tokens at seeded
  positions. The last 32 tokens are the continuation; for n in {1, 2, 4} the contexts are the n 64-token
  chunks right before it, each encoded alone into a state;
* for each composition method the continuation is run after the composed state (``past_states=``) and
  scored on its tokens 2..32 (31 next-token predictions): mean loss (nats/token), and the mean
  KL(concat || method) of the next-token distributions at those positions;
* ``concat`` (re-encoding the concatenated contexts) is the exact reference: its logits are those of one
  forward over contexts + continuation (checked); ``none`` is the continuation without any context;
  ``kl_share`` = KL(concat || method) / KL(concat || none): how much of the context's effect on the
  predictions a method misses (0: exact; 1: as if there were no context). The loss differences are small on
  these barely trained models (held-out loss about 6.9 nats against ln 4096 = 8.3), so the KL is the measure.

For n = 1 every model-free method is exact (checked: the script stops otherwise). SeRpEnt's resampling
state (clock / grid phase, neighbour window, last ȳ) of a composition is the last context's, its branch
SSM states compose as Mamba-1 states; Mamba-1 has no such extra state. A diagnostic row for SeRpEnt,
``caso_oracle_resampling``, gives CASO's SSM states the concatenation's resampling state instead: the part of
CASO's gap that the resampling state explains.

    python benchmarks/serpent_composition.py [--examples 30] [--out benchmarks/results/serpent_composition.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

import hf_statecompose as hsc
from hf_statecompose.benchmarking import git_commit, write_result
from hf_statecompose.demo.corpora import wikipedia_split

hf_logging.set_verbosity_error()
METHODS = ["soup", "caso", "picaso_s", "picaso_r", "piconcat_r"]
CONTEXT, CONTINUATION, NS = 64, 32, (1, 2, 4)
MODELS = {"SeRpEnt": "checkpoints/serpent/lm-serpent", "Mamba-1": "checkpoints/serpent/lm-mamba"}


def windows(tokenizer, count: int, seed: int) -> torch.Tensor:
    """``[count, 4 * 64 + 32]`` token windows from the held-out articles, at seeded positions (round robin over
    the articles long enough)."""
    length = max(NS) * CONTEXT + CONTINUATION
    _, held_out = wikipedia_split()
    articles = [
        ids
        for ids in (tokenizer(text, add_special_tokens=False)["input_ids"] for _, text in held_out)
        if len(ids) >= length
    ]
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        ids = articles[i % len(articles)]
        start = rng.randrange(0, len(ids) - length + 1)
        rows.append(ids[start : start + length])
    return torch.tensor(rows), len(articles)


def next_token_logprobs(model, continuation, state=None):
    """log p of the next token at continuation positions 1..31 (predicting tokens 2..32): ``[B, 31, V]``."""
    kwargs = {} if state is None else dict(past_states=[state])
    logits = model(continuation, **kwargs).logits[:, :-1].double()
    return torch.log_softmax(logits, -1)


def score(logp, targets):
    """(mean loss over rows and positions, per-row losses)."""
    nll = -logp.gather(-1, targets[..., None])[..., 0]  # [B, 31]
    return float(nll.mean()), nll.mean(1)


@torch.no_grad()
def run_model(name, path, data, threads):
    torch.set_num_threads(threads)
    model = hsc.enable(AutoModelForCausalLM.from_pretrained(path).eval())
    targets = data[:, -CONTINUATION + 1 :]
    continuation = data[:, -CONTINUATION:]
    none_logp = next_token_logprobs(model, continuation)
    none_loss, _ = score(none_logp, targets)
    rows = {}
    for n in NS:
        start = time.perf_counter()
        contexts = [
            data[:, -CONTINUATION - (n - k) * CONTEXT : -CONTINUATION - (n - k - 1) * CONTEXT] for k in range(n)
        ]
        states = [hsc.ComposableMambaCache.encode(model, c) for c in contexts]  # each context alone, batch = examples
        concat = hsc.StateComposer("concat").compose(states, model=model)
        concat_logp = next_token_logprobs(model, continuation, concat)
        # the reference is exact: one forward over contexts + continuation
        full = torch.log_softmax(model(data[:, -CONTINUATION - n * CONTEXT :]).logits[:, n * CONTEXT : -1].double(), -1)
        err = float((full - concat_logp).abs().max())
        if err > 1e-3:
            sys.exit(f"{name} n={n}: concat differs from the full forward by {err:.3g} (log-prob): not reporting")
        concat_loss, _ = score(concat_logp, targets)
        kl_none = kl(concat_logp, none_logp)
        entry = {
            "concat": {"loss": concat_loss, "kl_from_concat": 0.0, "kl_share": 0.0},
            "none": {"loss": none_loss, "kl_from_concat": kl_none, "kl_share": 1.0},
        }
        for method in METHODS:
            composed = hsc.StateComposer(method).compose(states, model=model)
            logp = next_token_logprobs(model, continuation, composed)
            loss, _ = score(logp, targets)
            divergence = kl(concat_logp, logp)
            entry[method] = {"loss": loss, "kl_from_concat": divergence, "kl_share": divergence / kl_none}
            if n == 1 and (method != "piconcat_r") and abs(loss - concat_loss) > 1e-4:
                sys.exit(f"{name}: n=1 {method} is not exact ({loss} vs {concat_loss}): not reporting")
        if isinstance(concat, hsc.ComposableSeRpEntCache):
            # diagnostic: CASO's branch SSM states with the concatenation's resampling state instead of the last
            # context's (an oracle): how much of CASO's gap the resampling state (phase, window, last ȳ) explains
            oracle = hsc.StateComposer("caso").compose(states)
            oracle.finish_composition([concat])
            entry["caso_oracle_resampling"] = {
                "loss": score(next_token_logprobs(model, continuation, oracle), targets)[0]
            }
            logp = next_token_logprobs(model, continuation, oracle)
            entry["caso_oracle_resampling"].update(
                kl_from_concat=kl(concat_logp, logp), kl_share=kl(concat_logp, logp) / kl_none
            )
        entry["seconds"] = round(time.perf_counter() - start, 1)
        rows[n] = entry
        print(f"  {name} n={n}: {entry['seconds']} s", flush=True)
    return rows


def weights_digest(path) -> str:
    """sha256 (first 16 hex digits) of the checkpoint's weights: which training run was measured."""
    import hashlib

    with open(os.path.join(path, "model.safetensors"), "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()[:16]


def kl(reference_logp, logp) -> float:
    """Mean over rows and positions of KL(reference || method) in nats."""
    return float((reference_logp.exp() * (reference_logp - logp)).sum(-1).mean())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/serpent_composition.json")
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    missing = [p for p in MODELS.values() if not os.path.isdir(p)]
    if missing:
        sys.exit(f"trained checkpoints missing: {missing}; run `python recipes/serpent.py --task lm` first")
    tokenizer = AutoTokenizer.from_pretrained(MODELS["SeRpEnt"])
    data, articles = windows(tokenizer, args.examples, args.seed)
    print(f"{args.examples} windows of {data.shape[1]} tokens from {articles} held-out articles", flush=True)
    results = {name: run_model(name, path, data, args.threads) for name, path in MODELS.items()}

    columns = ["none", "concat", *METHODS]
    print("\nmean continuation loss (nats/token) / KL(concat || method) (nats) (KL share: KL / KL of no context)")
    print(f"| model | n | {' | '.join(columns)} |")
    print("|---|---:|" + "---:|" * len(columns))
    for name, rows in results.items():
        for n, entry in rows.items():
            cells = []
            for c in columns:
                e = entry[c]
                share = "" if c in ("none", "concat") else f" ({100 * e['kl_share']:.1f}%)"
                kl_text = "" if c == "concat" else f" / {e['kl_from_concat']:.5f}"
                cells.append(f"{e['loss']:.4f}{kl_text}{share}")
            print(f"| {name} | {n} | {' | '.join(cells)} |")
    for name, rows in results.items():
        for n, entry in rows.items():
            if "caso_oracle_resampling" in entry and n > 1:
                e = entry["caso_oracle_resampling"]
                print(
                    f"{name} n={n}: caso with the concatenation's resampling state (oracle): loss {e['loss']:.4f}, "
                    f"KL {e['kl_from_concat']:.5f} ({100 * e['kl_share']:.2f}%) vs caso's {entry['caso']['kl_from_concat']:.5f}"
                )
    result = {
        "benchmark": "serpent_composition",
        "commit": git_commit(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "machine": platform.machine(),
        "models": {name: {"path": path, "weights_sha256": weights_digest(path)} for name, path in MODELS.items()},
        "protocol": {
            "examples": args.examples,
            "seed": args.seed,
            "context_tokens": CONTEXT,
            "continuation_tokens": CONTINUATION,
            "scored_tokens": CONTINUATION - 1,
            "ns": list(NS),
            "held_out_articles": articles,
            "dtype": "float32",
            "threads": args.threads,
        },
        "results": {name: {str(n): entry for n, entry in rows.items()} for name, rows in results.items()},
    }
    write_result(result, args.out)
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "serpent_composition.json")


if __name__ == "__main__":
    main()
