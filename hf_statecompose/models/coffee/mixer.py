"""The COFFEE mixer (Context-Selective State Space Models: Feedback is All You Need, arXiv 2510.14027).

Per feature ``i`` (one input ``u_i(k)`` per feature, state ``x_i(k)`` in R^n), eq. (7) with the gate (5)::

    Δ_i(k) = σ(w_D^i ⊙ x_i(k-1))                                    # state feedback, elementwise
    x_i(k) = (I + A_i diag(Δ_i(k))) x_i(k-1) + Δ_i(k) u_i(k)       # A_i = diag(λ^i)
    y_i(k) = C_i x_i(k)        or, with the output filter of Remark 2,
    y_i(k) = (C_i γ_i(k)) x_i(k),  γ_i(k) = σ(w_γ^i · x_i(k))

Every state component ``j`` is its own scalar recursion
``x ← f(x) = x + λ σ(w x) x + σ(w x) u``, so the Jacobian of a step w.r.t. the previous state is exactly
diagonal (§4): ``J = ∂f/∂x = 1 + λ Δ + (λ x + u) w Δ (1 - Δ)``, all at ``x = x(k-1)``.

Parallel forward (§4, App. D): Newton's method on the residual ``r(k) = f_k(x(k-1)) - x(k)`` of the whole
trajectory. Because ``J`` is diagonal, quasi-DEER *is* DEER here, and each Newton step is one diagonal
linear recurrence for the update ``δ(k) = J(k) δ(k-1) + r(k)``, ``δ(-1) = 0``, solved by a parallel scan
(:func:`hf_statecompose.ops.linear_recurrence.linear_recurrence`). After ``t`` steps the first ``t`` states
are exact, so at most ``L`` steps are ever needed.

Backward by implicit differentiation at the converged trajectory (not autograd through the iterations): the
adjoint ``g(k) = ∂ℒ/∂x(k) + J(k+1) g(k+1)`` is one more diagonal linear recurrence, backward in time; the
gradients of λ, w_D, u and the initial state follow from the per-step partials ``∂f/∂λ = Δ x``,
``∂f/∂w = (λ x + u) Δ (1 - Δ) x``, ``∂f/∂u = Δ``, ``∂x(0)/∂x(-1) = J(0)``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from ...ops.linear_recurrence import linear_recurrence

logger = logging.getLogger(__name__)

METHODS = ("auto", "parallel", "sequential")
GATES = ("state", "input", "linear_state")

# The stopping tolerance, in units of the dtype's machine epsilon times the trajectory's scale (see
# `_newton_trajectory`).
_TOLERANCE_ULPS = 4.0
# An iterate this many times beyond the a-priori bound |x(k)| <= |x(-1)| + Σ|u| is diverging.
_GROWTH_LIMIT = 1e3


def _solve_linear_recurrence(a, b, initial_state=None):
    """h_k = a_k h_{k-1} + b_k over dim 1 of [B, L, C]: the op's chosen backend (one name for tests to patch)."""
    return linear_recurrence(a, b, initial_state)


@dataclass
class CoffeeSolveInfo:
    """How the last forward computed its trajectory.

    method: ``"parallel"``, ``"sequential"``, or ``"sequential (fallback)"`` when Newton diverged;
    iterations: Newton steps taken, summed over the windows (0 for the sequential path; at most L);
    residual: the final max |f_k(x(k-1)) - x(k)| (the largest over the windows; None for the sequential path);
    tolerance: the stopping tolerance used (the largest over the windows; None for the sequential path);
    windows: how many consecutive windows of at most ``CoffeeMixer.newton_window`` steps were solved;
    clipped: whether Newton diverged in some window and that window went on with its Jacobian clipped to
    [-1, 1] (see `_newton_trajectory`)."""

    method: str
    iterations: int = 0
    residual: float | None = None
    tolerance: float | None = None
    windows: int = 0
    clipped: bool = False


