"""Composing n delta-rule contexts (issue 31): the cost of the mean over all orders (PICASO-S, subset recursion) and
over cyclic orders (PICASO-R) against n, as ratios to the in-order composition (CASO) of the same n states.

    python benchmarks/delta_rule_compose.py [--ns 2 3 4 5 6 7 8] [--heads 32] [--k-dim 128] [--v-dim 128]

One gated-DeltaNet layer shaped like transformers' default Qwen3NextConfig (Qwen3-Next-80B-A3B: 32 value heads,
k = v = 128; 36 such layers in the model), batch 1, float32, CPU, torch's `ops.delta_rule` paths. Each n is first
checked against the reference fold over the same orders (n ≤ 5 for all orders: n! folds) in float64 on a smaller
head count. Candidates run interleaved (a shared machine's load hits all alike). Writes
benchmarks/results/delta_rule_compose.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent

import argparse
import statistics

import torch

from hf_statecompose.benchmarking import git_commit, median_time, write_result
from hf_statecompose.ops.delta_rule import (
    compose_in_order,
    mean_over_orders,
    mean_over_orders_reference,
    mean_over_rotations,
    rotations,
)


def _random(n, heads, k_dim, v_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(n, 1, heads, k_dim, v_dim, generator=g, dtype=dtype)
    # transitions of a few decaying reflections: norms below 1, as a context's product is
    eye = torch.eye(k_dim, dtype=dtype)
    transitions = []
    for _ in range(n):
        k = torch.nn.functional.normalize(torch.randn(heads, k_dim, generator=g, dtype=dtype), dim=-1)
        beta = torch.rand(heads, 1, 1, generator=g, dtype=dtype)
        transitions.append(0.9 * (eye - beta * k[:, :, None] * k[:, None, :]))
    return states, torch.stack(transitions)[:, None]


def _check(n):
    states, transitions = _random(n, 2, 16, 8, torch.float64, seed=n)
    listed_s, listed_m = list(states), list(transitions)
    checks = [(mean_over_rotations, rotations(n))]
    if n <= 5:
        checks.append((mean_over_orders, None))
    for fn, orders in checks:
        s, m = fn(states, transitions)
        s_ref, m_ref = mean_over_orders_reference(listed_s, listed_m, orders=orders)
        error = float(max((s - s_ref).abs().max() / s_ref.abs().max(), (m - m_ref).abs().max() / m_ref.abs().max()))
        if error > 1e-10:
            raise SystemExit(f"{fn.__name__} is off by {error:.2e} at n={n}: fix it (tests/test_delta_rule_ops.py)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ns", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--k-dim", type=int, default=128)
    parser.add_argument("--v-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "results" / "delta_rule_compose.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for n in args.ns:
        _check(n)
        states, transitions = _random(n, args.heads, args.k_dim, args.v_dim, torch.float32, seed=0)
        fns = {
            "caso (in order)": lambda: compose_in_order(states, transitions),
            "picaso_r (cyclic orders)": lambda: mean_over_rotations(states, transitions),
            "picaso_s (all orders)": lambda: mean_over_orders(states, transitions),
        }
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                times[name].append(median_time(fn, 1))
        base = statistics.median(times["caso (in order)"])
        for name in fns:
            t = statistics.median(times[name])
            rows.append({"what": f"{name}, n={n}", "method": name, "n": n, "s": t, "ratio": t / base})
    print(
        f"delta-rule composition, one layer [1, {args.heads}, {args.k_dim}, {args.v_dim}] + transitions, float32, "
        f"CPU, threads={torch.get_num_threads()}, median of {args.repeats} interleaved runs"
    )
    print("| n | method | time | / caso of the same n |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']} | {r['method']} | {r['s'] * 1e3:.1f} ms | {r['ratio']:.2f} |")
    write_result(
        {
            "rows": rows,
            "shape": {"batch": 1, "heads": args.heads, "k_dim": args.k_dim, "v_dim": args.v_dim, "dtype": "float32"},
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
            "note": "one layer; a Qwen3-Next-shaped model has 36. Shared machine: absolute times are noisy",
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "delta_rule_compose.json")


if __name__ == "__main__":
    main()
