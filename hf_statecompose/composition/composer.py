"""``StateComposer``: merge several context states into one.

Model-free methods (per layer, elementwise on the SSM states, weights from the decays, see
:mod:`.weights`): ``soup``, ``weighted``, ``caso``, ``picaso_s``, ``picaso_r``. Model-based baselines
(re-encode tokens, need ``model=`` and states made by ``encode``): ``concat``, ``piconcat_r``.

The list order is the context order (first = oldest) for the order-dependent ``caso`` and ``concat``.
What a method decides here (whether it re-encodes, its default conv policy, how its ΣΔ is composed) is its
entry in the registry :mod:`hf_statecompose.ops.compose.methods`, read by both composition paths below.

Conv windows (the last K inputs of the short causal conv) are not states of the SSM, so they are
composed by a policy:

* ``"last"``: the last state's window. For ``caso`` this is exact: after a concatenation the conv
  window is the last context's window. Default for ``caso``.
* ``"mean"``: the uniform mean. PICASO-S / PICASO-R average CASO over orders in which every context is
  last equally often, so averaging the window over the same orders gives the mean. Default for
  ``soup``, ``picaso_s`` and ``picaso_r``.
* ``"weighted"``: the user's weights, the same ones the states get. Default for ``weighted``.

The composed ΣΔ is the total over contexts for the order-based methods (the decay of a concatenation
is order-independent) and the weighted mean for ``soup`` / ``weighted`` (a convex combination).

Per architecture (:mod:`hf_statecompose.state.architectures`): Mamba-1 decays are per element, Mamba-2
per head; SeRpEnt-Mamba states are one Mamba-1 state per (layer, branch), composed per element with each
branch's decay. What a state carries beyond its SSM states, conv windows and ΣΔ is set by the composed
cache's :meth:`~hf_statecompose.state.cache.ComposableMambaCache.finish_composition` hook: the token counts for
Mamba / Mamba-2; for SeRpEnt the resampling state (clock and grid phase, neighbour window with its times,
last ȳ) of the **last** state in the list (the context nearest the query in concatenation order), for every
model-free method (one state composes to itself, so n = 1 stays exact). ``concat`` gets it from the
re-encoding (exact); ``piconcat_r`` from its list-order concatenation, the rotation that ends with the
last state.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from operator import attrgetter

import torch

from ..models import encode
from ..ops.backends import check_backend_name, compose_ssm_layers, resolve
from ..ops.compose import methods as _methods
from ..ops.compose import native as compose_native
from ..ops.delta_rule import MAX_ALL_ORDERS, compose_in_order, mean_over_orders, mean_over_rotations
from ..state.architectures import architecture, has_transitions
from ..state.cache import ComposableMambaCache
from ..state.fingerprint import model_fingerprint
from ..state.validation import check_against_model, check_compatible, check_finite, check_state_once
from .attention import ATTENTION_POLICIES, compose_attention

# the built-in methods' names, from the registry (hf_statecompose.ops.compose.methods, which the composer reads
# for everything a method decides: the ΣΔ rule, the default conv policy, whether it re-encodes)
MODEL_FREE_METHODS = tuple(name for name in _methods.BUILTIN_METHODS if _methods.METHODS[name].model_free)
MODEL_BASED_METHODS = tuple(name for name in _methods.BUILTIN_METHODS if _methods.METHODS[name].reencodes)
METHODS = _methods.BUILTIN_METHODS
CONV_POLICIES = _methods.CONV_POLICIES


class StateComposer:
    """Compose states with ``method`` (see module docstring).

    Args:
        method (`str`, *optional*, defaults to `"picaso_r"`): one of ``METHODS``.
        conv (`str`, *optional*): conv-window policy, ``"mean"``, ``"last"`` or ``"weighted"``; defaults
            per method (see module docstring). Ignored by the model-based methods, which compute the
            window by running the model.
        weights (`Sequence[float]`, *optional*): for ``method="weighted"`` (and ``conv="weighted"``):
            one non-negative weight per state, summing to 1.
        backend (`str`, *optional*, defaults to `"auto"`): kernels of the model-free methods: ``"torch"``
            (blockwise, differentiable), ``"triton"`` (one fused pass on CUDA, no autograd) or ``"auto"``
            (Triton for CUDA states that need no gradient, else torch). See :mod:`hf_statecompose.ops.backends`.
        attention (`str`, *optional*, defaults to `"concat"`): hybrid models only: how the attention layers'
            keys and values of the states are placed, ``"concat"`` (one after another in list order, RoPE keys
            re-rotated), ``"shared"`` (every context at its own positions, as APE) or ``"none"`` (no keys: the
            attention layers see only the query). See :mod:`hf_statecompose.composition.attention`. The
            model-based methods re-encode, so their keys are the concatenation's.
    """

    def __init__(
        self,
        method: str = "picaso_r",
        conv: str | None = None,
        weights: Sequence[float] | None = None,
        backend: str = "auto",
        attention: str = "concat",
    ):
        check_backend_name(backend)
        if attention not in ATTENTION_POLICIES:
            raise ValueError(f"unknown attention policy {attention!r}; choose one of {', '.join(ATTENTION_POLICIES)}")
        self.attention = attention
        self.backend = backend
        spec = _methods.get(method)
        if conv is not None and conv not in CONV_POLICIES:
            raise ValueError(f"unknown conv policy {conv!r}; choose one of {', '.join(CONV_POLICIES)}")
        if spec.user_weights and weights is None:
            raise ValueError(f"method={method!r} needs weights=[w_1, ..., w_n] (non-negative, summing to 1)")
        if weights is not None and not spec.user_weights and conv != "weighted":
            raise ValueError(f"weights are only used by method='weighted' (or conv='weighted'), not by {method!r}")
        self.method = method
        self.conv = conv if conv is not None else spec.conv
        if self.conv == "weighted" and weights is None:
            raise ValueError("conv='weighted' needs weights=[w_1, ..., w_n] (non-negative, summing to 1)")
        self.weights = None if weights is None else _check_weights_values(weights)

    def __repr__(self):
        extra = f", attention={self.attention!r}" if self.attention != "concat" else ""
        return f"StateComposer(method={self.method!r}, conv={self.conv!r}, backend={self.backend!r}{extra})"

    # ------------------------------------------------------------------------------------------
    def compose(
        self, states: Sequence[ComposableMambaCache], model=None, *, validated: bool = False, where: str = "states"
    ) -> ComposableMambaCache:
        """Compose a non-empty list of states of one model (same batch) into one state (same batch).

        The states are checked: their metadata against each other (one signature comparison per state; the
        full ``check_compatible`` only to word an error), each state's contents as a state file's are
        (:func:`~hf_statecompose.state.validation.check_state_once`: once per state object, again only after
        an edit), and the result for NaN / inf (one pass, one host sync; the native CPU kernel does it while
        composing). ``validated=True`` is for a caller that has just checked each state against ``model`` with
        :func:`~hf_statecompose.state.validation.check_against_model` (which checks the contents too), as
        ``generate(past_states=...)`` does: the states' contents and their fit to ``model`` are then not checked
        again (one verdict per call); their agreement with each other and the result's finiteness still are.
        ``where`` names the states in errors (``where[k]``: the argument the caller was given).

        The composed state owns its tensors for n >= 2 states; one state composes to itself (the result
        shares its tensors).
        """
        return self._compose(states, model, validated, where)

    def _compose(self, states, model, validated: bool, name: str) -> ComposableMambaCache:
        """:meth:`compose`, its errors naming the states ``name[k]`` (the argument the user passed)."""
        if isinstance(states, ComposableMambaCache):
            raise TypeError("compose takes a list of states, not a single state")
        states = list(states) if isinstance(states, (list, tuple)) else states
        gathered = _check_compatible_fast(states, name)
        if not validated:  # else the caller's check_against_model checked them in this call
            for k, state in enumerate(states):
                check_state_once(state, f"{name}[{k}]")
        n = len(states)
        weights = None
        if self.weights is not None:
            if len(self.weights) != n:
                raise ValueError(f"got {len(self.weights)} weights for {n} states; pass one weight per state")
            weights = self.weights
        if _methods.get(self.method).reencodes:
            if model is None:
                raise ValueError(f"method {self.method!r} re-encodes the context tokens: pass model=")
            if not validated:
                _check_states_fit_model(states, model, self.method, name)
            return _concat(states, model) if self.method == "concat" else _piconcat_r(states, model)
        if has_transitions(architecture(states[0].architecture)):
            _check_delta_rule_method(self.method, states)
        elif _methods.get(self.method).weights == _methods.METHODS["picaso_s"].weights:  # picaso_s or an alias
            _check_picaso_s_cost(states)
        if n == 1:  # one state composes to itself, exactly (tensors shared; checked finite above)
            composed = states[0].shallow_copy()
            if self.attention == "none":
                compose_attention(composed, states, self.attention, model)
            return composed
        composed, finite = _compose_model_free(states, self.method, self.conv, weights, self.backend, gathered)
        if not finite:  # None (not known: the torch / Triton paths) or False
            _check_finite_once(composed, states, name)
        compose_attention(composed, states, self.attention, model)
        return composed


# PICASO-S costs n·⌈n/2⌉ terms per weight (one per state and Gauss–Legendre node; weights: one per SSM
# state element for Mamba-1, one per head for Mamba-2). Above this many terms in all (about half a minute
# on a 2-core CPU with the native kernel, e.g. n ≈ 400 states of a Mamba-1 130M) compose refuses, naming
# the alternatives; raise it (hf_statecompose.composition.composer.PICASO_S_MAX_TERMS) to wait instead.
PICASO_S_MAX_TERMS = 5 * 10**10


def _check_picaso_s_cost(states):
    first, n = states[0], len(states)
    per_element = architecture(first.architecture).per_element_decay  # a weight per state element, or per head
    per_state = sum(
        d.numel() * (ssm.shape[-1] if per_element else 1) for d, ssm in zip(first.delta_sums, first.layer_tensors()[0])
    )
    terms = n * math.ceil(n / 2) * per_state
    if terms > PICASO_S_MAX_TERMS:
        raise ValueError(
            f"picaso_s over {n} states of this model needs {terms:.2g} multiply-adds (n·⌈n/2⌉ per weight, "
            f"{per_state} weights per state), more than PICASO_S_MAX_TERMS = {PICASO_S_MAX_TERMS:.2g}: use "
            "method='picaso_r' (the average over the n rotations, O(n)), compose fewer states (retrieve the "
            "top-k), or raise hf_statecompose.composition.composer.PICASO_S_MAX_TERMS to wait for it"
        )


def _signature(state):
    """Everything ``check_compatible`` compares, read straight from the layers (the per-layer views
    and the per-tensor checks cost more than composing a small state)."""
    ssm, conv, _ = state.layer_tensors()
    layers = tuple(
        (s.shape, s.dtype, s.device, c.shape, c.dtype, c.device)
        for s, c in zip(ssm, conv)
        if s is not None and c is not None
    )
    return len(state.state_layers), state.model_dtype, state.fingerprint, layers


_shape, _dtype, _is_cpu = attrgetter("shape"), attrgetter("dtype"), attrgetter("is_cpu")


class _Gathered:
    """Every state's per-layer tensors, state-major (``ssm[k * layers + i]``: state k, layer i), for states
    whose SSM states (every state, every layer) share one shape and dtype and are all on the CPU, and
    likewise the conv windows: then the states agree in all that ``check_compatible`` compares per layer."""

    __slots__ = ("conv", "conv_dtype", "conv_shape", "delta", "ssm", "ssm_dtype", "ssm_shape")

    def __init__(self, ssm, conv, delta, ssm_shape, conv_shape, ssm_dtype, conv_dtype):
        self.ssm, self.conv, self.delta = ssm, conv, delta
        self.ssm_shape, self.conv_shape, self.ssm_dtype, self.conv_dtype = ssm_shape, conv_shape, ssm_dtype, conv_dtype


def _gather_uniform(states, first):
    """A :class:`_Gathered` for CPU states of one model (layer count, model dtype, fingerprint) with
    one shape and dtype of SSM states and of conv windows throughout, else None (the caller then compares
    per layer). One pass of a few attribute reads per tensor."""
    ssm, conv, delta = [], [], []
    nl, model_dtype, fingerprint = len(first.state_layers), first.model_dtype, first.fingerprint
    for state in states:
        if len(state.state_layers) != nl or state.model_dtype != model_dtype or state.fingerprint != fingerprint:
            return None
        s, c, d = state.layer_tensors()
        ssm += s
        conv += c
        delta += d
    try:
        shapes = set(map(_shape, ssm))
        conv_shapes = set(map(_shape, conv))
        dtypes = set(map(_dtype, ssm))
        conv_dtypes = set(map(_dtype, conv))
        on_cpu = all(map(_is_cpu, ssm)) and all(map(_is_cpu, conv))
    except AttributeError:  # a layer without its tensors
        return None
    if len(shapes) != 1 or len(conv_shapes) != 1 or len(dtypes) != 1 or len(conv_dtypes) != 1 or not on_cpu:
        return None
    return _Gathered(ssm, conv, delta, shapes.pop(), conv_shapes.pop(), dtypes.pop(), conv_dtypes.pop())


def _check_compatible_fast(states, name: str = "states"):
    """``check_compatible`` in one pass when all is well; on any difference (or an odd input) the full
    check runs and raises its precise message. Returns the :class:`_Gathered` tensors when the states
    are uniform CPU states (what the native kernel can take), else None."""
    if (
        isinstance(states, list)
        and states
        and all(isinstance(s, ComposableMambaCache) for s in states)
        and states[0].state_layers
        and all(layer.filled for layer in states[0].state_layers)
        and all(type(s) is type(states[0]) for s in states)
    ):
        gathered = _gather_uniform(states, states[0])
        if gathered is not None:
            return gathered
        first = _signature(states[0])
        if len(first[3]) == first[0] and all(_signature(s) == first for s in states[1:]):
            return None
    check_compatible(states, where=name)
    return None


def _check_states_fit_model(states, model, method, name: str = "states"):
    """The model-based methods run ``model`` over the states' tokens: a state of another model (other
    architecture, config or weights) would silently give the other model's state, so refuse it."""
    fingerprint = model_fingerprint(model)
    for k, state in enumerate(states):
        check_against_model(state, model, fingerprint, f"{name}[{k}] (method {method!r})")


