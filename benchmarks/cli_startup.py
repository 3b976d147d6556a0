"""Start-up cost of the command line and of ``import hf_statecompose``, each in a fresh interpreter.

    python benchmarks/cli_startup.py [--repeats 5]

Every row is a new ``python`` process (median wall time of ``--repeats`` runs after one warm-up run),
as a ratio against ``python -c "import torch, transformers"`` measured in the same run: the floor that
every CLI call paid while the package imported everything. *all names* touches every public name of
the package, i.e. what ``import hf_statecompose`` cost before it became lazy. The machine may be
shared: absolute times are noisy, ratios less so. Writes benchmarks/results/cli_startup.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import subprocess
import sys
import tempfile

from hf_statecompose.benchmarking import git_commit, median_time, write_result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs per row (median)")
    parser.add_argument("--out", default=str(HERE / "results" / "cli_startup.json"), help="JSON result path")
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        corrupt = Path(tmp) / "corrupt"
        corrupt.mkdir()
        (corrupt / "store.json").write_text("{")
        python = [sys.executable]
        cases = [
            ("import torch, transformers (baseline)", python + ["-c", "import torch, transformers"], 0),
            ("python -c pass (interpreter)", python + ["-c", "pass"], 0),
            ("import hf_statecompose", python + ["-c", "import hf_statecompose"], 0),
            (
                "import hf_statecompose, all names",
                python + ["-c", "import hf_statecompose as h; [getattr(h, n) for n in h.__all__]"],
                0,
            ),
            ("python -m hf_statecompose --help", python + ["-m", "hf_statecompose", "--help"], 0),
            (
                "query ... -k -1 (argument error)",
                python + ["-m", "hf_statecompose", "query", str(corrupt), "q", "-k", "-1"],
                2,
            ),
            ("stats <corrupt store.json>", python + ["-m", "hf_statecompose", "stats", str(corrupt)], 2),
        ]
        rows = []
        for what, command, expected in cases:

            def run():
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != expected:
                    raise SystemExit(f"{what}: exit {done.returncode}, expected {expected}: {done.stderr[-2000:]}")

            rows.append({"what": what, "command": command[1:], "s": median_time(run, args.repeats, warmup=1)})
    baseline = rows[0]["s"]
    for row in rows:
        row["ratio"] = row["s"] / baseline
    print(
        f"fresh interpreter per run, median of {args.repeats} (shared machine: noisy); ratio against `import torch, transformers`"
    )
    print("| what | time | ratio |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['s'] * 1e3:.0f} ms | {r['ratio']:.3f} |")
    write_result(
        {
            "rows": rows,
            "baseline": rows[0]["what"],
            "python": sys.version.split()[0],
            "commit": git_commit(),
            "note": "shared machine: absolute times are noisy",
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "cli_startup.json")


if __name__ == "__main__":
    main()
