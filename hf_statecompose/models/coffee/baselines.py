"""Baselines of the COFFEE paper (arXiv 2510.14027): S6 (its App. B) and "COFFEE as in (4)" (its Table 6).

Both are per-feature SISO state-space models over ``[B, L, D]`` with a state ``[B, D, n]`` (one ``n``-state
per feature ``i``), diagonal ``A_i = diag(λ^i)``, and an input-dependent step ``Δ_i(k)``: a diagonal linear
recurrence ``x(k) = a(k) ⊙ x(k-1) + b(k)`` once ``a`` and ``b`` are computed from the inputs, solved by
:func:`hf_statecompose.ops.linear_recurrence.linear_recurrence` (the doubling scan; differentiable) or, with
``method="sequential"``, by a plain loop (the reference the tests compare with).

:class:`S6Mixer` (App. B, eqs. (11)-(13)), zero-order hold::

    B(k) = W_B u(k),  C(k) = W_C u(k)                   # [n], shared by all features (W_B, W_C: n x D)
    Δ(k) = softplus(W_D u(k) + b_D)                     # [D], one step per feature (W_D: D x D)
    x_i(k) = e^{λ^i Δ_i(k)} ⊙ x_i(k-1) + (e^{λ^i Δ_i(k)} - 1) / λ^i ⊙ B(k) u_i(k)
    y_i(k) = C(k) · x_i(k)

``λ = -exp(μ)`` (App. B), initialised ``λ_j = -(j + 1)`` (App. H.2, S4D-real / HiPPO); W_B, W_C, W_D from
N(0, 1) (App. H.2); the Δ bias (``delta_bias=True``) starts at 0. Parameters: ``3 n D + D² (+ D)``; the
paper's IH count 784 (= 3·8·16 + 16² + 16 + 8·16 embedding) includes the bias, its MNIST counts (10085 for
n = 16, Table 7) do not: pass ``delta_bias=False`` for those.

:class:`LinearizedS6Mixer` ("COFFEE as in (4)", Step 1 of §3.2 / App. C.1, eq. (15)): the first-order
Taylor expansion of the exponential, feature-dependent time-invariant ``B_i, C_i`` and ``Δ`` from the
token as in S6 with the sigmoid of App. C.1::

    Δ(k) = σ(W_D u(k) + b_D)
    x_i(k) = (1 + λ^i Δ_i(k)) ⊙ x_i(k-1) + Δ_i(k) B_i u_i(k)
    y_i(k) = C_i · x_i(k)

with ``token_bc=True`` the token-dependent ``B(k) = W_B u(k)``, ``C(k) = W_C u(k)`` of S6 instead (eq. (14)),
same parameter count. ``λ = -σ(μ) ∈ (-1, 0)`` as in :class:`CoffeeMixer` (the step multiplier ``1 + λΔ``
stays in (0, 1): with S6's ``λ = -(j+1)`` it would reach -7 and the state would blow up over 16 steps),
initialised at μ = -4 as COFFEE; B, C, W_D from N(0, 1). Same parameter count as S6: ``3 n D + D² (+ D)``.

``forward(u [B, L, D], initial_state [B, D, n] = None, return_final_state=False, mask=None, method="auto")``
-> ``y [B, L, D]`` (or ``(y, final_state)``); ``mask`` [B, L] (1 real, 0 padding): a padding step has Δ = 0,
which leaves the state exactly as it was (both discretisations give a = 1, b = 0 there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.linear_recurrence import linear_recurrence
from .mixer import check_mixer_inputs


def _diagonal_scan(a, b, x0, method):
    """x(k) = a(k) ⊙ x(k-1) + b(k): a, b [B, L, D, n], x0 [B, D, n] -> states [B, L, D, n]."""
    if method == "sequential":
        states, x = [], x0
        for k in range(a.shape[1]):
            x = a[:, k] * x + b[:, k]
            states.append(x)
        return torch.stack(states, dim=1)
    B, L, D, n = a.shape
    return linear_recurrence(a.reshape(B, L, D * n), b.reshape(B, L, D * n), x0.reshape(B, D * n)).view(B, L, D, n)


class _SelectiveBase(nn.Module):
    def __init__(self, hidden_size: int, state_size: int, delta_bias: bool = True):
        super().__init__()
        if hidden_size < 1 or state_size < 1:
            raise ValueError(f"hidden_size and state_size must be positive, got {hidden_size} and {state_size}")
        self.hidden_size, self.state_size = hidden_size, state_size
        self.W_D = nn.Linear(hidden_size, hidden_size, bias=delta_bias)

    def _coefficients(self, u, mask):
        """(a, b, C-readout) for the scan: a, b [B, L, D, n]; readout [B, L, D, n] or [D, n] (broadcast)."""
        raise NotImplementedError

    def forward(
        self,
        u: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        return_final_state: bool = False,
        mask: torch.Tensor | None = None,
        method: str = "auto",
    ):
        x0, mask = check_mixer_inputs(u, initial_state, mask, method, self.hidden_size, self.state_size)
        if mask is not None:
            mask = mask[:, :, None]
        a, b, readout = self._coefficients(u, mask)
        states = _diagonal_scan(a, b, x0, method)
        y = (states * readout).sum(-1)
        return (y, states[:, -1]) if return_final_state else y

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, state_size={self.state_size}, delta_bias={self.W_D.bias is not None}"


class S6Mixer(_SelectiveBase):
    """S6 (Mamba's selective SSM) as in the COFFEE paper's App. B: [B, L, D] -> [B, L, D], state [B, D, n].

    Parameters: ``A`` [D, n] (μ, λ = -exp(μ)), ``W_B``, ``W_C`` (Linear D -> n, no bias), ``W_D`` (Linear D -> D,
    bias if ``delta_bias``): ``3 n D + D² (+ D)`` (656 for D = 16, n = 8 with the bias).
    """

    def __init__(self, hidden_size: int, state_size: int, delta_bias: bool = True, device=None, dtype=None):
        super().__init__(hidden_size, state_size, delta_bias)
        self.A = nn.Parameter(torch.empty(hidden_size, state_size))
        self.W_B = nn.Linear(hidden_size, state_size, bias=False)
        self.W_C = nn.Linear(hidden_size, state_size, bias=False)
        self.reset_parameters()
        self.to(device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            # λ_j = -(j + 1) for every feature (App. H.2)
            self.A.copy_(torch.log(torch.arange(1, self.state_size + 1, dtype=torch.float32)).expand_as(self.A))
            for lin in (self.W_B, self.W_C, self.W_D):
                nn.init.normal_(lin.weight)
            if self.W_D.bias is not None:
                nn.init.zeros_(self.W_D.bias)

    @property
    def eigenvalues(self) -> torch.Tensor:
        """λ, [D, n], negative."""
        return -torch.exp(self.A)

    def _coefficients(self, u, mask):
        lam = self.eigenvalues.to(u.dtype)
        delta = F.softplus(self.W_D(u))  # [B, L, D]
        if mask is not None:
            delta = delta * mask
        lam_delta = delta[..., None] * lam  # [B, L, D, n]
        a = torch.exp(lam_delta)
        b = torch.expm1(lam_delta) / lam * self.W_B(u)[:, :, None, :] * u[..., None]  # ZOH input term
        return a, b, self.W_C(u)[:, :, None, :]


class LinearizedS6Mixer(_SelectiveBase):
    """ "COFFEE as in (4)" (the paper's Table 6): S6 linearised, Δ from the token, no state feedback.

    Parameters: ``A`` [D, n] (μ, λ = -σ(μ)), ``B``, ``C`` [D, n] (or ``W_B``, ``W_C`` Linear D -> n with
    ``token_bc``), ``W_D`` (Linear D -> D, bias if ``delta_bias``): ``3 n D + D² (+ D)``, as S6.
    """

    A_INIT = -4.0

    def __init__(
        self,
        hidden_size: int,
        state_size: int,
        delta_bias: bool = True,
        token_bc: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(hidden_size, state_size, delta_bias)
        self.token_bc = token_bc
        self.A = nn.Parameter(torch.empty(hidden_size, state_size))
        if token_bc:
            self.W_B = nn.Linear(hidden_size, state_size, bias=False)
            self.W_C = nn.Linear(hidden_size, state_size, bias=False)
        else:
            self.B = nn.Parameter(torch.empty(hidden_size, state_size))
            self.C = nn.Parameter(torch.empty(hidden_size, state_size))
        self.reset_parameters()
        self.to(device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.A.fill_(self.A_INIT)
            if self.token_bc:
                nn.init.normal_(self.W_B.weight)
                nn.init.normal_(self.W_C.weight)
            else:
                nn.init.normal_(self.B)
                nn.init.normal_(self.C)
            nn.init.normal_(self.W_D.weight)
            if self.W_D.bias is not None:
                nn.init.zeros_(self.W_D.bias)

    @property
    def eigenvalues(self) -> torch.Tensor:
        """λ, [D, n], in (-1, 0)."""
        return -torch.sigmoid(self.A)

    def _coefficients(self, u, mask):
        lam = self.eigenvalues.to(u.dtype)
        delta = torch.sigmoid(self.W_D(u))  # [B, L, D]
        if mask is not None:
            delta = delta * mask
        a = 1 + delta[..., None] * lam  # [B, L, D, n]
        if self.token_bc:
            b = (delta * u)[..., None] * self.W_B(u)[:, :, None, :]
            return a, b, self.W_C(u)[:, :, None, :]
        b = (delta * u)[..., None] * self.B.to(u.dtype)
        return a, b, self.C.to(u.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", token_bc=True" if self.token_bc else "")