_WEIGHTS_HELP = (
    "pass weights as a list (or 1-D tensor) of n non-negative real numbers summing to 1, e.g. [0.5, 0.3, 0.2]"
)


def _check_weights_values(weights) -> torch.Tensor:
    """The user's weights as a float64 tensor [n]; anything but n real numbers is refused by name
    (a bool, a str, a dict, a 2-D table or complex numbers would otherwise be silently coerced)."""
    if torch.is_tensor(weights) or (hasattr(weights, "__array__") and not isinstance(weights, (list, tuple))):
        w = torch.as_tensor(weights)
        if w.dtype == torch.bool or w.is_complex() or not (w.is_floating_point() or w.dtype in _INT_DTYPES):
            raise TypeError(f"weights must hold real numbers, got a tensor of {w.dtype}; {_WEIGHTS_HELP}")
        if w.dim() != 1:
            raise ValueError(f"weights must be 1-D (one weight per state), got shape {tuple(w.shape)}; {_WEIGHTS_HELP}")
        w = w.to(torch.float64)  # keeps the autograd graph of a weight tensor that requires grad
    elif isinstance(weights, (list, tuple)):
        for k, value in enumerate(weights):
            if torch.is_tensor(value) and value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"weights[{k}] is {value!r} ({type(value).__name__}), not a real number; {_WEIGHTS_HELP}"
                )
        w = (
            torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in weights])
            if weights
            else torch.zeros(0, dtype=torch.float64)
        )
    else:
        raise TypeError(
            f"weights must be a list, tuple or 1-D tensor of numbers, got {type(weights).__name__}; {_WEIGHTS_HELP}"
        )
    if w.numel() == 0:
        raise ValueError("weights is empty: pass one non-negative weight per state")
    values = w.detach()
    if not torch.isfinite(values).all():
        raise ValueError("weights contain NaN or inf")
    if (values < 0).any():
        raise ValueError(f"weights must be non-negative, got {values.tolist()}")
    if abs(float(values.sum()) - 1.0) > 1e-6:
        raise ValueError(f"weights must sum to 1 (got {float(values.sum()):.6g}); normalise them, e.g. w / w.sum()")
    return w


