"""Small C kernels for CPU inference, compiled once per machine with the system C compiler and loaded
with ctypes (shared by ``<op>/native.py``; imports nothing from the op folders). The C sources are the
package data ``csrc/*.c`` (one per kernel) and ``csrc/statecompose_math.h`` (the math they share).

Why C and not ``torch.compile``: the Mamba scans are sequential in time and elementwise in channels;
inductor unrolls a fixed block of tokens, runs single-threaded and re-enters Python per block, and every
op around the scan (softplus, the skip, the gate, ΣΔ, the conv) is one more pass over ``[T, D]`` in
memory. A plain loop nest over (channel block, token, state) keeps the state in registers / L1, fuses
all of it and runs on torch's OpenMP threads. It needs what ``torch.compile`` on CPU already needs: a C
compiler at run time. No torch headers are included, so a build takes well under a second; the library
is cached under ``$HF_STATECOMPOSE_NATIVE_CACHE`` (default ``~/.cache/hf_statecompose/native``), keyed
by a hash of the source, the flags, the compiler and the CPU. If there is no compiler or the build
fails, a warning is logged once and the callers use their torch paths. ``HF_STATECOMPOSE_NATIVE=0``
turns the native kernels off.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .. import compat

logger = logging.getLogger("hf_statecompose")

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_failed: dict[str, str] = {}


def enabled() -> bool:
    return os.environ.get("HF_STATECOMPOSE_NATIVE", "1") not in ("0", "false", "False")


def _cache_dir() -> Path:
    root = os.environ.get("HF_STATECOMPOSE_NATIVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hf_statecompose" / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    # -march=native binaries must not be shared between different CPUs (a shared home directory)
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            text += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return text


def _build(name: str, source: str) -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc/clang)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    # -ffp-contract=fast: a*b+c as one FMA (rounds once: as accurate or more). No -ffast-math: the
    # kernels' float semantics (order of sums, infinities) stay those of the source.
    base = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math"]
    attempts = [base + ["-march=native", "-fopenmp"], base + ["-fopenmp"], base + ["-march=native"], base]
    errors = []
    for flags in attempts:
        key = hashlib.sha256("\0".join([source, " ".join(flags), version, _cpu_signature()]).encode()).hexdigest()[:20]
        target = _cache_dir() / f"{name}-{key}.so"
        if target.exists():
            try:
                return ctypes.CDLL(str(target))
            except OSError as error:  # a truncated file from a crash: rebuild it
                errors.append(f"{target}: {error}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            out = Path(tmp) / f"{name}.so"
            run = subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"], capture_output=True, text=True)
            if run.returncode != 0:
                errors.append(f"{' '.join(flags)}: {run.stderr.strip()[-500:]}")
                continue
            os.replace(out, target)  # atomic: concurrent builders (test workers) never see half a file
        return ctypes.CDLL(str(target))
    raise RuntimeError("compiling failed: " + " | ".join(errors))


def load(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled library of ``source`` (built on first use), or None when native kernels are off or
    cannot be built (logged once)."""
    if not enabled() or name in _failed:
        return None
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name not in _loaded and name not in _failed:
            try:
                _loaded[name] = _build(name, source)
            except Exception as error:  # no compiler, read-only home, unsupported platform: torch paths
                _failed[name] = repr(error)
                logger.warning(
                    "hf_statecompose: native CPU kernel %r unavailable (%s); using the torch path", name, error
                )
                return None
    return _loaded.get(name)


def failure(name: str) -> str | None:
    """Why ``name`` could not be built (None if it was, or was not tried)."""
    return _failed.get(name)


# The C sources (one .c per kernel and the shared math header) live in csrc/, read at run time.
_CSRC = importlib.resources.files(__package__).joinpath("csrc")
_INCLUDE = '#include "statecompose_math.h"\n'
# Branch-free float32 math shared by the kernels (exp, log, softplus, silu): the header's text, which a kernel
# source (or a test's) can start with.
MATH = _CSRC.joinpath("statecompose_math.h").read_text(encoding="utf-8")


def read_source(name: str) -> str:
    """The C source of kernel ``name``: ``csrc/<name>.c`` (package data), its ``#include "statecompose_math.h"``
    replaced by that header's text, so that the build's cache key (a hash of the source) covers both files."""
    return _CSRC.joinpath(f"{name}.c").read_text(encoding="utf-8").replace(_INCLUDE, MATH + "\n", 1)


def runs_on(name: str, tensors) -> bool:
    """Whether kernel ``name`` may run on ``tensors`` (None entries ignored): CPU float32 inference (no
    autograd), native kernels on, and ``name`` not known to have failed to build."""
    tensors = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if tensors and compat.is_tracing(tensors[0]):
        return False  # torch.compile / torch.export: FakeTensors have no data for ctypes to read
    return enabled() and failure(name) is None
