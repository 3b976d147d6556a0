"""Small helpers shared by the scripts in ``benchmarks/``: timing, provenance, writing results."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import time

import torch


def _sync(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, repeats: int, device=None, warmup: int = 0) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones (CUDA synced)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_result(result: dict, path) -> None:
    """Write a benchmark's JSON atomically (a crash leaves the previous file) and say where."""
    from .state.files import atomic_write

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(result, indent=2).encode())
    print(f"\nwrote {path}")