_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def compose_model_free(
    states, method: str, conv: str, weights: torch.Tensor | None = None, backend: str = "auto"
) -> ComposableMambaCache:
    """The model-free methods on already validated states: per layer, x = Σ_k W_k ⊙ x_k (fused, see
    :mod:`hf_statecompose.ops.compose`: the weights are computed from the decays block by block, in
    registers by the Triton kernel, or per row by the native CPU kernel, never as a tensor the size of
    all states)."""
    gathered = _gather_uniform(states, states[0]) if states[0].state_layers else None
    return _compose_model_free(states, method, conv, weights, backend, gathered)[0]


def _compose_model_free(states, method, conv, weights, backend, gathered=None):
    """(composed state, whether it is known to be finite: True / False, or None when not checked)."""
    if has_transitions(architecture(states[0].architecture)):
        return _compose_delta_rule(states, method, conv, weights), None
    native = _compose_native(states, method, conv, weights, backend, gathered) if gathered is not None else None
    if native is not None:
        return native
    first, spec = states[0], _methods.METHODS[method]
    conv_out, delta_out = [], []
    # the ΣΔ coefficients c_k of Σ_k c_k ΣΔ_k: the registry's rule (CompositionMethod.delta_sum), as the native path
    coefficients = torch.tensor(
        spec.delta_sum_weights(len(states), None if weights is None else weights.detach().tolist()),
        dtype=torch.float64,
    )
    deltas = [torch.stack([s.delta_sums[i] for s in states]) for i in range(first.num_layers)]  # [n, B, D|H] each
    # every layer's SSM states in one call: on the Triton backend one launch for all layers of one shape (per-layer
    # launches from Python cost more than the composition on a GPU), elsewhere compose_ssm layer by layer
    ssm_out = compose_ssm_layers(
        [[s.ssm_states[i] for s in states] for i in range(first.num_layers)],
        deltas,
        list(first.A),
        method,
        weights=weights if spec.user_weights else None,
        backend=backend,
    )
    for i, delta in enumerate(deltas):
        conv_out.append(_compose_conv([s.conv_states[i] for s in states], conv, weights))
        delta_out.append((coefficients.to(delta).view(-1, *[1] * (delta.dim() - 1)) * delta).sum(0))
    out = first.filled_like(ssm_out, conv_out, delta_out)
    out.finish_composition(states)
    return out, None