def _gate_and_slope(prev, u, w, gate_kind, mask=None):
    """(Δ, ∂Δ/∂x, ∂Δ/∂w, ∂Δ/∂u), elementwise ([..., D, n]); ``mask`` (0 / 1, broadcastable) zeroes the gate
    of padding steps, which then leave the state exactly as it was."""
    if mask is not None:
        gate, dx, dw, du = _gate_and_slope(prev, u, w, gate_kind)
        return tuple(None if t is None else t * mask for t in (gate, dx, dw, du))
    if gate_kind == "state":
        gate = torch.sigmoid(w * prev)
        slope = gate * (1 - gate)
        return gate, slope * w, slope * prev, None
    if gate_kind == "input":
        gate = torch.sigmoid(w * u)
        slope = gate * (1 - gate)
        return gate, None, slope * u, slope * w
    gate = w * prev  # "linear_state"
    return gate, w, prev, None


def _step_terms(prev, u, lam, w, gate_kind="state", mask=None):
    """Δ, f(prev), the diagonal Jacobian ∂f/∂prev, and the partials ∂f/∂w, ∂f/∂u, elementwise ([..., D, n];
    u broadcast over n). f(x) = x + Δ (λ x + u)."""
    gate, dgate_dx, dgate_dw, dgate_du = _gate_and_slope(prev, u, w, gate_kind, mask)
    drive = lam * prev + u  # λ x + u
    step = prev + gate * drive
    jacobian = 1 + lam * gate if dgate_dx is None else 1 + lam * gate + drive * dgate_dx
    dfdw = drive * dgate_dw
    dfdu = gate if dgate_du is None else gate + drive * dgate_du
    return gate, step, jacobian, dfdw, dfdu


def coffee_states_sequential(u, x0, lam, w, gate_kind="state", mask=None):
    """The plain loop over k (the reference; autograd-differentiable as written).

    u [B, L, D], x0 [B, D, n], lam, w [D, n], mask None or [B, L, 1, 1] -> states x(0..L-1) [B, L, D, n]."""
    states, x = [], x0
    for k in range(u.shape[1]):
        u_k = u[:, k, :, None]
        gate = _gate_and_slope(x, u_k, w, gate_kind, None if mask is None else mask[:, k])[0]
        x = x + gate * (lam * x + u_k)
        states.append(x)
    return torch.stack(states, dim=1)


