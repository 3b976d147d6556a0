"""Composition vs re-reading the concatenated contexts, on 130M-shaped random Mamba / Mamba-2 (CPU).

For n = 1, 2, 5, 10, 20 contexts of 128 tokens:
  * state time: the time to obtain the conditioning state. Baseline ``concat`` is transformers' own
    prefill of the concatenated contexts (``use_cache=True, logits_to_keep=1``), what a user does
    without this library; the model-free methods compose states encoded beforehand (encoding is a
    one-off cost per context, reported separately as ``encode / prefill`` for one context);
    ``piconcat_r`` re-encodes all n rotations (only for n <= --piconcat-max-n, it is n times concat).
  * TTFT: time to the first token of a 32-token query: the state time plus one forward of the query.
Every figure is a median of --repeats runs; ratios are against ``concat`` measured in the same run.
Before timing, the composed states are checked (one state composes to itself exactly; PICASO-S /
PICASO-R equal the brute-force mean over orders): a failing check stops the benchmark.

    python benchmarks/compose_vs_concat.py [--arch mamba mamba2] [--repeats 3] [--out benchmarks/results/compose_vs_concat.json]
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys

import torch
import transformers
from transformers import Mamba2ForCausalLM, MambaForCausalLM
from transformers.utils import logging as hf_logging

import hf_statecompose as hsc
from hf_statecompose.benchmarking import MODEL_130M_KWARGS, git_commit, median_time, write_result

hf_logging.set_verbosity_error()
METHODS = ["soup", "caso", "picaso_s", "picaso_r", "piconcat_r"]
CONFIGS = {
    "mamba": (MambaForCausalLM, MODEL_130M_KWARGS["mamba"]),
    "mamba2": (Mamba2ForCausalLM, MODEL_130M_KWARGS["mamba2"]),
}


def check_correctness(model, states):
    """Refuse to report speed for wrong results."""
    one = hsc.StateComposer("picaso_s").compose(states[:1])
    assert all(torch.equal(one.ssm_states[i], states[0].ssm_states[i]) for i in range(one.num_layers)), "n=1 not exact"
    subset = states[:4]
    for method, orders in (
        ("picaso_s", list(itertools.permutations(range(4)))),
        ("picaso_r", [[(k + j) % 4 for j in range(4)] for k in range(4)]),
    ):
        got = hsc.StateComposer(method).compose(subset).ssm_states[0].double()
        expected = 0
        for order in orders:
            x = torch.zeros_like(got)
            for k in order:
                x = torch.exp(subset[k].log_decay(0).double()) * x + subset[k].ssm_states[0].double()
            expected = expected + x / len(orders)
        err = float((got - expected).abs().max() / expected.abs().max())
        assert err < 1e-4, f"{method} differs from brute force by {err}"


def run_arch(arch, ns, repeats, context_length, query_length, piconcat_max_n, seed):
    cls, kwargs = CONFIGS[arch]
    torch.manual_seed(seed)
    model = hsc.enable(cls(cls.config_class(**kwargs)).eval())
    generator = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(3, 50000, (1, context_length), generator=generator) for _ in range(max(max(ns), 4))]
    query = torch.randint(3, 50000, (1, query_length), generator=generator)
    rows = []
    with torch.no_grad():
        model(contexts[0], use_cache=True, logits_to_keep=1)  # warm-up, both paths
        hsc.ComposableMambaCache.encode(model, contexts[0])
        prefill_one = median_time(lambda: model(contexts[0], use_cache=True, logits_to_keep=1), repeats)
        encode_one = median_time(lambda: hsc.ComposableMambaCache.encode(model, contexts[0]), repeats)
        states = [hsc.ComposableMambaCache.encode(model, c) for c in contexts]
        check_correctness(model, states)
        for n in ns:
            concat_ids = torch.cat(contexts[:n], 1)
            state_times = {"concat": median_time(lambda: model(concat_ids, use_cache=True, logits_to_keep=1), repeats)}
            ttft = {
                "concat": median_time(
                    lambda: model(torch.cat([concat_ids, query], 1), use_cache=True, logits_to_keep=1).logits.argmax(
                        -1
                    ),
                    repeats,
                )
            }
            for method in METHODS:
                if method == "piconcat_r" and n > piconcat_max_n:
                    continue
                composer = hsc.StateComposer(method)
                compose = lambda: composer.compose(states[:n], model=model)
                composer.compose(states[:n], model=model)  # warm-up
                state_times[method] = median_time(compose, repeats)

                def first_token():
                    composed = compose()
                    return model(query, past_states=[composed], logits_to_keep=1).logits.argmax(-1)

                ttft[method] = median_time(first_token, repeats)
            for method in ["concat"] + METHODS:
                if method not in state_times:
                    continue
                rows.append(
                    dict(
                        arch=arch,
                        n=n,
                        method=method,
                        state_s=state_times[method],
                        state_speedup_vs_concat=state_times["concat"] / state_times[method],
                        ttft_s=ttft[method],
                        ttft_speedup_vs_concat=ttft["concat"] / ttft[method],
                    )
                )
            print(f"  {arch} n={n} done", file=sys.stderr, flush=True)
    return rows, dict(
        prefill_one_context_s=prefill_one, encode_one_context_s=encode_one, encode_over_prefill=encode_one / prefill_one
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["mamba", "mamba2"], choices=list(CONFIGS))
    parser.add_argument("--n", nargs="+", type=int, default=[1, 2, 5, 10, 20])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--query-length", type=int, default=32)
    parser.add_argument("--piconcat-max-n", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/compose_vs_concat.json")
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args()

    rows, encode = [], {}
    for arch in args.arch:
        arch_rows, encode[arch] = run_arch(
            arch, args.n, args.repeats, args.context_length, args.query_length, args.piconcat_max_n, args.seed
        )
        rows += arch_rows

    print(
        f"\nencode one {args.context_length}-token context vs transformers' prefill (use_cache=True, logits_to_keep=1):"
    )
    for arch, e in encode.items():
        print(
            f"  {arch:<7} encode {e['encode_one_context_s']:.3f} s, prefill {e['prefill_one_context_s']:.3f} s, ratio {e['encode_over_prefill']:.2f}x"
        )
    header = "| arch | n | method | state (s) | state speed-up vs concat | TTFT (s) | TTFT speed-up vs concat |"
    print("\n" + header + "\n|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['arch']} | {r['n']} | {r['method']} | {r['state_s']:.4f} | {r['state_speedup_vs_concat']:.1f}x | {r['ttft_s']:.4f} | {r['ttft_speedup_vs_concat']:.1f}x |"
        )

    result = dict(
        benchmark="compose_vs_concat",
        commit=git_commit(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        machine=platform.machine(),
        threads=torch.get_num_threads(),
        dtype="float32",
        device="cpu",
        context_length=args.context_length,
        query_length=args.query_length,
        repeats=args.repeats,
        statistic="median",
        baseline="concat = transformers prefill of the concatenated contexts",
        configs={a: CONFIGS[a][1] for a in args.arch},
        encode=encode,
        rows=rows,
    )
    write_result(result, args.out)
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "compose_vs_concat.json")


if __name__ == "__main__":
    main()
