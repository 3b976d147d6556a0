"""The composition methods, one entry each: the single place that says what a method is.

Everything that depends on the method reads :data:`METHODS`: the weights (``weights.py``), the argument
checks and the reference / torch / native / Triton dispatch of ``ops/compose`` (the kernel id the C ``enum``
and the Triton ``METHOD`` constexpr switch on), the composer (the model-based methods, the composed ΣΔ, the
default conv policy), the CLI's ``--composition`` choices and lm-eval's ``composition=``. Adding a method is
one :class:`CompositionMethod` here (or :func:`register` at run time) plus its kernels: a method without a
``kernel_id`` runs on its own weights through the torch path (the native and Triton kernels are skipped).

What a method claims is checked, never trusted silently: a :class:`CompositionMethod` refuses fields of the wrong
type or out of their vocabulary when it is made; :func:`register` refuses what can be known before composing (a
weights spec that does not import or is not callable, a ``kernel_id`` no kernel implements or whose kernel
computes other weights, claims its other fields contradict); the output of a registered weight function is
checked on every compose (``weights.method_weights``: shape, floating dtype, finite, the weight rule below);
``tests/test_methods.py`` checks every entry's ``order_invariant`` and ``exact`` claims.

This module imports no torch (the CLI loads it from its file before parsing its arguments): weight functions
are named ``"module:function"`` and imported on first use (:meth:`CompositionMethod.weight_function`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

# How a per-state scalar is chosen (the states' weights of ``soup`` / ``weighted``, and the composed ΣΔ):
# "uniform" 1/n each, "user" the user's weights, "total" 1 each (the ΣΔ of a concatenation: the sum)
RULES = ("uniform", "user", "total")
CONV_POLICIES = ("mean", "last", "weighted")

# The kernels' method ids (the C ``enum`` of ops/csrc/compose_ssm.c and the Triton kernel's ``METHOD_IDS``;
# tests/test_methods.py reads both) and the built-in method whose weights each id computes: a method may carry a
# kernel_id only if its weights are that method's, since the kernels compute the weights themselves.
KERNEL_METHODS = {0: "soup", 1: "weighted", 2: "caso", 3: "picaso_s", 4: "picaso_r"}

# What ``exact`` may claim, weakest first; each claim includes the ones before it. "Exact" means: the composed
# state (every layer's SSM state, conv window and ΣΔ) equals, up to rounding, the state that encoding the
# concatenated contexts in list order gives (what ``concat`` computes).
EXACT_CLAIMS = (
    # one state: composing [s] gives s
    "n = 1",
    # any n, for a model with one SSM layer and a conv window of 1 (no token of a context reaches the SSM
    # input of the next one); the composed SSM state is the fold of the states in list order
    "one SSM layer without conv leakage (the concatenation in list order)",
    # any n, any model (re-encoding the concatenation itself)
    "always (by definition)",
)


@dataclass(frozen=True)
class CompositionMethod:
    """One composition method.

    Attributes:
        name: the name users pass (``StateComposer(name)``, ``--composition name``).
        summary: one line, for tables and ``--help``.
        weights: the model-free methods' weights as a function ``log_decays [n, *E] -> W [n, *E]``
            (``"module:function"``, imported on first use, or the function itself; the reference path uses it);
            None for the user's weights (``fixed_weights="user"``) and the model-based methods. The weights
            ``W`` it returns must have the log decays' shape, a floating dtype, finite values ``≥ 0`` and obey
            the weight rule of ``delta_sum`` (checked on every compose for a registered function, within
            ``weights.weight_tolerance``; the built-in functions are tested against it in
            ``tests/test_weights.py``). With ``a_k = exp(log_decays[k])``:
            ``delta_sum="uniform"`` or ``"user"``, a convex combination: ``Σ_k W_k = 1`` at every element;
            ``delta_sum="total"``, a concatenation (its decay is ``Π_k a_k``) or a mixture of concatenations
            in several orders (CASO, PICASO): ``Π_{j≠k} a_j ≤ W_k ≤ 1`` and ``Σ_k (1 − a_k) W_k = 1 − Π_k a_k``
            (true of the fold ``W_k = Π_{j after k} a_j`` in every order, by telescoping, so of every mean of
            orders; ``Σ_k W_k`` itself then lies between 1 and n). Either way ``W = 1`` for ``n = 1``.
        fixed_weights: model-free methods with one scalar weight per state, whatever the decays: ``"uniform"``
            (1/n; ``weights`` must then be ``soup``'s, ``weights.soup_weights``) or ``"user"`` (the ``weights=``
            the user passes: one per state, ``≥ 0``, summing to 1); None otherwise.
        delta_sum: how the composed ΣΔ is made from the states' ΣΔ: ``"total"`` (the sum: a concatenation's
            decay), ``"uniform"`` (the mean) or ``"user"`` (the user's weights); None for the model-based
            methods (the re-encoding gives it).
        conv: the default conv-window policy (``"mean"``, ``"last"``, ``"weighted"``); None for the
            model-based methods (the re-encoding computes the window).
        kernel_id: the number the native C kernel's ``enum`` and the Triton kernel's ``METHOD`` constexpr use
            for this method (a key of :data:`KERNEL_METHODS`, for a method whose weights are those the kernel
            computes for it); None for a method without kernels (model-based, or composed by the torch path).
        order_invariant: whether the composed state (every layer's SSM state, conv window and ΣΔ) is the same,
            up to rounding, for every order of the states, each user weight moving with its state (a hybrid's
            attention keys are placed by ``attention=``, not by the method). Needs a conv policy other than
            ``"last"``.
        exact: when the composed state equals the state of the concatenated contexts in list order, one of
            :data:`EXACT_CLAIMS`: ``"n = 1"`` (every method), ``"one SSM layer without conv leakage (the
            concatenation in list order)"`` (one SSM layer, conv window 1, any n: needs ``delta_sum="total"``
            and ``conv="last"``) or ``"always (by definition)"`` (a method that re-encodes the concatenation).
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
        for field in ("summary", "cost"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise TypeError(f"method {self.name!r}: {field} must be a non-empty str, got {value!r}")
        for field in ("order_invariant", "reencodes"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"method {self.name!r}: {field} must be True or False, got {getattr(self, field)!r}")
        if self.exact not in EXACT_CLAIMS:
            raise ValueError(
                f"method {self.name!r}: exact must be one of {', '.join(map(repr, EXACT_CLAIMS))} (what each claim "
                f"means: methods.EXACT_CLAIMS; tests check it), got {self.exact!r}"
            )
        if self.kernel_id is not None and (
            isinstance(self.kernel_id, bool)
            or not isinstance(self.kernel_id, int)
            or self.kernel_id not in KERNEL_METHODS
        ):
            raise ValueError(
                f"method {self.name!r}: kernel_id {self.kernel_id!r} is not implemented by a kernel; the kernels "
                f"implement {', '.join(f'{k} ({m})' for k, m in KERNEL_METHODS.items())}, or leave kernel_id=None "
                "to compose on the torch path"
            )
        if self.weights is not None and not callable(self.weights) and not _is_spec(self.weights):
            raise TypeError(
                f"method {self.name!r}: weights must be a function of the log decays or its name "
                f"'module:function', got {self.weights!r}"
            )
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
        if self.order_invariant and self.conv == "last":
            raise ValueError(
                f"method {self.name!r}: order_invariant=True with conv='last' (the last state's window depends on "
                "the order); use conv='mean' or 'weighted', or order_invariant=False"
            )
        if self.exact == EXACT_CLAIMS[2]:
            raise ValueError(
                f"method {self.name!r}: a model-free method is not exact always (deeper layers and conv windows see "
                f"the previous contexts); claim {EXACT_CLAIMS[0]!r} or {EXACT_CLAIMS[1]!r}"
            )
        if self.exact == EXACT_CLAIMS[1] and (self.delta_sum != "total" or self.conv != "last"):
            raise ValueError(
                f"method {self.name!r}: exact={self.exact!r} needs delta_sum='total' and conv='last' (the "
                "concatenation's ΣΔ and conv window)"
            )

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
        try:
            function = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"method {self.name!r}: weights={self.weights!r} does not resolve ({type(error).__name__}: {error})"
            ) from error
        if not callable(function):
            raise TypeError(
                f"method {self.name!r}: weights={self.weights!r} is {type(function).__name__}, not callable"
            )
        return function

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


