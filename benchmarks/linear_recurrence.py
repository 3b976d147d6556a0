"""Diagonal linear recurrence h_k = a_k h_{k-1} + b_k: the doubling scan (backend="torch") vs Python loops.

    python benchmarks/linear_recurrence.py [--repeats 5] [--device cpu] [--threads 1]

Candidates, forward only and forward + backward, for B = 2 and C = 128 (COFFEE D = 16, n = 8; --channels for more):
the vectorised op, the reference (``linear_recurrence_reference``: loop over L + stack, autograd through the
loop) and a plain torch loop writing into a preallocated output (forward only). Each shape is first
checked against the reference (relative error ≤ 1e-5 in fp32); a failed check stops the script before any
ratio is reported. Candidates run interleaved (load swings of a shared machine hit all alike). Writes
benchmarks/results/linear_recurrence.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent

import argparse
import statistics

import torch

from hf_statecompose.benchmarking import git_commit, median_time, write_result
from hf_statecompose.ops import linear_recurrence, linear_recurrence_reference


def plain_loop(a, b, h0):
    out = torch.empty_like(b)
    h = h0
    for k in range(b.shape[1]):
        h = a[:, k] * h + b[:, k]
        out[:, k] = h
    return out


def with_backward(fn, a, b, h0):
    leaves = [t.detach().requires_grad_(True) for t in (a, b, h0)]

    def run():
        h = fn(*leaves)
        torch.autograd.grad(h.sum(), leaves)

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", type=int, nargs="+", default=[255, 4096])
    parser.add_argument("--channels", type=int, nargs="+", default=[128])
    parser.add_argument("--out", default=str(HERE / "results" / "linear_recurrence.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    for channels in args.channels:
        for length in args.lengths:
            a = torch.rand(2, length, channels, generator=g).to(args.device)
            b = torch.randn(2, length, channels, generator=g).to(args.device)
            h0 = torch.randn(2, channels, generator=g).to(args.device)
            fast = lambda a, b, h0: linear_recurrence(a, b, h0, backend="torch")
            expected = linear_recurrence_reference(a.double(), b.double(), h0.double())
            error = float((fast(a, b, h0).double() - expected).abs().max() / expected.abs().max())
            if error > 1e-5:
                raise SystemExit(
                    f"linear_recurrence(backend='torch') is off by {error:.2e} at C={channels} "
                    f"L={length}: fix the op (tests/test_linear_recurrence.py) before timing it"
                )
            fns = [
                lambda: fast(a, b, h0),
                lambda: linear_recurrence_reference(a, b, h0),
                lambda: plain_loop(a, b, h0),
                with_backward(fast, a, b, h0),
                with_backward(linear_recurrence_reference, a, b, h0),
            ]
            times = [[] for _ in fns]
            for _ in range(args.repeats):
                for fn, bucket in zip(fns, times):
                    bucket.append(median_time(fn, 1, args.device))
            t = [statistics.median(x) for x in times]
            shape = {"B": 2, "L": length, "C": channels, "dtype": "float32", "rel_error": error}
            rows.append(
                {
                    **shape,
                    "what": "forward",
                    "s": t[0],
                    "reference_s": t[1],
                    "plain_loop_s": t[2],
                    "ratio_vs_reference": t[0] / t[1],
                    "ratio_vs_plain_loop": t[0] / t[2],
                }
            )
            rows.append(
                {**shape, "what": "forward+backward", "s": t[3], "reference_s": t[4], "ratio_vs_reference": t[3] / t[4]}
            )
    print(
        f"linear_recurrence, {args.device}, threads={torch.get_num_threads()}, median of {args.repeats} "
        "interleaved runs (shared machine: absolute times noisy)"
    )
    print("| what | C | L | torch | reference loop | plain loop | ratio vs reference | ratio vs plain loop |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        plain = f"{r['plain_loop_s'] * 1e3:.2f} ms" if "plain_loop_s" in r else "—"
        vs_plain = f"{r['ratio_vs_plain_loop']:.3f}" if "ratio_vs_plain_loop" in r else "—"
        print(
            f"| {r['what']} | {r['C']} | {r['L']} | {r['s'] * 1e3:.2f} ms | {r['reference_s'] * 1e3:.2f} ms | "
            f"{plain} | {r['ratio_vs_reference']:.3f} | {vs_plain} |"
        )
    write_result(
        {
            "rows": rows,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
            "note": "shared machine: absolute times are noisy",
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "linear_recurrence.json")


if __name__ == "__main__":
    main()
