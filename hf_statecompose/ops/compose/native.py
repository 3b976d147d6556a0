"""Fused composition x = Σ_k W_k ⊙ x_k as one C loop nest (CPU inference, float32), built by ``ops/_native.py``.

Why: on a CPU the eager torch path costs several passes per state (the weights are formed, then each
state is multiplied in), one Python-dispatched op each, and ``exp`` of very negative log decays (long
contexts) falls into the slow denormal path; the composition is then 5–50× its memory floor (reading the
n states once). Here one call composes a whole state: the SSM states of every layer with the method's
weights, and any number of "flat" groups (the conv windows, ΣΔ; the SSM states too for ``soup`` /
``weighted``) as weighted sums with one weight per input. Rows run on torch's OpenMP threads, each group
split evenly between them with no barrier in between. Denormals are flushed to zero inside the kernel
(x86): a decay product below float32's smallest normal number (1.2e-38) contributes less than rounding
anyway, and denormal arithmetic is ~100× slower.

Mamba-1 (a weight per state element): every piece of V = 16 elements of a channel reads each state's row
once and forms its weights on the fly from ``a_k = exp(A ⊙ ΣΔ_k)`` (``exp_decay``: ``hsc_exp``'s
polynomial with one power-of-two scale, enough for log decays), without a weight buffer where it can:
CASO is the fold in context order, ``acc = a_k · acc + x_k`` (n - 1 exps per element, no buffer);
PICASO-R computes the n decays once, the weight of the last state from their prefix products, then folds
backwards ``S_k = (1 - Π a) + a_{k+1} S_{k+1}``, ``acc += S_k x_k``; PICASO-S forms its weights (``O(n·G)``
multiply-adds per element, G Gauss–Legendre nodes) in a small buffer first. Mamba-2 (one weight per head):
a first pass computes every row's weights, V heads at a time, then each row is a weighted sum.

The weights are those of :mod:`.weights`, same formulas and same stability (no division by a decay, no
overflowing product, ``-inf`` log decays are decays of 0); PICASO-S uses prefix and suffix products of the
``f_i = 1 - t + t a_i`` per Gauss–Legendre node instead of dividing the full product by ``f_k``.

Same contract as :func:`.vectorized.compose_ssm_torch` for float32 states, ΣΔ and ``A`` (others are
converted), contiguous states, no autograd. :func:`compose_ssm_native` returns None when the kernel cannot
be built (no C compiler); the caller then uses the torch path. :func:`compose_native` is the many-layer,
many-group entry the composer uses; :func:`exp_floor` times the minimum arithmetic of the decay-based
methods (one multiply and one exp per state element and state), for the benchmarks.
"""

from __future__ import annotations

import ctypes
import math
from array import array

import torch

from ... import compat
from .. import _native
from .methods import KERNEL_METHODS, METHODS
from .reference import _check_inputs
from .weights import _gauss_legendre_01

NAME = "compose_ssm"
SOURCE = _native.read_source(NAME)  # csrc/<NAME>.c

_PICASO_S = next(k for k, name in KERNEL_METHODS.items() if name == "picaso_s")  # its kernel takes the nodes

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _library():
    lib = _native.load(NAME, SOURCE)
    if lib is not None and not getattr(lib, "_hsc_typed", False):
        lib.hsc_compose.restype = _I
        lib.hsc_compose.argtypes = [_L, _L, _I, _P, _P, _P, _P, _L, _L, _L, _I, _P, _P, _L, _L, _P, _P, _P, _P, _I]
        lib.hsc_exp_floor.restype = ctypes.c_float
        lib.hsc_exp_floor.argtypes = [_L, _L, _P, _P, _L, _L, _L, _I, _I]
        lib._hsc_typed = True
    return lib


def available() -> bool:
    """Whether the kernel is built (or can be): native kernels on and a C compiler found."""
    return _library() is not None


def enabled() -> bool:
    """Whether native kernels are on (``HF_STATECOMPOSE_NATIVE``); says nothing about the compiler."""
    return _native.enabled()


def applicable(ssm_states, delta_sums, A, weights=None) -> bool:
    """Whether :func:`compose_ssm_native` may run: CPU float32 states, no autograd, native kernels on."""
    if not _native.enabled() or not ssm_states:
        return False
    first = ssm_states[0]
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return False
    tensors = [*ssm_states, delta_sums, A] + ([weights] if torch.is_tensor(weights) else [])
    if compat.is_tracing(first):
        return False  # torch.compile / torch.export: FakeTensors have no data for ctypes to read
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


_data_ptr = torch.Tensor.data_ptr
_NO_FLOATS = array("f", [0.0])


def _address(buffer: array, offset: int = 0) -> int:
    return buffer.buffer_info()[0] + offset * buffer.itemsize


