"""Composition weights W_k, elementwise, computed from log decays (stable for every decay in [0, 1]).

Notation (PICASO, arXiv 2502.17605): context k has state x_k (from a zero start) and decay
a_k = exp(log_a_k) in [0, 1]. A composition is x = Σ_k W_k ⊙ x_k. All functions take
``log_decays`` of shape ``[n, *E]`` (``-inf`` means a decay of exactly 0) and return ``W`` of the same
shape. They are differentiable, never divide by a decay and never form a product that can overflow.
Derivations: ``README.md`` beside this file.
"""

from __future__ import annotations

import functools
import math

import torch

from .methods import BUILTIN_METHODS, METHODS, CompositionMethod


def _check(log_decays: torch.Tensor) -> torch.Tensor:
    if not torch.is_tensor(log_decays) or log_decays.dim() < 1 or log_decays.shape[0] == 0:
        raise ValueError("log_decays must be a tensor [n, ...] with n >= 1")
    if not log_decays.is_floating_point():
        raise TypeError(f"log_decays must be floating point, got {log_decays.dtype}")
    return log_decays


def soup_weights(log_decays: torch.Tensor) -> torch.Tensor:
    """State Soup: W_k = 1/n."""
    _check(log_decays)
    return torch.full_like(log_decays, 1.0 / log_decays.shape[0])


def caso_weights(log_decays: torch.Tensor) -> torch.Tensor:
    """CASO in list order (first = oldest): W_k = Π_{j>k} a_j (PICASO eq. 3), via suffix sums of logs."""
    _check(log_decays)
    # exclusive suffix sum: Σ_{j>k} log a_j
    suffix = torch.cat(
        [torch.flip(torch.cumsum(torch.flip(log_decays[1:], [0]), 0), [0]), torch.zeros_like(log_decays[:1])], 0
    )
    return torch.exp(suffix)


def picaso_r_weights(log_decays: torch.Tensor) -> torch.Tensor:
    """PICASO-R: the mean of CASO over the n cyclic rotations of the list.

    W_k = S_k / n with S_k = Σ_{m=0}^{n-1} Π_{j=1}^{m} a_{k+j} (indices mod n). With P = Π_i a_i,
    S_k = (1 - P) + a_{k+1} S_{k+1}: one S is summed directly, the others follow by walking the cycle
    backwards. Every term is non-negative (no cancellation) and nothing is divided.
    """
    _check(log_decays)
    n = log_decays.shape[0]
    if n == 1:
        return torch.ones_like(log_decays)
    one_minus_p = -torch.expm1(log_decays.sum(0))  # 1 - Π a_i, accurate when Π a_i is close to 1
    decays = torch.exp(log_decays)
    # S_{n-1} = Σ_{m=0}^{n-1} Π_{j=0}^{m-1} a_j: contexts 0..m-1 follow context n-1 in its rotation
    s = 1.0 + torch.cumprod(decays[:-1], 0).sum(0)
    sums = [s] * n  # sums[n - 1] = s; the others are set below
    for k in range(n - 2, -1, -1):
        s = torch.addcmul(one_minus_p, decays[k + 1], s)
        sums[k] = s
    return torch.stack(sums) / n


