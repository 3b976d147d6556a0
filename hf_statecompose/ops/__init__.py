"""Ops, one folder each (``selective_scan``, ``ssd``, ``conv``, ``compose``, ``linear_recurrence``): a plain
reference, a vectorised torch path and the wrapper of a Triton kernel with the same signature, side by side;
``backends`` picks one. The Triton kernels live in the repository's ``kernels/`` (a Hugging Face kernel, shipped as
``hf_statecompose._kernels``); :func:`use_kernel` runs a Hub or local one instead."""

from ._triton import use_kernel
from .compose import compose_ssm_ref, compose_ssm_torch
from .conv import causal_conv1d, causal_conv1d_ref
from .linear_recurrence import linear_recurrence, linear_recurrence_reference
from .selective_scan import selective_scan, selective_scan_ref
from .ssd import discretize_dt, ssd_scan, ssd_scan_ref

__all__ = [
    "causal_conv1d",
    "causal_conv1d_ref",
    "compose_ssm_ref",
    "compose_ssm_torch",
    "discretize_dt",
    "linear_recurrence",
    "linear_recurrence_reference",
    "selective_scan",
    "selective_scan_ref",
    "ssd_scan",
    "ssd_scan_ref",
    "use_kernel",
]
