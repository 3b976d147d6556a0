"""Small helpers shared by the scripts in ``benchmarks/``: timing, provenance, writing results, a toy retriever."""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import time

import torch

# config kwargs of the 130M-shaped random models the benchmarks use (one definition for every script)
MODEL_130M_KWARGS = {
    # state-spaces/mamba-130m-hf shapes: D = 1536, N = 16, 24 layers
    "mamba": dict(vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=24, expand=2, conv_kernel=4),
    # mamba2-130m shapes: H = 24 heads of P = 64, N = 128, 24 layers
    "mamba2": dict(
        vocab_size=50280,
        hidden_size=768,
        state_size=128,
        num_hidden_layers=24,
        expand=2,
        num_heads=24,
        head_dim=64,
        n_groups=1,
        chunk_size=256,
    ),
}


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
        return (
            subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def write_result(result: dict, path) -> None:
    """Write a benchmark's JSON atomically (a crash leaves the previous file) and say where."""
    from .state.files import atomic_write

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    atomic_write(path, json.dumps(result, indent=2).encode())
    print(f"\nwrote {path}")


class BagOfWords:
    """Hashed word counts (64 buckets): a deterministic, instant retriever, so that store benchmarks time the
    library rather than an embedding model; a zero-argument factory too (what ``encode_corpus`` takes)."""

    name = "benchmark-bag-of-words"

    def __call__(self, texts):
        out = torch.full((len(texts), 64), 1e-3)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                out[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % 64] += 1
        return out
