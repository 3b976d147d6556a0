"""hf_statecompose's Triton kernels, laid out as a Hugging Face kernel (``kernels`` package) and bundled in the
hf_statecompose wheel as ``hf_statecompose._kernels``.

Each function is the Triton part of one op of ``hf_statecompose.ops`` (the package checks the arguments and does
the cheap [B, T, ·]-sized torch work around it under autograd); a Hub or local kernel that exposes these names
and signatures can replace the bundled one (``hf_statecompose.use_kernel``). Standalone: imports torch and
Triton only.

* :func:`selective_scan` (Mamba-1 scan on a discretised Δ), :func:`ssd_scan` (Mamba-2 chunked scan on Δ),
  :func:`causal_conv1d` (depthwise causal conv continuing a window, left padding per row),
  :func:`linear_recurrence` (h_k = a_k h_{k-1} + b_k), all differentiable;
* :func:`compose` (Σ_k W_k ⊙ x_k of n SSM states, the weights of :data:`COMPOSE_METHOD_IDS` computed from the
  decays; inference only) and :func:`compose_layers` (the same for L layers of one shape in one launch).
"""

from __future__ import annotations

from ._compose import METHOD_IDS as COMPOSE_METHOD_IDS
from ._compose import compose, compose_layers
from ._conv import causal_conv1d
from ._linear_recurrence import linear_recurrence
from ._selective_scan import selective_scan
from ._ssd import ssd_scan

__all__ = [
    "COMPOSE_METHOD_IDS",
    "causal_conv1d",
    "compose",
    "compose_layers",
    "linear_recurrence",
    "selective_scan",
    "ssd_scan",
]
