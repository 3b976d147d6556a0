"""Redraw every figure under ``docs/img/`` from the committed JSON in ``benchmarks/results/`` (no benchmark reruns).

``python benchmarks/plot_all.py [--results benchmarks/results] [--out docs/img]``; needs matplotlib (the
``recipes`` extra). The drawings live in ``benchmarks/_plot.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> list[Path]:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import _plot

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", type=Path, default=_plot.RESULTS, help="folder of result JSON (default: benchmarks/results)"
    )
    parser.add_argument("--out", type=Path, default=_plot.DOCS_IMG, help="folder for the PNGs (default: docs/img)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    written = _plot.plot_all(args.results, args.out)
    for path in written:
        print(f"{path}  {path.stat().st_size / 1024:.0f} KB")
    print(f"{len(written)} figures in {time.perf_counter() - start:.1f} s")
    return written


if __name__ == "__main__":
    main()
