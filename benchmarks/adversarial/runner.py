"""The driver of the adversarial trial: the families in order, the cases, the table, the JSON, the CLI."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings

import torch

from . import (
    api,
    attention_kwarg,
    cli,
    files,
    fingerprint,
    lance_errors,
    memory,
    positions,
    ray_args,
    registry,
    round5,
    small,
    store,
)
from .cli import cli_setup
from .common import CASE_TIMEOUT, OUTCOMES, ROOT, Context, classify_exception, run_forked
from .store import run_store_case

# the families, in the order their cases are drawn from the seed (a new family goes last: the ids of the cases
# before it stay as they were). Each is a module with CATEGORY (one letter, the case ids' prefix), NAME (for
# --family), TITLE, RUNNERS (case kind -> runner(ctx, params) -> outcome) and generate(rng, scale, backends).
FAMILIES = [files, memory, api, store, cli, ray_args]
# issue 29: the extension points (registry, key positions, fingerprint, Lance errors, attention=, small ones)
FAMILIES += [registry, positions, fingerprint, lance_errors, attention_kwarg, small]
FAMILIES += [round5]  # the fifth independent trial's findings (issue 41)
CATEGORIES = {family.CATEGORY: family.TITLE for family in FAMILIES}
FAMILY_NAMES = {family.NAME: family.CATEGORY for family in FAMILIES}
RUNNERS = {kind: runner for family in FAMILIES for kind, runner in family.RUNNERS.items()}
# kinds that start Ray, build a model, trace with dynamo or open a Lance store in each case
SLOW_KINDS = ("ray", "fingerprint", "lance_errors", "positions", "attention_kwarg", "small", "round5")
IN_PARENT = ("store", "cli")  # these fork their own children (writers, kills, CLI)


def generate_cases(seed: int, scale: str, backends) -> list[dict]:
    rng = random.Random(seed)
    raw = [case for family in FAMILIES for case in family.generate(rng, scale, backends)]
    cases = []
    for n, (category, kind, params) in enumerate(raw):
        label = params.get("arch") or params.get("backend") or kind
        variant = f"/{params['variant']}" if "variant" in params else ""
        cases.append(
            {
                "id": f"{category}{n:04d}",
                "category": category,
                "kind": kind,
                "name": f"{label}:{params['mutation']}{variant}",
                "params": params,
            }
        )
    return cases


def run_case(ctx, case, quiet=True) -> dict:
    params = dict(case["params"], _kind=case["kind"])
    kind = case["kind"]
    started = time.monotonic()
    if kind == "cli":
        result = run_forked(lambda: RUNNERS["cli"](ctx, params), 200, quiet=quiet)
    elif kind == "store":
        timeout = 180 if params["mutation"].startswith(("kill", "concurrent", "forged", "symlink")) else 90
        result = run_forked(lambda: run_store_case(ctx, params), timeout, quiet=quiet)
    else:
        timeout = 120 if kind in SLOW_KINDS else CASE_TIMEOUT
        result = run_forked(lambda: RUNNERS[kind](ctx, params), timeout, quiet=quiet)
    result["seconds"] = round(time.monotonic() - started, 3)
    return result


def table(results, cases) -> dict:
    out = {}
    for category in [c for c in CATEGORIES if any(case["category"] == c for case in cases)] + ["total"]:
        row = dict.fromkeys(OUTCOMES, 0)
        for case, result in zip(cases, results):
            if category == "total" or case["category"] == category:
                row[result["outcome"]] += 1
        row["cases"] = sum(row[o] for o in OUTCOMES)
        out[category] = row
    return out


def format_table(summary) -> str:
    head = f"{'category':<26}" + "".join(f"{o:>9}" for o in OUTCOMES) + f"{'cases':>8}"
    lines = [head, "-" * len(head)]
    for category, row in summary.items():
        label = f"{category} {CATEGORIES[category]}" if category in CATEGORIES else "total"
        lines.append(f"{label:<26}" + "".join(f"{row[o]:>9}" for o in OUTCOMES) + f"{row['cases']:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(sys.modules[__package__].__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", choices=("full", "ci"), default="full")
    parser.add_argument(
        "--json",
        default=None,
        help="where to write the report (default: benchmarks/results/adversarial.json; with --family or "
        "--categories, adversarial-<families>.json beside it, so a partial run never replaces the full report)",
    )
    parser.add_argument(
        "--case", default=None, help="run one case id in this process and print its outcome and traceback"
    )
    parser.add_argument("--backends", default="folder,lance", help="store backends (default: folder,lance)")
    parser.add_argument("--categories", default=None, help="category letters to run, e.g. 'ab' (default: all)")
    parser.add_argument(
        "--family",
        default=None,
        help=f"families to run, by name, comma separated (default: all): {', '.join(FAMILY_NAMES)}",
    )
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(
        1
    )  # one thread: forking after torch's thread pool started would be unsafe, and cases are tiny
    warnings.filterwarnings("ignore")
    backends = tuple(b for b in args.backends.split(",") if b)
    cases = generate_cases(args.seed, args.scale, backends)
    chosen = set(args.categories) if args.categories else set(CATEGORIES)
    if args.family:
        names = [n for n in args.family.split(",") if n]
        unknown = [n for n in names if n not in FAMILY_NAMES]
        if unknown:
            parser.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILY_NAMES)}")
        chosen &= {FAMILY_NAMES[n] for n in names}
    partial = chosen != set(CATEGORIES)
    if args.json is None:
        suffix = "-" + "-".join(f.NAME for f in FAMILIES if f.CATEGORY in chosen) if partial else ""
        args.json = os.path.join(ROOT, "benchmarks", "results", f"adversarial{suffix}.json")
    cases = [c for c in cases if c["category"] in chosen]
    if args.case:
        cases = [c for c in cases if c["id"] == args.case]
        if not cases:
            parser.error(f"no case {args.case!r} at --seed {args.seed} --scale {args.scale}")
    started = time.time()
    workdir = tempfile.mkdtemp(prefix="hsc-adversarial-")
    try:
        ctx = Context(workdir, args.seed)
        if any(c["category"] == "d" for c in cases):
            ctx.build_base_stores(backends)
        if any(c["category"] == "e" for c in cases):
            cli_setup(ctx)
        setup_seconds = time.time() - started
        if args.case:
            case = cases[0]
            print(json.dumps(case, default=str))
            params = dict(case["params"], _kind=case["kind"])
            runner = RUNNERS[case["kind"]]
            try:
                print(json.dumps(runner(ctx, params), default=str))
            except BaseException as error:  # noqa: BLE001
                traceback.print_exc()
                print(json.dumps(classify_exception(error)))
            return 0
        results = []
        for case in cases:
            results.append(run_case(ctx, case))
            if results[-1]["outcome"] not in ("clear", "handled"):
                print(
                    f"  {case['id']} {case['name']}: {results[-1]['outcome']}: {results[-1]['detail'][:200]}",
                    flush=True,
                )
        summary = table(results, cases)
        elapsed = time.time() - started
        print(format_table(summary))
        print(
            f"{len(cases)} cases, seed {args.seed}, scale {args.scale}, backends {','.join(backends)}: {elapsed:.0f} s "
            f"(setup {setup_seconds:.0f} s)"
        )
        backend_flag = "" if backends == ("folder", "lance") else f" --backends {','.join(backends)}"
        report = {
            "seed": args.seed,
            "scale": args.scale,
            "backends": list(backends),
            "families": [f.NAME for f in FAMILIES if f.CATEGORY in chosen],
            "cases": len(cases),
            "seconds": round(elapsed, 1),
            "setup_seconds": round(setup_seconds, 1),
            "torch": torch.__version__,
            "table": summary,
            "non_clean": [
                {
                    "id": c["id"],
                    "category": c["category"],
                    "case": c["name"],
                    "outcome": r["outcome"],
                    "detail": r["detail"],
                    "repro": f"python benchmarks/adversarial.py --seed {args.seed} --scale {args.scale}{backend_flag} "
                    f"--case {c['id']}",
                }
                for c, r in zip(cases, results)
                if r["outcome"] not in ("clear", "handled")
            ],
            "by_case": [
                {"id": c["id"], "case": c["name"], "outcome": r["outcome"], "seconds": r["seconds"]}
                for c, r in zip(cases, results)
            ],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1, default=str)
        print(f"wrote {args.json}")
        if args.plot:
            from _plot import plot_docs

            plot_docs(args.json, "adversarial.json")
        return 0
    finally:
        for root, dirs, _ in os.walk(
            workdir
        ):  # the read-only cases left read-only folders (a non-root user cannot remove them)
            for name in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(root, name), 0o755)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