# ------------------------------------------------------------------------------ delta-rule layers
# A delta-rule context (gated DeltaNet, Kimi delta attention) maps a state S to M S + S_C, with M its transition (a matrix per value head):
# composing contexts composes these affine maps (hf_statecompose.ops.delta_rule). Each method keeps its meaning:
# caso the list order, picaso_r the mean over the n cyclic orders, picaso_s the mean over all n! orders (exactly, by
# the recursion over subsets: 2^n intermediate maps), soup / weighted the weighted mean of the maps (its state is
# the weighted mean of the states, as for Mamba layers; its transition the weighted mean of the transitions).
_ORDER_RULES = {"caso": compose_in_order, "picaso_r": mean_over_rotations, "picaso_s": mean_over_orders}


def _delta_rule_rule(method: str):
    """The order rule (a function of stacked states and transitions) of ``method`` for delta-rule layers, or None for
    a method with one scalar weight per state (soup, weighted and their kind)."""
    spec = _methods.get(method)
    if spec.fixed_weights is not None:
        return None
    for name, rule in _ORDER_RULES.items():
        if method == name or spec.weights == _methods.METHODS[name].weights:
            return rule
    raise ValueError(
        f"method {method!r} weighs the states by their scalar decays, which do not describe a delta-rule layer (its "
        "transition is a matrix that does not commute with the others'); for these states use "
        f"{', '.join(_ORDER_RULES)}, soup, weighted or a method with fixed weights"
    )


