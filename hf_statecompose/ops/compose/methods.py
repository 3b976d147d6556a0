"""The composition methods, one entry each: the single place that says what a method is.

Everything that depends on the method reads :data:`METHODS`: the weights (``weights.py``), the argument
checks and the reference / torch / native / Triton dispatch of ``ops/compose`` (the kernel id the C ``enum``
and the Triton ``METHOD`` constexpr switch on), the composer (the model-based methods, the composed ΣΔ, the
default conv policy), the CLI's ``--composition`` choices and lm-eval's ``composition=``. Adding a method is
one :class:`CompositionMethod` here (or :func:`register` at run time) plus its kernels: a method without a
``kernel_id`` runs on the reference weights through the torch path (the native and Triton kernels are skipped).

This module imports no torch (the CLI loads it from its file before parsing its arguments): weight functions
are named ``"module:function"`` and imported on first use (:meth:`CompositionMethod.weight_function`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# How a per-state scalar is chosen (the states' weights of ``soup`` / ``weighted``, and the composed ΣΔ):
# "uniform" 1/n each, "user" the user's weights, "total" 1 each (the ΣΔ of a concatenation: the sum)
RULES = ("uniform", "user", "total")
CONV_POLICIES = ("mean", "last", "weighted")


@dataclass(frozen=True)
class CompositionMethod:
    """One composition method.

    Attributes:
        name: the name users pass (``StateComposer(name)``, ``--composition name``).
        summary: one line, for tables and ``--help``.
        weights: the model-free methods' weights as a function ``log_decays [n, *E] -> W [n, *E]``
            (``"module:function"``, imported on first use, or the function itself; the reference path uses it);
            None for the user's weights (``fixed_weights="user"``) and the model-based methods.
        fixed_weights: model-free methods with one scalar weight per state, whatever the decays: ``"uniform"``
            (1/n) or ``"user"`` (the ``weights=`` the user passes); None otherwise.
        delta_sum: how the composed ΣΔ is made from the states' ΣΔ: ``"total"`` (the sum: a concatenation's
            decay), ``"uniform"`` (the mean) or ``"user"`` (the user's weights); None for the model-based
            methods (the re-encoding gives it).
        conv: the default conv-window policy (``"mean"``, ``"last"``, ``"weighted"``); None for the
            model-based methods (the re-encoding computes the window).
        kernel_id: the number the native C kernel's ``enum`` and the Triton kernel's ``METHOD`` constexpr use
            for this method; None for a method without kernels (model-based, or composed by the torch path).
        order_invariant: whether the result is the same for every order of the states (each weight moving
            with its state).
        exact: when the result equals the state of the concatenated contexts.
        reencodes: whether the method runs the model over the contexts' tokens (needs ``model=`` and states
            made by ``encode``).
        cost: the work per composed element, in the number of states n (or tokens, for the model-based).
    """

    name: str
    summary: str
    weights: str | Callable | None = None
    fixed_weights: str | None = None
    delta_sum: str | None = None
    conv: str | None = None
    kernel_id: int | None = None
    order_invariant: bool = False
    exact: str = "n = 1"
    reencodes: bool = False
    cost: str = "O(n)"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a composition method's name must be an identifier, got {self.name!r}")
        if self.reencodes:
            if self.weights is not None or self.fixed_weights is not None or self.kernel_id is not None:
                raise ValueError(f"method {self.name!r} re-encodes: it has no weights and no kernel_id")
            return
        if self.fixed_weights not in (None, "uniform", "user"):
            raise ValueError(f"fixed_weights must be 'uniform', 'user' or None, got {self.fixed_weights!r}")
        if (self.weights is None) != (self.fixed_weights == "user"):
            raise ValueError(
                f"method {self.name!r}: a model-free method needs weights= (a function of the log decays), "
                "except with fixed_weights='user' (the user's weights), which has none"
            )
        if self.delta_sum not in RULES:
            raise ValueError(f"delta_sum must be one of {', '.join(RULES)}, got {self.delta_sum!r}")
        if self.conv not in CONV_POLICIES:
            raise ValueError(f"conv must be one of {', '.join(CONV_POLICIES)}, got {self.conv!r}")

    @property
    def model_free(self) -> bool:
        """Whether the method composes the states alone (elementwise, per layer), without the model."""
        return not self.reencodes

    @property
    def decay_based(self) -> bool:
        """Whether the weights depend on the states' decays (``weights``), rather than one scalar per state."""
        return self.model_free and self.fixed_weights is None

    @property
    def user_weights(self) -> bool:
        """Whether the method needs ``weights=`` (one per state, non-negative, summing to 1)."""
        return self.fixed_weights == "user"

    def weight_function(self) -> Callable:
        """The function ``log_decays [n, *E] -> W [n, *E]`` (imported on first use)."""
        if self.weights is None:
            raise ValueError(f"method {self.name!r} has no weight function of the decays")
        if callable(self.weights):
            return self.weights
        module, _, attribute = self.weights.partition(":")
        return getattr(importlib.import_module(module), attribute)

    def state_weights(self, n: int, weights: Sequence[float] | None = None) -> list[float]:
        """The n per-state weights of a method with ``fixed_weights`` (``weights``: the user's)."""
        if self.fixed_weights is None:
            raise ValueError(f"method {self.name!r} has no per-state weights (its weights depend on the decays)")
        return rule_weights(self.fixed_weights, n, weights)

    def delta_sum_weights(self, n: int, weights: Sequence[float] | None = None) -> list[float]:
        """The n coefficients of the composed ΣΔ, ``Σ_k c_k ΣΔ_k`` (``weights``: the user's)."""
        if self.delta_sum is None:
            raise ValueError(f"method {self.name!r} re-encodes: its ΣΔ comes from the model")
        return rule_weights(self.delta_sum, n, weights)


