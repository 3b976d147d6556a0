"""Backend choice for the scans, the conv and the fused composition.

``backend`` is one of:

* ``"torch"``: vectorised torch, runs everywhere, supports autograd. The Mamba-1 scan is fused by
  ``torch.compile`` for inference on long inputs (see ``compiled.py``), else chunked; the SSD scan is
  chunked (matmuls); the conv is one grouped conv; the composition works block by block.
* ``"triton"``: the Triton kernels (``kernels/torch-ext/hf_statecompose_kernels`` in the repository,
  ``hf_statecompose._kernels`` installed, or a Hub kernel: ``_triton.use_kernel``), called through
  ``<op>/triton_wrapper.py``, forward and backward. They need CUDA tensors (or, for tests,
  ``TRITON_INTERPRET=1`` set before they are imported, which runs them slowly on CPU).
* ``"auto"`` (default): ``"triton"`` for CUDA tensors when Triton is importable, ``"torch"`` otherwise.
  The choice is logged once per operation and device type.

An explicitly requested backend that cannot run raises ``RuntimeError`` with the reason; it never
silently falls back.
"""

from __future__ import annotations

import importlib
import logging

import torch

from .. import compat
from ._triton import triton_unavailable_reason
from .compose import native as _compose_native
from .compose.methods import get_model_free
from .compose.vectorized import compose_ssm_torch
from .conv import native as _conv_native
from .conv.vectorized import causal_conv1d as _conv_eager
from .linear_recurrence import linear_recurrence  # noqa: F401  (dispatches itself: backend="auto" | ... )
from .selective_scan import compiled
from .selective_scan import native as _scan_native
from .selective_scan.reference import selective_scan_ref
from .selective_scan.vectorized import selective_scan as _selective_scan_eager
from .ssd import native as _ssd_native
from .ssd.vectorized import ssd_scan as _ssd_eager

logger = logging.getLogger("hf_statecompose")

BACKENDS = ("auto", "torch", "triton")
_TRITON_MODULES = {  # op -> (module beside this file, function); imported only when Triton runs
    "selective_scan": ("selective_scan.triton_wrapper", "selective_scan_triton"),
    "ssd_scan": ("ssd.triton_wrapper", "ssd_scan_triton"),
    "causal_conv1d": ("conv.triton_wrapper", "causal_conv1d_triton"),
    "compose_ssm": ("compose.triton_wrapper", "compose_ssm_triton"),
    "compose_ssm_layers": ("compose.triton_wrapper", "compose_ssm_layers_triton"),
    "linear_recurrence": ("linear_recurrence.triton_wrapper", "linear_recurrence_triton"),
}
_logged: set = set()


def check_backend_name(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return backend


def resolve(backend: str, device: torch.device, op: str) -> str:
    """The concrete backend (``"torch"`` or ``"triton"``) that runs ``op`` on ``device``."""
    check_backend_name(backend)
    if backend == "auto":
        choice = "triton" if device.type == "cuda" and triton_unavailable_reason(device) is None else "torch"
        key = (op, device.type, choice)
        if key not in _logged:
            _logged.add(key)
            logger.info("hf_statecompose: backend='auto' runs %s on %s with %r", op, device.type, choice)
        return choice
    if backend == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"backend='triton' cannot run {op}: {reason}")
    return backend


def _triton_op(op: str):
    module, name = _TRITON_MODULES[op]
    return getattr(importlib.import_module(f".{module}", __package__), name)


def _dispatch(op: str, torch_fn, first_name: str, args, kwargs, backend: str):
    """Run ``op`` on the backend chosen for the device of its first tensor argument."""
    first = args[0] if args else kwargs[first_name]
    if backend == "auto" and compat.is_tracing(first):
        # torch.compile / torch.export: the torch paths trace on every device (as stock Mamba's slow path does);
        # an explicitly requested backend is still honoured or refused
        return torch_fn(*args, **kwargs)
    fn = _triton_op(op) if resolve(backend, first.device, op) == "triton" else torch_fn
    return fn(*args, **kwargs)


def selective_scan(*args, backend: str = "auto", **kwargs):
    """Mamba-1 scan (contract of :func:`hf_statecompose.ops.selective_scan_ref`) on the chosen backend."""
    return _dispatch("selective_scan", selective_scan_torch, "u", args, kwargs, backend)


def selective_scan_torch(
    u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, initial_state=None, mask=None
):
    """The torch backend: the native C kernel for float32 inference (see ``ops/_native.py``), else compiled
    for long inference inputs, else chunked eager (and always with autograd)."""
    args = (u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, mask)
    if compat.is_tracing(u):
        # torch.compile / torch.export trace the plain recurrence (as they trace stock Mamba's slow path): no
        # ctypes kernel, no nested compile, no preallocated buffers written with out= (which an exported graph
        # run with autograd refuses)
        return selective_scan_ref(*args)
    if _scan_native.applicable(u, delta, A, B, C, initial_state, mask):
        out = _scan_native.selective_scan_native(*args)
        if out is not None:
            return out
    if compiled.applicable(u, A, initial_state, u.shape[-1]):
        try:
            return compiled.selective_scan_compiled(*args)
        except compiled._CompileFailed:
            pass
    return _selective_scan_eager(*args)