def _newton_trajectory(u, x0, lam, w, gate_kind="state", mask=None):
    """Newton / DEER on the whole trajectory; returns (states [B, L, D, n], CoffeeSolveInfo, ok).

    Stopping rule: stop once every step equation holds to within ``_TOLERANCE_ULPS`` machine epsilons of the
    trajectory's scale, ``max_k |f_k(x(k-1)) - x(k)| <= 4 eps max(|x|, |x(-1)|, |u|, tiny)``. A trajectory
    meeting it is the exact trajectory of the model perturbed by a few ulp per step, which is what the
    sequential loop computes anyway (each of its steps rounds by about an ulp), so both are equally accurate
    and agree within the same propagated rounding (measured, L = 4096: outputs about 1e-6 relative in fp32,
    eps 1.2e-7, and 1e-15 in fp64, eps 2.2e-16; gradients as close to the fp64 loop as the fp32 loop is). Testing the residual rather than the size of the update avoids the update's noise floor,
    which is the per-step rounding *amplified* by the recurrence and could sit above a few ulp forever.
    Newton converges quadratically near the solution, so the rule costs at most one step more than needed.
    """
    B, L = u.shape[0], u.shape[1]
    D, n = lam.shape
    u_ = u[..., None]  # [B, L, D, 1]
    eps = torch.finfo(u.dtype).eps
    u_abs = u.abs()
    scale_in = max(float(x0.abs().max()) if x0.numel() else 0.0, float(u_abs.max()) if u.numel() else 0.0)
    bound = float(x0.abs().amax(dim=-1).max() + u_abs.sum(dim=1).max()) if u.numel() else 0.0

    # initial guess: the trajectory with the gate frozen at its value from the initial state (linear, one scan;
    # for the input gate, which does not depend on the state, this is already the solution)
    if gate_kind == "input":
        gate0 = torch.sigmoid(w * u_)  # [B, L, D, n]
    else:
        gate0 = _gate_and_slope(x0, None, w, gate_kind)[0][:, None].expand(B, L, D, n)
    if mask is not None:
        gate0 = gate0 * mask
    a0 = 1 + lam * gate0
    x = _solve_linear_recurrence(a0.reshape(B, L, D * n), (gate0 * u_).reshape(B, L, D * n), x0.reshape(B, D * n)).view(
        B, L, D, n
    )
    iterations = 0
    # the residual in float64 for float32 (and half) inputs: iterative refinement with an extended-precision
    # residual, so the iterate converges to the trajectory of the exact step equations, rounded once per
    # element, instead of one whose per-step rounding is amplified through the recurrence like the loop's
    wide = torch.float64 if u.dtype != torch.float64 else u.dtype
    u_w, lam_w, w_w, x0_w = u_.to(wide), lam.to(wide), w.to(wide), x0.to(wide)
    mask_w = None if mask is None else mask.to(wide)
    clipped = False  # Newton's Jacobian, until an iterate diverges (see below)
    last_good = x
    while True:
        x_w = x.to(wide)
        prev = torch.cat([x0_w[:, None], x_w[:, :-1]], dim=1)
        step, jacobian = _step_terms(prev, u_w, lam_w, w_w, gate_kind, mask_w)[1:3]
        residual = (step - x_w).to(u.dtype)
        jacobian = jacobian.to(u.dtype)
        res_max = float(residual.abs().max())
        x_max = float(x.abs().max())
        tolerance = _TOLERANCE_ULPS * eps * max(x_max, scale_in, torch.finfo(u.dtype).tiny)
        info = CoffeeSolveInfo("parallel", iterations, res_max, tolerance, clipped=clipped)
        if not (math.isfinite(res_max) and math.isfinite(x_max)) or x_max > _GROWTH_LIMIT * (bound + 1):
            if clipped or iterations >= L:
                return x, info, False
            # Newton diverged: where the dynamics expand (|J| > 1, e.g. steep trained gates with large inputs)
            # the linearisation about a poor guess can blow up through the scan. Go back to the last bounded
            # iterate and go on with the Jacobian clipped to [-1, 1]: a scan that cannot amplify, and still
            # a method whose fixed points are exactly the trajectory and whose first t states are exact after
            # t iterations (both hold for any finite Jacobian), so it ends within the same L iterations.
            clipped, x = True, last_good
            continue
        if res_max <= tolerance:
            return x, info, True
        if iterations >= L:  # exact after L steps in exact arithmetic: still off means rounding blew up
            return x, info, False
        if clipped:
            jacobian = jacobian.clamp(-1.0, 1.0)
        last_good = x
        update = _solve_linear_recurrence(jacobian.reshape(B, L, D * n), residual.reshape(B, L, D * n))
        x = x + update.view(B, L, D, n)
        iterations += 1


def _windowed_newton(u, x0, lam, w, gate_kind, mask, window):
    """Newton over consecutive windows of at most ``window`` steps, each started from the previous window's
    exact last state. One window of L steps may need many more iterations than L / window windows need in all:
    the first t states are exact after t iterations and the rest converge quadratically only once the
    iterate is close, so a long trajectory pays for every stretch where the guess is far off (measured, trained
    weights, L = 16,384, D = 16, n = 8: 27 iterations as one window, 9-12 per window of 1,024, 3-5x less work).
    The windows cost no parallelism the scans use: they run over batch and channels in parallel and over L
    by doubling (torch) or sequentially (Triton)."""
    L = u.shape[1]
    if L <= window:
        states, info, ok = _newton_trajectory(u, x0, lam, w, gate_kind, mask)
        info.windows = 1
        return states, info, ok
    pieces, x, iterations, residual, tolerance, windows, clipped = [], x0, 0, 0.0, 0.0, 0, False
    for start in range(0, L, window):
        part = None if mask is None else mask[:, start : start + window]
        states, info, ok = _newton_trajectory(u[:, start : start + window], x, lam, w, gate_kind, part)
        iterations, windows, clipped = iterations + info.iterations, windows + 1, clipped or info.clipped
        residual, tolerance = max(residual, info.residual), max(tolerance, info.tolerance)
        if not ok:
            return None, CoffeeSolveInfo("parallel", iterations, info.residual, info.tolerance, windows, clipped), False
        pieces.append(states)
        x = states[:, -1]
    return torch.cat(pieces, 1), CoffeeSolveInfo("parallel", iterations, residual, tolerance, windows, clipped), True


