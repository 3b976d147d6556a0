"""COFFEE mixer: the parallel forward (Newton / DEER, one diagonal linear recurrence per iteration) vs the
sequential loop, L = 256 … 16,384, with the Newton iteration counts.

    python benchmarks/coffee_parallel.py [--repeats 3] [--device cpu] [--threads 1] [--lengths ...]

For each length: ``hsc.CoffeeMixer(D, n)`` (D = 16, n = 8 as the paper's IH model; ``--hidden`` for more
features), batch 1, weights either at their initialisation or "trained" (the few Adam steps the tests use, which
move λ and w_D away from the init), inputs N(0, 1). Timed, interleaved (so load swings on a shared machine hit
every candidate alike): forward without autograd, and forward + backward (the parallel path's backward is one
adjoint recurrence; the sequential path's is autograd through the loop). Before timing, the parallel output is
checked against the sequential float64 loop (relative error reported; > 1e-4 stops the script). Ratios are
parallel / sequential in the same run (< 1: parallel faster). Writes benchmarks/results/coffee_parallel.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent

import argparse
import copy
import statistics

import torch

import hf_statecompose as hsc
from hf_statecompose.benchmarking import git_commit, median_time, write_result


def trained(mixer, steps=5):
    """A few Adam steps on a toy target (running mean of the input): weights away from the init."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(mixer.parameters(), lr=0.1)
    for _ in range(steps):
        u = torch.randn(4, 32, mixer.hidden_size, generator=g)
        target = u.cumsum(1) / torch.arange(1, 33, dtype=u.dtype)[:, None]
        loss = (mixer(u, method="sequential") - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    mixer.zero_grad()
    return mixer


def forward_only(mixer, u, method):
    def run():
        with torch.no_grad():
            mixer(u, method=method)

    return run


def forward_backward(mixer, u, method):
    def run():
        x = u.detach().requires_grad_(True)
        y = mixer(x, method=method)
        torch.autograd.grad(y.square().sum(), [x, *mixer.parameters()])

    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--state", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument(
        "--backward-max-length", type=int, default=16384, help="time forward+backward only up to this length"
    )
    parser.add_argument(
        "--window", type=int, default=None, help="CoffeeMixer.newton_window (default: the class's, 1024)"
    )
    parser.add_argument("--out", default=str(HERE / "results" / "coffee_parallel.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = {
        "init": hsc.CoffeeMixer(args.hidden, args.state),
        "trained": trained(hsc.CoffeeMixer(args.hidden, args.state)),
    }
    if args.window is not None:
        for mixer in weights.values():
            mixer.newton_window = args.window
    window = weights["init"].newton_window
    rows = []
    for label, mixer in weights.items():
        mixer = mixer.to(args.device)
        mixer64 = copy.deepcopy(mixer).double()
        for length in args.lengths:
            u = torch.randn(1, length, args.hidden, generator=torch.Generator().manual_seed(length)).to(args.device)
            with torch.no_grad():
                y = mixer(u, method="parallel")
                info = mixer.last_solve
                truth = mixer64(u.double(), method="sequential")
                loop32 = mixer(u, method="sequential")
            error = float((y.double() - truth).abs().max() / truth.abs().max())
            loop_error = float((loop32.double() - truth).abs().max() / truth.abs().max())
            if error > 1e-4 or info.method != "parallel":
                raise SystemExit(
                    f"parallel forward is off ({error:.2e}, {info}) at L={length} ({label}): fix it "
                    "(tests/test_coffee_mixer.py) before timing it"
                )
            fns = [forward_only(mixer, u, "parallel"), forward_only(mixer, u, "sequential")]
            with_backward = length <= args.backward_max_length
            if with_backward:
                fns += [forward_backward(mixer, u, "parallel"), forward_backward(mixer, u, "sequential")]
            times = [[] for _ in fns]
            for _ in range(args.repeats):
                for fn, bucket in zip(fns, times):
                    bucket.append(median_time(fn, 1, args.device))
            t = [statistics.median(x) for x in times]
            row = {
                "weights": label,
                "L": length,
                "D": args.hidden,
                "n": args.state,
                "newton_iterations": info.iterations,
                "newton_window": window,
                "windows": info.windows,
                "residual": info.residual,
                "tolerance": info.tolerance,
                "rel_error_vs_fp64_loop": error,
                "fp32_loop_rel_error_vs_fp64_loop": loop_error,
                "forward_parallel_s": t[0],
                "forward_sequential_s": t[1],
                "forward_ratio": t[0] / t[1],
            }
            if with_backward:
                row.update({"fwd_bwd_parallel_s": t[2], "fwd_bwd_sequential_s": t[3], "fwd_bwd_ratio": t[2] / t[3]})
            rows.append(row)
            print(row, flush=True)
    print(
        f"\nCOFFEE mixer D={args.hidden} n={args.state} batch 1, {args.device}, threads={torch.get_num_threads()}, "
        f"Newton window {window}, median of {args.repeats} interleaved runs; ratio = parallel / sequential (same run)"
    )
    print(
        "| weights | L | Newton iterations (windows) | error vs fp64 loop (parallel / fp32 loop) | forward parallel | "
        "forward sequential | ratio | fwd+bwd parallel | fwd+bwd sequential | ratio |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        bwd = (
            (
                f"{r['fwd_bwd_parallel_s'] * 1e3:.1f} ms | {r['fwd_bwd_sequential_s'] * 1e3:.1f} ms | "
                f"{r['fwd_bwd_ratio']:.2f}"
            )
            if "fwd_bwd_ratio" in r
            else "— | — | —"
        )
        print(
            f"| {r['weights']} | {r['L']} | {r['newton_iterations']} ({r['windows']}) | {r['rel_error_vs_fp64_loop']:.1e} / "
            f"{r['fp32_loop_rel_error_vs_fp64_loop']:.1e} | {r['forward_parallel_s'] * 1e3:.1f} ms | "
            f"{r['forward_sequential_s'] * 1e3:.1f} ms | {r['forward_ratio']:.2f} | {bwd} |"
        )
    write_result(
        {
            "rows": rows,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
            "note": "shared machine: absolute times are noisy; ratios are same-run",
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "coffee_parallel.json")


if __name__ == "__main__":
    main()