def compose_native(nl, n, groups, method=None, delta=None, A=None, per_element=False):
    """The kernel over ``nl`` layers of ``n`` states in one call.

    ``groups``: a list of ``(inputs, weights)``; ``inputs`` holds the ``n * nl`` float32 contiguous CPU
    tensors of a group state-major (``inputs[k * nl + i]``: state k, layer i), all of one shape; ``weights``
    n floats (the group's output is ``Σ_k weights[k] · input k``), or None for the one group composed with
    the decay-based ``method`` (``caso``, ``picaso_s``, ``picaso_r``): its tensors are ``[B, R, *row]``,
    ``delta`` the ``n * nl`` ΣΔ ``[B, R]`` (state-major; may be another group's inputs), ``A`` the ``nl``
    per-layer A (``[R, M]`` if ``per_element`` (Mamba-1), else ``[R]``). Trusts its caller (no checks: the
    composer validated the states). Returns (per group, its ``nl`` outputs; all finite), or None if the
    kernel cannot be built or ``method`` has no ``kernel_id`` (:mod:`.methods`) while a group needs its weights."""
    decay_group = any(weights is None for _, weights in groups)
    kernel_id = METHODS[method].kernel_id if decay_group else -1
    lib = _library() if kernel_id is not None else None  # a method without a kernel: the caller's torch path
    if lib is None:
        return None
    outputs, inputs, flat_out, numels, flat_w = [], [], [], [], []
    decay_in = decay_out = None
    for tensors, weights in groups:
        outs = [torch.empty_like(tensors[i]) for i in range(nl)]
        outputs.append(outs)
        if weights is None:
            decay_in, decay_out = tensors, outs
        else:
            inputs += tensors
            flat_out += outs
            numels.append(tensors[0].numel())
            flat_w += weights
    nflat = len(numels)
    decay = decay_in is not None and decay_in[0].numel() > 0
    # one table of pointers: flat inputs, flat outputs, then (decay group) inputs, outputs, ΣΔ, A
    tensors = inputs + flat_out
    if decay:
        tensors += decay_in + decay_out
        delta_at = next((j * n * nl for j in range(nflat) if inputs[j * n * nl] is delta[0]), None)
        if delta_at is None:
            delta_at = len(tensors)
            tensors += delta
        tensors += A
    table = array("q", map(_data_ptr, tensors))
    base = table.buffer_info()[0]
    sizes = array("q", numels or [0])
    weights = array("f", flat_w) if flat_w else _NO_FLOATS
    nodes = node_w = _NO_FLOATS
    G = 0
    if decay:
        first = decay_in[0]
        batch, rows, row_elems = first.shape[0], first.shape[1], first[0, 0].numel()
        at = len(inputs) + len(flat_out)
        decay_args = (
            kernel_id,
            base + 8 * at,
            base + 8 * (at + n * nl),
            base + 8 * delta_at,
            base + 8 * (len(tensors) - nl),
            batch,
            rows,
            row_elems,
            int(per_element),
        )
        if kernel_id == _PICASO_S:
            G = math.ceil(n / 2)
            t, w = _gauss_legendre_01(G)
            nodes, node_w = array("f", t.tolist()), array("f", w.tolist())
    else:
        decay_args = (-1, 0, 0, 0, 0, 0, 0, 0, 0)
    status = lib.hsc_compose(
        nl,
        n,
        *decay_args,
        _address(nodes),
        _address(node_w),
        G,
        nflat,
        base,
        base + 8 * len(inputs),
        _address(sizes),
        _address(weights),
        torch.get_num_threads(),
    )
    if status == 2:
        raise MemoryError("the native composition kernel could not allocate its buffers")
    return outputs, status == 0


def exp_floor(delta, A, n, per_element) -> float:
    """Run :c:`hsc_exp_floor` once: ``delta`` the ``n * nl`` ΣΔ (state-major), ``A`` the ``nl`` A; returns
    the sum (for the benchmarks; raises if the kernel cannot be built)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the native composition kernel is not available")
    nl = len(A)
    table = array("q", map(_data_ptr, list(delta) + list(A)))
    base = table.buffer_info()[0]
    first = delta[0]
    row_elems = A[0].shape[-1] if per_element else 1
    return lib.hsc_exp_floor(
        nl,
        n,
        base,
        base + 8 * n * nl,
        first.shape[0],
        first.shape[1],
        row_elems,
        int(per_element),
        torch.get_num_threads(),
    )


@torch.no_grad()
def compose_ssm_native(ssm_states, delta_sums, A, method, weights=None) -> torch.Tensor | None:
    """Same contract as :func:`.vectorized.compose_ssm_torch` (float32, CPU, no autograd); None if the
    kernel cannot be built or ``method`` has none."""
    states, n, mamba1 = _check_inputs(ssm_states, delta_sums, A, method, weights)
    # no copy for the usual contiguous states; the ΣΔ and A conversions are a few KB
    states = [s.contiguous() for s in states]
    spec = METHODS[method]
    if spec.fixed_weights is not None:  # one scalar per state: a plain weighted sum
        w = spec.state_weights(n, weights.to(torch.float32).tolist() if spec.user_weights else None)
        done = compose_native(1, n, [(states, w)])
    else:
        delta = delta_sums.to(torch.float32).contiguous()
        done = compose_native(
            1,
            n,
            [(states, None)],
            method=method,
            delta=list(delta.unbind(0)),
            A=[A.to(torch.float32).contiguous()],
            per_element=mamba1,
        )
    return None if done is None else done[0][0][0]
