"""Small C kernels for CPU inference, compiled once per machine with the system C compiler and loaded
with ctypes (shared by ``<op>/native.py``; imports nothing from the op folders).

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


# Branch-free float32 math shared by the kernels, so that loops over it vectorise (no libm calls, no
# -ffast-math). Cephes' expf / logf polynomials: about 1 ulp, like the vectorised ones torch uses.
MATH = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float hsc_as_float(int32_t i) { float f; memcpy(&f, &i, 4); return f; }
static inline int32_t hsc_as_int(float f) { int32_t i; memcpy(&i, &f, 4); return i; }

/* exp(x) = 2^k exp(r), |r| <= ln2 / 2; 2^k applied in two halves so that results down to the
   denormals and up to overflow come out right. */
static inline float hsc_exp(float x) {
    float xc = x < -104.0f ? -104.0f : (x > 89.0f ? 89.0f : x);
    float k = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t ki = (int32_t)k;
    int32_t k1 = ki >> 1, k2 = ki - (ki >> 1);
    return p * hsc_as_float((k1 + 127) << 23) * hsc_as_float((k2 + 127) << 23);
}

/* log(x) for finite x > 0 (normal) */
static inline float hsc_log(float x) {
    int32_t i = hsc_as_int(x);
    float e = (float)(((i >> 23) & 0xff) - 126);
    float m = hsc_as_float((i & 0x007fffff) | 0x3f000000); /* [0.5, 1) */
    int small = m < 0.707106781186547524f;
    e = small ? e - 1.0f : e;
    m = small ? m + m - 1.0f : m - 1.0f;
    float z = m * m;
    float y = 7.0376836292e-2f;
    y = y * m - 1.1514610310e-1f;
    y = y * m + 1.1676998740e-1f;
    y = y * m - 1.2420140846e-1f;
    y = y * m + 1.4249322787e-1f;
    y = y * m - 1.6668057665e-1f;
    y = y * m + 2.0000714765e-1f;
    y = y * m - 2.4999993993e-1f;
    y = y * m + 3.3333331174e-1f;
    y = y * m * z;
    y = y - 2.12194440e-4f * e;
    y = y - 0.5f * z;
    return m + y + 0.693359375f * e;
}

/* softplus as torch computes it (beta 1, threshold 20); log1p(e) = log(1 + e) * e / ((1 + e) - 1)
   keeps full relative accuracy for small e */
static inline float hsc_softplus(float x) {
    float e = hsc_exp(x);
    float u = 1.0f + e;
    float d = u - 1.0f;
    float l = hsc_log(u) * (e / (d == 0.0f ? 1.0f : d));
    l = d == 0.0f ? e : l;
    return x > 20.0f ? x : l;
}

/* x sigmoid(x), with exp(-|x|) so that nothing overflows */
static inline float hsc_silu(float x) {
    float e = hsc_exp(-fabsf(x));
    float s = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
    return x * s;
}
"""


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