# picaso_s over delta-rule states: the exact mean over all n! orders takes n·2^(n−1) products [k, k] @ [k, v + k] per
# layer, batch row and head (ops/delta_rule/compose.py). Above this many multiply-adds in all (about a minute on a
# 2-core CPU: n = 5 at Qwen3-Next's size, 36 layers of 32 heads of 128 x 128) compose refuses, naming picaso_r; raise
# it (hf_statecompose.composition.composer.DELTA_PICASO_S_MAX_MULTIPLY_ADDS) to wait instead. MAX_ALL_ORDERS (12)
# bounds n whatever the size. Memory: the recursion keeps two sizes of subsets' maps at a time, at most
# C(n, ⌊n/2⌋) + C(n, ⌊n/2⌋ + 1) maps of a layer's size (one layer at a time), measured: n = 9 at 32 heads of
# 128 x 128 (4 MiB maps) peaked 1.06 GB above the inputs, 270 maps, where the stacked products of issue 35 took 3.74 GB
# (958 maps, growing as about 2^n).
DELTA_PICASO_S_MAX_MULTIPLY_ADDS = 5 * 10**11


def _check_delta_rule_method(method: str, states) -> None:
    rule, n = _delta_rule_rule(method), len(states)
    if rule is not mean_over_orders:
        return
    advice = "use method='picaso_r' (the mean over the n cyclic orders, 3n products) or compose fewer states"
    if n > MAX_ALL_ORDERS:
        raise ValueError(
            f"picaso_s over {n} delta-rule states needs the mean over all {n}! orders: the exact recursion keeps "
            f"up to C({n}, {n // 2}) + C({n}, {n // 2 + 1}) intermediate maps per layer and takes n·2^(n−1) products (at most "
            f"{MAX_ALL_ORDERS} states); {advice}"
        )
    per_product = sum(
        s.numel() // s.shape[-1] * s.shape[-2] * (s.shape[-1] + s.shape[-2]) for s in states[0].ssm_states
    )
    cost = n * 2 ** (n - 1) * per_product
    if cost > DELTA_PICASO_S_MAX_MULTIPLY_ADDS:
        raise ValueError(
            f"picaso_s over {n} delta-rule states of this model needs {cost:.2g} multiply-adds (n·2^(n−1) products "
            f"per layer and head), more than DELTA_PICASO_S_MAX_MULTIPLY_ADDS = {DELTA_PICASO_S_MAX_MULTIPLY_ADDS:.2g}; "
            f"{advice}, or raise hf_statecompose.composition.composer.DELTA_PICASO_S_MAX_MULTIPLY_ADDS to wait for it"
        )


