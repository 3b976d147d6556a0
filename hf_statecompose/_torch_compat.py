"""The adapter for torch's internals: the one module that calls torch's private API (``torch._...``,
``torch._C...``, private tensor attributes), as :mod:`hf_statecompose.compat` is for transformers.

Each call here says what it falls back to when the installed torch lacks it (``tests/test_torch_compat.py``
removes each in turn and checks that the fallback still works):

* ``torch._lazy_clone`` and ``torch._C._is_cow_tensor`` (the fingerprint cache's copy-on-write sentinel,
  :mod:`hf_statecompose.state.fingerprint`): without either, no storage is made copy-on-write and
  :func:`make_copy_on_write` says False, so the cache checks those weights by their contents (the checksum
  path, as for shared-memory weights) instead: slower checks, nothing missed that the checksum sees;
* ``untyped_storage()._cdata`` and ``Tensor._version`` (a tensor's storage and version counter, read without
  materializing a copy-on-write storage): without them :func:`storage_id` / :func:`version` say None and the
  cache relies on the rest of its check (a copy-on-write storage that is replaced or written is no longer
  copy-on-write; small tensors are compared byte for byte, the others by their contents);
* ``torch._subclasses.FakeTensor`` (a tensor without data, while a graph is traced): without it no tensor is
  taken for a fake one;
* ``OptimizedModule._orig_mod`` (what ``torch.compile(model)`` wraps): :func:`unwrap_compiled`.

Nothing else in the package names torch's privates (``tests/test_torch_compat.py`` scans for them). This module
imports nothing from the package (the lowest layer, ``.importlinter``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch


# ------------------------------------------------------------------------------------------ copy-on-write
def copy_on_write_available() -> bool:
    """Whether this torch can make a storage lazily copy-on-write and tell whether it still is."""
    return callable(getattr(torch, "_lazy_clone", None)) and callable(
        getattr(getattr(torch, "_C", None), "_is_cow_tensor", None)
    )


def is_copy_on_write(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage is (still) lazily copy-on-write; False on a torch without the sentinel."""
    probe = getattr(torch._C, "_is_cow_tensor", None)
    if probe is None:
        return False
    return bool(probe(tensor))


def make_copy_on_write(tensor: torch.Tensor) -> bool:
    """Make ``tensor``'s storage lazily copy-on-write (``torch._lazy_clone``, whose clone is dropped at once: nothing
    is copied, no memory is held). False where the storage cannot be (shared memory, a custom allocator, a tensor
    subclass) or this torch has no copy-on-write: the caller then checks the tensor's contents instead."""
    if not copy_on_write_available():
        return False
    if is_copy_on_write(tensor):
        return True
    try:
        with torch.no_grad():
            torch._lazy_clone(tensor.detach())
        return is_copy_on_write(tensor)
    except (RuntimeError, TypeError, NotImplementedError):  # "Expected storage != nullptr": not copy-on-write-able
        return False


# ------------------------------------------------------------------------------------------ identity
def storage_id(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage object (its C struct): ``p.data = t``, ``.to()`` and ``set_`` change it.
    Unlike ``data_ptr()`` this does not materialize a copy-on-write storage. None on a torch without it."""
    try:
        return tensor.untyped_storage()._cdata
    except AttributeError:
        return None


def version(tensor: torch.Tensor) -> int | None:
    """``tensor``'s version counter: every in-place op on it or a view of it (not through ``.data``); None on a
    torch without it."""
    try:
        return tensor._version
    except AttributeError:
        return None


# ------------------------------------------------------------------------------------------ tracing, compile
def is_fake_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a FakeTensor (a fake-tensor mode traces a graph: no data to read)."""
    subclasses = getattr(torch, "_subclasses", None)
    fake = getattr(subclasses, "FakeTensor", None)
    return fake is not None and isinstance(tensor, fake)


def unwrap_compiled(module: Any) -> Any:
    """The module that ``torch.compile(module)`` wrapped (``OptimizedModule._orig_mod``, nested wrappers too), or
    ``module`` itself. No compiled module exists before ``torch._dynamo`` is imported, so this imports nothing."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    while optimized is not None and isinstance(module, optimized):
        module = module._orig_mod
    return module


def call_eagerly(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run eagerly, not traced, when called while ``torch.compile`` traces a graph (dynamo
    then calls it with the real tensors, as a graph break): for bookkeeping on real weights (the fingerprint
    cache's weak references and byte comparisons cannot be traced, and must not be baked into a graph).
    ``torch._dynamo`` is imported here only while compiling (it is then loaded already)."""
    return torch.compiler.disable(fn, reason="hf_statecompose: bookkeeping on the real weights")(*args, **kwargs)