def _is_spec(weights) -> bool:
    """Whether ``weights`` has the form ``"module:function"`` (a dotted module, one identifier)."""
    if not isinstance(weights, str):
        return False
    module, colon, attribute = weights.partition(":")
    return bool(colon) and attribute.isidentifier() and all(part.isidentifier() for part in module.split("."))


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

_METHODS: dict[str, CompositionMethod] = {
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
METHODS: Mapping[str, CompositionMethod] = MappingProxyType(_METHODS)
"""Every composition method by name, in the documented order (the built-in ones; :func:`register` adds more).
Read-only: :func:`register` and :func:`unregister` are the only ways in and out, so every entry has been checked."""

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
    """Add ``method`` (its name must be new). Returns it.

    Refused here, before any compose: anything but a :class:`CompositionMethod`; a model-based method (they are
    built into the composer); a name in use; weights that do not import or are not callable; ``fixed_weights=
    "uniform"`` with weights other than ``soup``'s; a ``kernel_id`` whose kernel computes other weights than the
    method's (the kernels compute the weights of :data:`KERNEL_METHODS` themselves: an alias of a built-in
    method may share its kernel). A method without ``kernel_id`` is composed by the torch path from its
    ``weights``, whose output is checked on every compose. Imports the weights' module (and so torch)."""
    if not isinstance(method, CompositionMethod):
        raise TypeError(f"register takes a CompositionMethod, got {type(method).__name__}")
    if method.reencodes:
        raise ValueError(
            f"{method.name!r} re-encodes: the model-based methods (concat, piconcat_r) are built into the composer"
        )
    if method.name in METHODS:
        raise ValueError(f"a composition method {method.name!r} exists already; unregister it first")
    function = method.weight_function() if method.weights is not None else None  # refuses a bad spec now
    if method.fixed_weights == "uniform" and function is not METHODS["soup"].weight_function():
        raise ValueError(
            f"method {method.name!r}: fixed_weights='uniform' composes with 1/n; its weights must be soup's "
            f"({METHODS['soup'].weights!r}), got {method.weights!r}"
        )
    if method.kernel_id is not None:
        builtin = METHODS[KERNEL_METHODS[method.kernel_id]]
        same = method.fixed_weights == builtin.fixed_weights and (
            builtin.weights is None or function is builtin.weight_function()
        )
        if not same:
            raise ValueError(
                f"method {method.name!r}: kernel_id {method.kernel_id} computes the weights of {builtin.name!r}, "
                f"not the method's own ({method.weights!r}); the kernels would ignore them. Leave kernel_id=None "
                "(the torch path composes with the method's weights), or use the weights of the kernel's method"
            )
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> CompositionMethod:
    """Remove a method added by :func:`register` (the built-in ones stay). Returns it."""
    if not isinstance(name, str):
        raise TypeError(f"unregister takes a method's name (a str), got {type(name).__name__} {name!r}")
    if name in BUILTIN_METHODS:
        raise ValueError(f"{name!r} is a built-in composition method; only registered methods can be removed")
    if name not in METHODS:
        raise KeyError(f"no registered composition method {name!r}")
    return _METHODS.pop(name)


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
