"""The Triton backend's one place: where the kernels run (:func:`triton_unavailable_reason`), the device checks
of the ``<op>/triton_wrapper.py`` functions, and which kernel module they call (:func:`kernel_module`: the bundled
``hf_statecompose._kernels`` or a Hub / local kernel chosen by :func:`use_kernel`). Imports no Triton itself."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

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


# ------------------------------------------------------------------------------------------ the kernel module
# The Triton kernels are one module, ``hf_statecompose._kernels`` (the source lives in the repository's
# ``kernels/torch-ext/hf_statecompose_kernels``, a Hugging Face kernel; the wheel and an editable install map
# it to that name), or a Hub / local kernel with the same functions, chosen by use_kernel() or HSC_KERNEL.
KERNEL_ENV = "HSC_KERNEL"
KERNEL_FUNCTIONS = ("selective_scan", "ssd_scan", "causal_conv1d", "compose", "linear_recurrence")
_BUNDLED = "hf_statecompose._kernels"
_SOURCE_DIR = Path(__file__).resolve().parents[2] / "kernels" / "torch-ext" / "hf_statecompose_kernels"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[^\s@]+)?$")
_UNSET = object()
_lock = threading.Lock()
_choice: object = _UNSET  # what use_kernel() chose (None: the bundled kernels); _UNSET: read HSC_KERNEL
_module: ModuleType | None = None  # the loaded kernel module, once a Triton op has run


def bundled_kernels() -> ModuleType:
    """The Triton kernels shipped with the package, ``hf_statecompose._kernels``. In a source checkout (the
    repository's ``kernels/`` beside the package: on ``sys.path`` or installed editable) they are loaded from
    ``kernels/torch-ext/hf_statecompose_kernels`` by path under that name, so the checkout's own kernels run
    whatever else is installed; from a wheel they are imported. Imports Triton."""
    module = sys.modules.get(_BUNDLED)
    if module is not None:
        return module
    if not (_SOURCE_DIR / "__init__.py").is_file():
        return importlib.import_module(_BUNDLED)
    with _lock:
        if _BUNDLED in sys.modules:
            return sys.modules[_BUNDLED]
        spec = importlib.util.spec_from_file_location(
            _BUNDLED, _SOURCE_DIR / "__init__.py", submodule_search_locations=[str(_SOURCE_DIR)]
        )
        if spec is None or spec.loader is None:  # not expected: the file exists
            raise ImportError(f"cannot load the bundled kernels from {_SOURCE_DIR}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[_BUNDLED] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(_BUNDLED, None)
            raise
        # as an import would set it
        sys.modules[__package__.rpartition(".")[0]]._kernels = module  # type: ignore[attr-defined]
        return module


def _parse(repo_or_path: str | os.PathLike) -> tuple[str, str, str | None]:
    """("local", path, None) or ("hub", repo_id, revision | None); ValueError for anything else."""
    if not isinstance(repo_or_path, (str, os.PathLike)):
        raise TypeError(f"a kernel is a Hub repo id or a folder, got {type(repo_or_path).__name__}")
    text = os.fspath(repo_or_path)
    if os.path.isdir(os.path.expanduser(text)):
        return "local", os.path.expanduser(text), None
    if _HUB_ID.match(text):
        repo_id, _, revision = text.partition("@")
        return "hub", repo_id, revision or None
    raise ValueError(
        f"kernel {text!r} is neither an existing folder nor a Hub repo id 'org/name[@revision]'; "
        "pass one of those (or None for the bundled kernels)"
    )


def use_kernel(repo_or_path: str | os.PathLike | None = None) -> None:
    """Run the Triton backend with the Hugging Face kernel ``repo_or_path`` instead of the bundled one.

    ``repo_or_path``: a Hub repo id ``"org/name"`` (the kernel's version 1) or ``"org/name@revision"`` (a branch,
    tag or commit), loaded with ``kernels.get_kernel`` (trusting that one repository), or a local kernel folder (a
    kernel repository with a ``build/`` variant, e.g. the one ``python kernels/build_universal.py`` writes), loaded
    with ``kernels.get_local_kernel``; None returns to the bundled kernels. Without a call the environment variable
    ``HSC_KERNEL`` names the kernel.

    The kernel is loaded when a Triton op first runs (on CUDA; on CPU only under ``TRITON_INTERPRET=1``). Where the
    ``kernels`` package is missing (``pip install 'hf_statecompose[hub-kernels]'``), the kernel cannot be loaded or
    lacks one of the functions the ops call, a one-line warning says why and the bundled kernels run.
    """
    global _choice, _module
    if repo_or_path is not None:
        _parse(repo_or_path)  # refuse a malformed name now, not at the first Triton call
    with _lock:
        _choice, _module = repo_or_path, None


def _load(repo_or_path) -> ModuleType:
    """The kernel module named by ``repo_or_path`` through the ``kernels`` package; raises why it cannot."""
    kind, where, revision = _parse(repo_or_path)
    hub_kernels: Any
    try:
        hub_kernels = importlib.import_module("kernels")
    except ImportError:
        hub_kernels = None
    if getattr(hub_kernels, "get_kernel", None) is None:  # (a bare namespace package is some folder named kernels/)
        raise ImportError("the `kernels` package is not installed (pip install 'hf_statecompose[hub-kernels]')")
    if kind == "local":
        module = hub_kernels.get_local_kernel(Path(where))
    elif revision is None:  # the kernel's API version 1 (its branch v1), as build.toml declares
        module = hub_kernels.get_kernel(where, version=1, trust_remote_code=[where])
    else:
        module = hub_kernels.get_kernel(where, revision=revision, trust_remote_code=[where])
    missing = [name for name in KERNEL_FUNCTIONS if not callable(getattr(module, name, None))]
    if missing:
        raise AttributeError(f"it has no {', '.join(missing)}")
    return module


def kernel_module() -> ModuleType:
    """The module whose functions the Triton backend calls: the kernel chosen by :func:`use_kernel` (or
    ``HSC_KERNEL``), loaded once, else (or where it cannot be loaded: a one-line warning) the bundled one."""
    global _module
    module = _module
    if module is not None:
        return module
    choice: Any = _choice if _choice is not _UNSET else (os.environ.get(KERNEL_ENV) or None)  # str | PathLike | None
    if choice is None:
        module = bundled_kernels()
    else:
        try:
            module = _load(choice)
        except Exception as error:  # noqa: BLE001 - any failure to load falls back to the bundled kernels
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            warnings.warn(
                f"hf_statecompose: cannot use the kernel {os.fspath(choice)!r} ({reason}); "
                "running the bundled Triton kernels",
                stacklevel=3,
            )
            module = bundled_kernels()
    with _lock:
        _module = module
    return module