def _compose_delta_rule(states, method: str, conv: str, weights) -> ComposableMambaCache:
    """Every delta-rule layer's state and transition by the method's rule, the conv windows by the policy, ΣΔ by the
    method's rule (the total for the order-based methods, the weighted mean for soup / weighted)."""
    first, spec, n = states[0], _methods.METHODS[method], len(states)
    rule = _delta_rule_rule(method)
    # (every state carries its transitions: the state checks refuse one without)
    user = None if weights is None else weights.detach().tolist()
    w = None if rule is not None else torch.tensor(spec.state_weights(n, user))
    coefficients = torch.tensor(spec.delta_sum_weights(n, user), dtype=torch.float64)
    ssm_out, conv_out, delta_out, transitions_out = [], [], [], []
    for i in range(first.num_layers):
        stacked = torch.stack([s.ssm_states[i] for s in states])  # [n, B, H, k, v]
        transitions = torch.stack([s.transitions[i] for s in states])  # [n, B, H, k, k]
        if rule is not None:
            state, transition = rule(stacked, transitions)
        else:
            assert w is not None
            scale = w.to(stacked).view(-1, *[1] * (stacked.dim() - 1))
            state, transition = (scale * stacked).sum(0), (scale * transitions).sum(0)
        ssm_out.append(state)
        transitions_out.append(transition)
        conv_out.append(_compose_conv([s.conv_states[i] for s in states], conv, weights))
        delta = torch.stack([s.delta_sums[i] for s in states])
        delta_out.append((coefficients.to(delta).view(-1, *[1] * (delta.dim() - 1)) * delta).sum(0))
    out = first.filled_like(ssm_out, conv_out, delta_out)
    out.transitions = transitions_out
    out.finish_composition(states)
    return out