def rule_weights(rule: str, n: int, weights: Sequence[float] | None = None) -> list[float]:
    """The n scalars of ``rule`` (see :data:`RULES`)."""
    if rule == "total":
        return [1.0] * n
    if rule == "uniform":
        return [1.0 / n] * n
    if rule == "user":
        if weights is None:
            raise ValueError("this method needs weights=[w_1, ..., w_n] (non-negative, summing to 1)")
        return [float(w) for w in weights]
    raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")


_W = "hf_statecompose.ops.compose.weights:"

METHODS: dict[str, CompositionMethod] = {
    m.name: m
    for m in (
        CompositionMethod(
            name="soup",
            summary="the mean of the states",
            weights=_W + "soup_weights",
            fixed_weights="uniform",
            delta_sum="uniform",
            conv="mean",
            kernel_id=0,
            order_invariant=True,
            exact="n = 1",
            cost="O(n)",
        ),
        CompositionMethod(
            name="weighted",
            summary="Σ w_k x_k with the user's weights (w_k ≥ 0, Σ w_k = 1; pass weights=)",
            fixed_weights="user",
            delta_sum="user",
            conv="weighted",
            kernel_id=1,
            order_invariant=True,
            exact="n = 1",
            cost="O(n)",
        ),
        CompositionMethod(
            name="caso",
            summary="decay-weighted in list order (first = oldest): the state of the concatenation",
            weights=_W + "caso_weights",
            delta_sum="total",
            conv="last",
            kernel_id=2,
            order_invariant=False,
            exact="one SSM layer without conv leakage (the concatenation in list order)",
            cost="O(n)",
        ),
        CompositionMethod(
            name="picaso_s",
            summary="the mean of CASO over all n! orders",
            weights=_W + "picaso_s_weights",
            delta_sum="total",
            conv="mean",
            kernel_id=3,
            order_invariant=True,
            exact="n = 1",
            cost="O(n²)",
        ),
        CompositionMethod(
            name="picaso_r",
            summary="the mean of CASO over the n cyclic rotations (invariant to rotating the list)",
            weights=_W + "picaso_r_weights",
            delta_sum="total",
            conv="mean",
            kernel_id=4,
            order_invariant=False,
            exact="n = 1",
            cost="O(n)",
        ),
        CompositionMethod(
            name="concat",
            summary="re-encode the concatenated tokens in list order (the baseline; pass model=)",
            reencodes=True,
            order_invariant=False,
            exact="always (by definition)",
            cost="O(tokens)",
        ),
        CompositionMethod(
            name="piconcat_r",
            summary="the mean state of the concatenations in the n cyclic orders, one batch (pass model=)",
            reencodes=True,
            order_invariant=False,
            exact="n = 1",
            cost="O(n · tokens)",
        ),
    )
}
"""Every composition method by name, in the documented order (the built-in ones; :func:`register` adds more)."""

BUILTIN_METHODS = tuple(METHODS)


def get(name) -> CompositionMethod:
    """The method called ``name``; a ``ValueError`` naming the choices for anything else."""
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise ValueError(f"unknown composition method {name!r}; choose one of {', '.join(METHODS)}")
    return method


def get_model_free(name) -> CompositionMethod:
    """:func:`get` for the kernels: a model-based name is refused, naming the model-free choices."""
    method = METHODS.get(name) if isinstance(name, str) else None
    if method is None or not method.model_free:
        raise ValueError(f"unknown composition method {name!r}; choose one of {', '.join(model_free_names())}")
    return method


def names() -> tuple[str, ...]:
    """Every method's name, in registry order."""
    return tuple(METHODS)


def model_free_names() -> tuple[str, ...]:
    return tuple(name for name, m in METHODS.items() if m.model_free)


def model_based_names() -> tuple[str, ...]:
    return tuple(name for name, m in METHODS.items() if m.reencodes)


def register(method: CompositionMethod) -> CompositionMethod:
    """Add ``method`` (its name must be new). Returns it. The kernels only run methods with a ``kernel_id``;
    the others are composed by the torch path from their ``weights``."""
    if not isinstance(method, CompositionMethod):
        raise TypeError(f"register takes a CompositionMethod, got {type(method).__name__}")
    if method.reencodes:
        raise ValueError(
            f"{method.name!r} re-encodes: the model-based methods (concat, piconcat_r) are built into the composer"
        )
    if method.name in METHODS:
        raise ValueError(f"a composition method {method.name!r} exists already; unregister it first")
    taken = {m.kernel_id for m in METHODS.values() if m.kernel_id is not None}
    if method.kernel_id is not None and method.kernel_id in taken:
        raise ValueError(f"kernel_id {method.kernel_id} is taken; the kernels' ids are {sorted(taken)}")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> CompositionMethod:
    """Remove a method added by :func:`register` (the built-in ones stay). Returns it."""
    if name in BUILTIN_METHODS:
        raise ValueError(f"{name!r} is a built-in composition method; only registered methods can be removed")
    if name not in METHODS:
        raise KeyError(f"no registered composition method {name!r}")
    return METHODS.pop(name)


def methods_table() -> str:
    """A markdown table of the methods (name, what, cost, order-invariant, exact when, re-encodes), for the docs."""
    rows = [
        "| method | what | cost | order-invariant | exact when | re-encodes |",
        "|---|---|---|---|---|---|",
    ]
    for m in METHODS.values():
        rows.append(
            f"| `{m.name}` | {m.summary} | {m.cost} | {'yes' if m.order_invariant else 'no'} | {m.exact} | "
            f"{'yes' if m.reencodes else 'no'} |"
        )
    return "\n".join(rows) + "\n"
