"""Shared helpers of the Triton kernels (``<op>/triton_kernel.py``); imports no Triton itself."""

from __future__ import annotations

import importlib
import os

import torch


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1`` set before triton was imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_runnable(*tensors: torch.Tensor | None) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter (tests only: slow)."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type == "cpu" and not interpreting():
            raise RuntimeError(
                "the Triton kernels need CUDA tensors; on CPU use backend='torch' "
                "(or set TRITON_INTERPRET=1 before the kernels are imported, for tests: very slow)"
            )
        if t.device.type not in ("cpu", "cuda"):
            raise RuntimeError(f"the Triton kernels run on CUDA (or the CPU interpreter), got a tensor on {t.device}")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """None when the Triton kernels can run on ``device``, else why not (the one rule every op's
    dispatch uses: ``backends.py`` and the op folders that dispatch themselves)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return "triton is not installed (pip install triton; it ships with CUDA builds of torch)"
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    if device.type == "cpu":
        return "the Triton kernels need CUDA tensors (TRITON_INTERPRET=1 runs them on CPU, for tests only)"
    return f"the Triton kernels do not run on {device.type} tensors"