_contiguous, _requires_grad = torch.Tensor.is_contiguous, attrgetter("requires_grad")


def _compose_native(states, method, conv, weights, backend, gathered):
    """All layers' SSM states, conv windows and ΣΔ in one call of the native CPU kernel (one read of each
    input, no per-layer Python work, finiteness checked in the same pass), or None when it does not apply
    (not float32, not contiguous, autograd, other shapes per layer, no C compiler): the caller takes the
    per-layer path. ``gathered``: the states' tensors from :func:`_gather_uniform` (one shape and dtype
    of SSM states and of conv windows, all on the CPU)."""
    first = states[0]
    if (
        gathered.ssm_dtype != torch.float32
        or gathered.conv_dtype != torch.float32
        or not compose_native.enabled()
        or resolve(backend, first.device, "compose_ssm") != "torch"
    ):
        return None
    n, nl, mamba1 = len(states), len(first.state_layers), architecture(first.architecture).per_element_decay
    ssm, convs, deltas, A = gathered.ssm, gathered.conv, gathered.delta, [layer.A for layer in first.state_layers]
    shape = gathered.ssm_shape
    rows = shape[:2]
    try:  # ΣΔ [B, R] float32 on the CPU; A [R, N] (Mamba-1) or [R] (Mamba-2), float32, on the CPU
        if (
            set(map(_shape, deltas)) != {rows}
            or set(map(_dtype, deltas)) != {torch.float32}
            or not all(map(_is_cpu, deltas))
            or len(shape) != (3 if mamba1 else 4)
            or set(map(_shape, A)) != {shape[1:3] if mamba1 else shape[1:2]}
            or set(map(_dtype, A)) != {torch.float32}
            or not all(map(_is_cpu, A))
        ):
            return None
    except (AttributeError, TypeError):  # a missing ΣΔ or A
        return None
    if not (
        all(map(_contiguous, ssm))
        and all(map(_contiguous, convs))
        and all(map(_contiguous, deltas))
        and all(map(_contiguous, A))
    ):
        return None
    if torch.is_grad_enabled() and (
        any(map(_requires_grad, ssm))
        or any(map(_requires_grad, convs))
        or any(map(_requires_grad, deltas))
        or any(map(_requires_grad, A))
        or (torch.is_tensor(weights) and weights.requires_grad)
    ):
        return None
    w = None if weights is None else weights.tolist()
    uniform = [1.0 / n] * n
    if conv == "last":  # one-hot weights: an exact copy of the last window, and NaN anywhere still shows
        conv_w = [0.0] * (n - 1) + [1.0]
    else:
        conv_w = w if conv == "weighted" else uniform
    spec = _methods.METHODS[method]
    # one scalar per state (soup, weighted) or the decay-weighted group; the ΣΔ by the method's rule
    ssm_w = spec.state_weights(n, w) if spec.fixed_weights is not None else None
    delta_w = spec.delta_sum_weights(n, w)
    done = compose_native.compose_native(
        nl,
        n,
        [(ssm, ssm_w), (convs, conv_w), (deltas, delta_w)],
        method=method,
        delta=deltas,
        A=A,
        per_element=mamba1,
    )
    if done is None:
        return None
    (ssm_out, conv_out, delta_out), finite = done
    out = first.filled_like(ssm_out, conv_out, delta_out)
    out.finish_composition(states)
    return out, finite