class _CoffeeTrajectory(torch.autograd.Function):
    """States x(0..L-1) from (u, x(-1), λ, w_D): forward by Newton (sequential on divergence), backward by
    the implicit adjoint recurrence. ``ctx`` keeps only the converged trajectory, not the iterations."""

    @staticmethod
    def forward(ctx, u, x0, lam, w, mixer, mask):
        gate_kind = mixer.gate
        ctx.gate_kind, ctx.mask = gate_kind, mask
        with torch.no_grad():
            states, info, ok = _windowed_newton(u, x0, lam, w, gate_kind, mask, mixer.newton_window)
            if not ok:
                if not mixer._warned_fallback:
                    logger.warning(
                        "COFFEE parallel (Newton) forward did not converge (max residual %s after %d steps, "
                        "tolerance %s); using the sequential loop. Pass method='sequential' to skip the attempt.",
                        info.residual,
                        info.iterations,
                        info.tolerance,
                    )
                    mixer._warned_fallback = True
                states = coffee_states_sequential(u, x0, lam, w, gate_kind, mask)
                info = CoffeeSolveInfo(
                    "sequential (fallback)", info.iterations, info.residual, info.tolerance, info.windows, info.clipped
                )
        mixer.last_solve = info
        ctx.save_for_backward(u, x0, lam, w, states)
        return states

    @staticmethod
    def backward(ctx, grad_states):
        u, x0, lam, w, states = ctx.saved_tensors
        B, L, D, n = states.shape
        u_ = u[..., None]
        prev = torch.cat([x0[:, None], states[:, :-1]], dim=1)
        gate, _, jacobian, dfdw, dfdu = _step_terms(prev, u_, lam, w, ctx.gate_kind, ctx.mask)
        # adjoint g(k) = G(k) + J(k+1) g(k+1), run forward in time over the flipped sequence
        a_next = torch.cat([jacobian[:, 1:], torch.zeros_like(jacobian[:, :1])], dim=1)
        adjoint = (
            _solve_linear_recurrence(a_next.flip(1).reshape(B, L, D * n), grad_states.flip(1).reshape(B, L, D * n))
            .view(B, L, D, n)
            .flip(1)
        )
        grad_u = (adjoint * dfdu).sum(-1) if ctx.needs_input_grad[0] else None
        grad_x0 = jacobian[:, 0] * adjoint[:, 0] if ctx.needs_input_grad[1] else None
        grad_lam = (adjoint * gate * prev).sum((0, 1)) if ctx.needs_input_grad[2] else None
        grad_w = (adjoint * dfdw).sum((0, 1)) if ctx.needs_input_grad[3] else None
        return grad_u, grad_x0, grad_lam, grad_w, None, None


def check_mixer_inputs(u, initial_state, mask, method, hidden_size, state_size):
    """The arguments of a per-feature SISO mixer's forward (COFFEE and the S6 baselines), checked: ``u``
    [B, L, D] with L >= 1, ``initial_state`` None (zeros) or [B, D, n], ``mask`` None or [B, L], ``method``
    one of :data:`METHODS`. Returns (initial_state, mask), both in ``u``'s dtype."""
    D, n = hidden_size, state_size
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if u.dim() != 3 or u.shape[-1] != D:
        raise ValueError(f"u must be [batch, length, hidden_size={D}], got {tuple(u.shape)}")
    if u.shape[1] == 0:
        raise ValueError("u has length 0; pass at least one step")
    if initial_state is None:
        initial_state = u.new_zeros(u.shape[0], D, n)
    elif tuple(initial_state.shape) != (u.shape[0], D, n):
        raise ValueError(
            f"initial_state must be [batch={u.shape[0]}, hidden_size={D}, state_size={n}], "
            f"got {tuple(initial_state.shape)}"
        )
    if mask is not None:
        if tuple(mask.shape) != tuple(u.shape[:2]):
            raise ValueError(f"mask must be [batch, length] = {tuple(u.shape[:2])}, got {tuple(mask.shape)}")
        mask = mask.to(u.dtype)
    return initial_state.to(u.dtype), mask