def ssd_scan(*args, backend: str = "auto", **kwargs):
    """Mamba-2 chunked SSD scan (contract of :func:`hf_statecompose.ops.ssd_scan_ref`)."""
    return _dispatch("ssd_scan", ssd_scan_torch, "x", args, kwargs, backend)


def ssd_scan_torch(
    x,
    dt,
    A,
    B,
    C,
    D=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=None,
    initial_state=None,
    mask=None,
    chunk_size: int = 64,
):
    """The torch backend: the native C recurrence for float32 inference, else the chunked scan (with autograd)."""
    args = (x, dt, A, B, C, D, dt_bias, dt_softplus, dt_limit, initial_state, mask)
    if _ssd_native.applicable(x, dt, A, B, C, initial_state, mask):
        out = _ssd_native.ssd_scan_native(*args)
        if out is not None:
            return out
    return _ssd_eager(*args, chunk_size=chunk_size)


def gated_rms_norm(norm, hidden_states, gate, backend: str = "auto"):
    """Mamba-2's gated RMS norm ``norm(hidden_states, gate)``: one native pass for CPU float32 inference
    (not under backend='triton'), else the module itself."""
    if backend != "triton" and hidden_states.device.type == "cpu":
        out = _ssd_native.gated_rms_norm_native(norm, hidden_states, gate)
        if out is not None:
            return out
    return norm(hidden_states, gate)


def causal_conv1d(*args, backend: str = "auto", **kwargs):
    """Causal depthwise conv continuing a window (contract of :func:`hf_statecompose.ops.causal_conv1d_ref`)."""
    return _dispatch("causal_conv1d", causal_conv1d_torch, "x", args, kwargs, backend)


def causal_conv1d_torch(x, weight, bias=None, conv_state=None, mask=None, activation=None):
    """The torch backend: the native C kernel for float32 inference, else one grouped conv (with autograd)."""
    if _conv_native.applicable(x, weight, bias, conv_state, mask, activation):
        out = _conv_native.causal_conv1d_native(x, weight, bias, conv_state, mask, activation)
        if out is not None:
            return out
    return _conv_eager(x, weight, bias, conv_state, mask, activation)


def compose_ssm(ssm_states, delta_sums, A, method, weights=None, backend: str = "auto"):
    """Σ_k W_k ⊙ x_k with the weights of ``method`` computed from the decays, reading each state once."""
    device = ssm_states[0].device
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (*ssm_states, delta_sums, A) if torch.is_tensor(t)
    )
    choice = resolve(backend, device, "compose_ssm")
    if choice == "triton" and needs_grad:
        if backend == "triton":
            raise RuntimeError("backend='triton' composes without autograd; use backend='torch' to backpropagate")
        choice = "torch"
    if choice == "triton" and get_model_free(method).kernel_id is None:  # a registered method without kernels
        if backend == "triton":
            raise ValueError(f"method {method!r} has no Triton kernel (no kernel_id); use backend='torch'")
        choice = "torch"
    if choice == "triton":
        return _triton_op("compose_ssm")(ssm_states, delta_sums, A, method, weights=weights)
    # CPU inference on float32: the native C loop nest (one read of each state, see compose/native.py);
    # the blockwise torch path for autograd, other dtypes or without a C compiler
    if not needs_grad and _compose_native.applicable(ssm_states, delta_sums, A, weights):
        out = _compose_native.compose_ssm_native(ssm_states, delta_sums, A, method, weights=weights)
        if out is not None:
            return out
    return compose_ssm_torch(ssm_states, delta_sums, A, method, weights=weights)


def compose_ssm_layers(layer_states, delta_sums, A, method, weights=None, backend: str = "auto"):
    """:func:`compose_ssm` of L layers (``layer_states``: L lists of n states; ``delta_sums``, ``A``: L tensors):
    on the Triton backend one launch for all layers of one shape (``compose.triton_wrapper``: per-layer launches
    from Python cost more than the composition itself on a GPU), elsewhere :func:`compose_ssm` layer by layer.
    Contract of ``compose_ssm_layers_ref``."""
    device = layer_states[0][0].device
    needs_grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (*(s for states in layer_states for s in states), *delta_sums, *A)
    )
    choice = resolve(backend, device, "compose_ssm")
    if choice == "triton" and not needs_grad and get_model_free(method).kernel_id is not None:
        return _triton_op("compose_ssm_layers")(layer_states, delta_sums, A, method, weights=weights)
    return [
        compose_ssm(states, d, a, method, weights=weights, backend=backend)
        for states, d, a in zip(layer_states, delta_sums, A, strict=True)
    ]