def _check_finite_once(composed, states, name: str = "states"):
    """NaN / inf in any input reaches the composed state (NaN·0 and inf·0 are NaN), so one pass over the
    output finds every bad input. The per-layer flags are gathered into one tensor and read once, so the
    check costs one pass and one host sync whatever the number of layers; only on failure are the inputs
    searched, to name the culprit."""
    flags = []
    for i in range(composed.num_layers):
        for t in (composed.ssm_states[i], composed.conv_states[i], composed.delta_sums[i]):
            flags.append(torch.isfinite(t).all())
    if bool(torch.stack(flags).all()):
        return
    for k, state in enumerate(states):
        check_finite(state, f"{name}[{k}]")
    bad = next(i for i in range(composed.num_layers) if not all(bool(f) for f in flags[3 * i : 3 * i + 3]))
    raise ValueError(
        f"composing gave NaN or inf in layer {bad} although every input is finite; "
        "the states' values are so close to the dtype's largest number that their weighted sum overflows; "
        "the states are likely corrupted: re-encode the contexts"
    )


def _compose_conv(windows, policy: str, weights):
    stacked = torch.stack(windows)  # [n, B, C, K]
    if policy == "last":
        return windows[-1].clone()
    if policy == "mean":
        return stacked.to(torch.promote_types(stacked.dtype, torch.float32)).mean(0).to(stacked.dtype)
    w = weights.to(torch.float64 if stacked.dtype == torch.float64 else torch.float32).to(stacked.device)
    return (w.view(-1, 1, 1, 1) * stacked.to(w.dtype)).sum(0).to(stacked.dtype)


# ------------------------------------------------------------------------------ model-based baselines
def _left_pad(sequences, pad_id: int = 0):
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for r, seq in enumerate(sequences):
        ids[r, width - len(seq) :] = seq.cpu()
        mask[r, width - len(seq) :] = 1
    return ids, mask


def _concat(states, model) -> ComposableMambaCache:
    """Re-encode the concatenated tokens (list order) of each row: the exact, expensive baseline."""
    rows = []
    for b in range(states[0].batch_size):
        rows.append(torch.cat([s.context_tokens(b) for s in states]))
    ids, mask = _left_pad(rows)
    # the mask always goes along: a context's real pad-id tokens are not padding (encode refuses those without one)
    return encode(model, ids, attention_mask=mask)


def _piconcat_r(states, model) -> ComposableMambaCache:
    """Mean state of the concatenations in all n cyclic orders, all rows and rotations in one batch."""
    n = len(states)
    batch = states[0].batch_size
    sequences = []
    for b in range(batch):
        tokens = [s.context_tokens(b) for s in states]
        for k in range(n):
            sequences.append(torch.cat(tokens[k:] + tokens[:k]))
    ids, mask = _left_pad(sequences)
    encoded = encode(model, ids, attention_mask=mask)

    def mean_rows(t):
        return t.view(batch, n, *t.shape[1:]).float().mean(1).to(t.dtype)

    ssm, conv, delta = encoded.layer_tensors()
    out = encoded.filled_like(map(mean_rows, ssm), map(mean_rows, conv), map(mean_rows, delta), A=encoded.A)
    if has_transitions(architecture(encoded.architecture)):
        # a delta-rule layer: the mean map's transition, the mean of the rotations' transitions (as picaso_r's)
        out.transitions = [mean_rows(t) for t in encoded.transitions]
    # the token counts and what else the state carries (SeRpEnt's resampling state; a hybrid's keys and values):
    # from the list-order concatenation of each row (every rotation has the same number of tokens)
    in_order = encoded.select(list(range(0, batch * n, n)))
    out.finish_composition([in_order])
    for target, source in zip(getattr(out, "attention_layers", ()), getattr(in_order, "attention_layers", ())):
        target.fill_keys(source.keys, source.values, source.positions)
    return out


def compose_states(states, method: str = "picaso_r", model=None, **kwargs) -> ComposableMambaCache:
    """Functional shortcut: ``StateComposer(method, **kwargs).compose(states, model=model)``."""
    return StateComposer(method, **kwargs).compose(states, model=model)