def _auto_method(u) -> str:
    """``"parallel"`` on an accelerator, the loop on the CPU. A CPU has no parallel hardware for the Newton
    scans to use, and each iteration is a full pass, so the loop wins wherever the batch carries the work:
    measured (forward + backward, batch 512, L = 16-64, D = 16, n = 8, the IH training steps of
    ``recipes/coffee.py``) the parallel path took 20-55x the loop's time; it is ahead only for a single long
    sequence with a backward (``benchmarks/coffee_parallel.py``, batch 1: 0.19-0.76x the loop's time at
    L = 256-16,384), where autograd's per-step overhead dominates the loop. Ask for ``method="parallel"`` there."""
    return "sequential" if u.device.type == "cpu" else "parallel"


class CoffeeMixer(nn.Module):
    """COFFEE sequence mixer: [B, L, D] -> [B, L, D], state [B, D, n] (eq. (7) with the gate (5)).

    Args:
        hidden_size (`int`): D, the number of features (one scalar input per feature).
        state_size (`int`): n, the state size per feature.
        output_filter (`bool`, *optional*, defaults to `False`): the output filter of Remark 2,
            ``y_i = (C_i γ_i) x_i`` with ``γ_i = σ(w_γ^i · x_i)``; adds ``w_gamma`` [D, n].
        device, dtype: of the parameters.

    Parameters (exactly ``3 D n`` without the filter, as in the paper: 384 for D = 16, n = 8):
        ``A`` [D, n]: the unconstrained μ of the diagonal of A_i, ``λ = -2 σ(μ)`` (:attr:`eigenvalues`);
        ``C`` [D, n]: the output rows C_i;  ``w_D`` [D, n]: the feedback vectors of (5).

    Stability: the paper enforces stability of I + A_i (§3, eq. (7)); its App. B uses ``λ = -e^μ``, which
    makes the continuous-time modes stable but not the step, since ``1 + λΔ < -1`` once ``λΔ < -2``. The
    step's multiplier is ``1 + λΔ`` with the gate ``Δ = σ(·) ∈ (0, 1)``. Here ``λ = -σ(μ) ∈ (-1, 0)``, so
    the multiplier lies in ``(0, 1)`` for every gate value and every μ: the step is a contraction that never
    flips sign, like the ``e^{λΔ} ∈ (0, 1)`` of S6 that ``1 + λΔ`` linearises (App. C.1), and
    ``|x(k)| <= |x(k-1)| + |u(k)|`` elementwise: the state cannot blow up whatever the weights. Positive
    multipliers also give every context a well-defined log-decay ``Σ_k log(1 + λΔ(k))``, what the
    decay-weighted compositions need (:meth:`forward` with ``return_log_decay``). (``λ ∈ (-2, 0)`` would
    also be stable, but lets the multiplier go negative, an oscillating mode no exponential produces.)

    Initialisation (App. H.2): A_i = 0 in the paper, here ``μ = -4`` (λ ≈ -0.018: I + A_i diag(Δ) within 2%
    of the identity, the exact 0 being out of reach of the open interval, and a gradient dλ/dμ ≈ λ that is
    not vanishing); C_i and w_D^i from N(0, 1); w_γ (not in App. H) also from N(0, 1).

    ``gate`` selects the gate for the ablations of the paper's Table 6 (the model is still eq. (7) otherwise):
    ``"state"`` (default, eq. (5)) ``Δ_i = σ(w_D^i ⊙ x_i(k-1))``; ``"input"`` (no feedback)
    ``Δ_i = σ(w_D^i u_i(k))``, the token-based gate of S6 in this parametrisation; ``"linear_state"`` (linear
    feedback) ``Δ_i = w_D^i ⊙ x_i(k-1)`` without the sigmoid (unbounded: the stability bound above does
    not hold for it, and the parallel path may fall back to the loop).

    ``forward(u, initial_state=None, return_final_state=False, method="auto")``: ``"sequential"`` runs the
    plain loop (autograd through it); ``"parallel"`` the Newton solve with the implicit backward, falling back
    to the loop, with one warning, if Newton diverges; ``"auto"`` the parallel path on accelerators, the
    loop on the CPU (faster there, see ``_auto_method``). :attr:`last_solve`
    (:class:`CoffeeSolveInfo`) says how the last forward went, :attr:`last_iterations` its Newton steps.
    """

    A_INIT = -4.0
    # the parallel forward solves consecutive windows of at most this many steps (see `_windowed_newton`)
    newton_window = 1024

    def __init__(
        self,
        hidden_size: int,
        state_size: int,
        output_filter: bool = False,
        gate: str = "state",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if hidden_size < 1 or state_size < 1:
            raise ValueError(f"hidden_size and state_size must be positive, got {hidden_size} and {state_size}")
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        self.hidden_size, self.state_size, self.output_filter = hidden_size, state_size, output_filter
        self.gate = gate
        factory = {"device": device, "dtype": dtype}
        self.A = nn.Parameter(torch.empty(hidden_size, state_size, **factory))
        self.C = nn.Parameter(torch.empty(hidden_size, state_size, **factory))
        self.w_D = nn.Parameter(torch.empty(hidden_size, state_size, **factory))
        self.w_gamma = nn.Parameter(torch.empty(hidden_size, state_size, **factory)) if output_filter else None
        self.last_solve: CoffeeSolveInfo | None = None
        self._warned_fallback = False
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.A.fill_(self.A_INIT)
            nn.init.normal_(self.C)
            nn.init.normal_(self.w_D)
            if self.w_gamma is not None:
                nn.init.normal_(self.w_gamma)

    @property
    def eigenvalues(self) -> torch.Tensor:
        """λ = diag(A_i) per feature, [D, n], in (-1, 0)."""
        return -torch.sigmoid(self.A)

    @property
    def last_iterations(self) -> int | None:
        """Newton steps of the last forward (0 for the sequential path), None before any forward."""
        return None if self.last_solve is None else self.last_solve.iterations

    def extra_repr(self) -> str:
        gate = "" if self.gate == "state" else f", gate={self.gate!r}"
        return f"hidden_size={self.hidden_size}, state_size={self.state_size}, output_filter={self.output_filter}{gate}"

    def forward(
        self,
        u: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        return_final_state: bool = False,
        method: str = "auto",
        mask: torch.Tensor | None = None,
        return_log_decay: bool = False,
    ):
        """u [B, L, D] -> y [B, L, D] (and the final state [B, D, n] if ``return_final_state``).

        ``mask`` ([B, L], 1 for real steps, 0 for padding; optional): a padding step has gate 0, so it leaves
        the state exactly as it was and contributes nothing (left-padded batches). ``return_log_decay``:
        return ``(y, final_state, log_decay)`` with ``log_decay = Σ_k log(1 + λ Δ(k))`` [B, D, n] (≤ 0), the
        log of the product of the step multipliers over the sequence (gates ``"state"`` and ``"input"``).
        """
        initial_state, mask = check_mixer_inputs(u, initial_state, mask, method, self.hidden_size, self.state_size)
        if mask is not None:
            mask = mask[:, :, None, None]
        if return_log_decay and self.gate == "linear_state":
            raise ValueError("gate='linear_state' has no log-decay: its step multiplier 1 + λΔ can be negative")
        lam, w = self.eigenvalues.to(u.dtype), self.w_D.to(u.dtype)
        if method == "auto":
            method = _auto_method(u)
        if method == "sequential":
            states = coffee_states_sequential(u, initial_state, lam, w, self.gate, mask)
            self.last_solve = CoffeeSolveInfo("sequential")
        else:
            states = _CoffeeTrajectory.apply(u, initial_state, lam, w, self, mask)  # [B, L, D, n]
        C = self.C.to(u.dtype)
        if self.w_gamma is not None:
            gamma = torch.sigmoid((states * self.w_gamma.to(u.dtype)).sum(-1, keepdim=True))
            y = (states * C * gamma).sum(-1)
        else:
            y = (states * C).sum(-1)
        if return_log_decay:
            prev = torch.cat([initial_state[:, None], states[:, :-1]], dim=1)
            gate = _gate_and_slope(prev, u[..., None], w, self.gate, mask)[0]
            return y, states[:, -1], torch.log1p(lam * gate).sum(1)
        return (y, states[:, -1]) if return_final_state else y