@functools.cache
def _gauss_legendre_01(nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss–Legendre nodes and weights on (0, 1), float64, by Golub–Welsch."""
    if nodes == 1:
        return torch.tensor([0.5], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    k = torch.arange(1, nodes, dtype=torch.float64)
    off_diagonal = k / torch.sqrt(4 * k * k - 1)
    jacobi = torch.diag(off_diagonal, 1) + torch.diag(off_diagonal, -1)
    eigenvalues, eigenvectors = torch.linalg.eigh(jacobi)
    t = (eigenvalues + 1) / 2
    w = eigenvectors[0] ** 2  # sums to 1: (2 v0^2) on (-1, 1), halved on (0, 1)
    return t, w / w.sum()


def picaso_s_weights(log_decays: torch.Tensor) -> torch.Tensor:
    """PICASO-S: the mean of CASO over all n! orders (PICASO Prop. 2), in O(n²) per element.

    W_k = (1/n) Σ_m e_m(a_{-k}) / C(n-1, m) = ∫_0^1 Π_{i≠k} (1 - t + t a_i) dt, a polynomial of degree
    n-1 in t, integrated exactly with ⌈n/2⌉ Gauss–Legendre nodes. At interior nodes every factor is
    ≥ 1 - t > 0, so the leave-one-out product (Π_i f_i) / f_k never divides by zero; no exp or log
    per node, so the cost is a few multiplications per state element and node.
    """
    _check(log_decays)
    n = log_decays.shape[0]
    if n == 1:
        return torch.ones_like(log_decays)
    t, w = _gauss_legendre_01(math.ceil(n / 2))
    decays = torch.exp(log_decays)
    total = torch.zeros_like(log_decays)
    for t_q, w_q in zip(t.tolist(), w.tolist()):
        # f_i = 1 - t + t a_i >= 1 - t > 0 at interior nodes: the division below never meets a zero.
        # The full product can underflow only when every term it would contribute is below the
        # dtype's tiniest number, while W_k >= 1/n: such a loss is far below rounding.
        f = decays * t_q + (1.0 - t_q)
        total = total + (w_q * torch.prod(f, 0, keepdim=True)) / f
    return total


# the built-in model-free methods and the weight functions of the decay-weighted ones, from the registry (.methods)
MODEL_FREE_METHODS = tuple(name for name in BUILTIN_METHODS if METHODS[name].model_free)

WEIGHT_FUNCTIONS = {name: METHODS[name].weight_function() for name in MODEL_FREE_METHODS if METHODS[name].weights}

# the package's own weight functions: tested against the weight rule (tests/test_weights.py), not re-checked
_BUILTIN_FUNCTIONS = frozenset(WEIGHT_FUNCTIONS.values())


def method_weights(method: CompositionMethod, log_decays: torch.Tensor) -> torch.Tensor:
    """``method``'s weights of ``log_decays`` [n, *E]; a registered weight function's output is checked first
    (:func:`check_weights`), so that a wrong one is an error, not a wrong composed state."""
    function = method.weight_function()
    W = function(log_decays)
    if function not in _BUILTIN_FUNCTIONS:
        check_weights(W, log_decays, method.delta_sum, f"the weight function of method {method.name!r}")
    return W


def weight_tolerance(n: int, dtype: torch.dtype) -> float:
    """How far a weight rule's sum may be off: 64·n ulps of ``dtype`` (float32, n = 10: 7.6e-5), at least 1e-12.
    The built-in weights stay within a tenth of it (tests/test_weights.py); a wrong weight function is off by
    far more (a sum of 0 or 2 is off by 1)."""
    return max(1e-12, 64 * n * torch.finfo(dtype).eps)


def check_weights(W, log_decays: torch.Tensor, rule: str | None, what: str = "the weights") -> None:
    """Refuse weights ``W`` of ``log_decays`` [n, *E] that break the rules of ``CompositionMethod.weights``:
    a floating tensor of the log decays' shape and device, finite, ``≥ 0``, and by ``rule`` (the method's
    ``delta_sum``): ``"uniform"`` / ``"user"``: ``Σ_k W_k = 1``; ``"total"``: ``Π_{j≠k} a_j ≤ W_k ≤ 1`` and
    ``Σ_k (1 − a_k) W_k = 1 − Π_k a_k`` (``a = exp(log_decays)``), each within :func:`weight_tolerance`.
    One host sync when the weights are good; a ``TypeError`` / ``ValueError`` naming the first broken rule
    otherwise."""
    if not torch.is_tensor(W):
        raise TypeError(f"{what} returned {type(W).__name__}, not a tensor of weights")
    if W.shape != log_decays.shape:
        raise ValueError(
            f"{what} returned shape {tuple(W.shape)} for log decays of shape {tuple(log_decays.shape)}: a weight "
            "function returns one weight per state and element, the log decays' shape"
        )
    if not W.is_floating_point():
        raise TypeError(f"{what} returned {W.dtype} weights; weights must be floating point")
    if W.device != log_decays.device:
        raise ValueError(f"{what} returned weights on {W.device}, the log decays are on {log_decays.device}")
    if rule not in ("uniform", "user", "total"):
        raise ValueError(f"{what}: unknown weight rule {rule!r}")
    n = W.shape[0]
    tol = weight_tolerance(n, W.dtype)
    W = W.detach()
    ld = log_decays.detach().to(W.dtype)
    finite = torch.isfinite(W).all()
    negative = W.min()
    if rule == "total":
        one_minus_a = -torch.expm1(ld)
        # Π_{j≠k} a_j from exclusive prefix and suffix sums of the logs (no subtraction: -inf stays -inf)
        zero = torch.zeros_like(ld[:1])
        prefix = torch.cat([zero, torch.cumsum(ld[:-1], 0)], 0)
        suffix = torch.cat([torch.flip(torch.cumsum(torch.flip(ld[1:], [0]), 0), [0]), zero], 0)
        lower = torch.exp(prefix + suffix)
        identity = (one_minus_a * W).sum(0) + torch.expm1(ld.sum(0))  # Σ (1 - a_k) W_k - (1 - Π a_k)
        errors = torch.stack([(W - 1).max(), (lower - W).max(), identity.abs().max()])
    else:
        errors = (W.sum(0) - 1).abs().max().view(1)
    flags = torch.cat([torch.stack([finite.to(W.dtype), negative]), errors]).tolist()  # the one host sync
    if not flags[0]:
        raise ValueError(f"{what} returned NaN or inf weights; weights must be finite")
    if flags[1] < 0:
        raise ValueError(f"{what} returned negative weights (min {flags[1]:.3g}); weights must be ≥ 0")
    if rule != "total":
        if flags[2] > tol:
            raise ValueError(
                f"{what} returned weights whose sum over the states is off 1 by up to {flags[2]:.3g} "
                f"(tolerance {tol:.2g}): with delta_sum={rule!r} the composition is a convex combination, "
                "Σ_k W_k = 1 at every element"
            )
        return
    above, below, off = flags[2:]
    if above > tol:
        raise ValueError(
            f"{what} returned weights above 1 (by up to {above:.3g}): with delta_sum='total' the composition is a "
            "concatenation in some order (or a mean of several), each weight a product of decays, ≤ 1"
        )
    if below > tol:
        raise ValueError(
            f"{what} returned a weight below Π_{{j≠k}} a_j, the product of the other states' decays (by up to "
            f"{below:.3g}): with delta_sum='total' no order of the concatenation decays a state more"
        )
    if off > tol:
        raise ValueError(
            f"{what} returned weights with Σ_k (1 − a_k) W_k off 1 − Π_k a_k by up to {off:.3g} (tolerance "
            f"{tol:.2g}): with delta_sum='total' the composition is a concatenation (or a mean of several orders), "
            "whose weights satisfy it exactly"
        )
