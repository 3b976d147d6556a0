"""Vectorised torch ops with their plain references (same signatures)."""
from .conv import causal_conv1d, causal_conv1d_ref
from .selective_scan import selective_scan, selective_scan_ref
from .ssd import discretize_dt, ssd_scan, ssd_scan_ref

__all__ = [
    "causal_conv1d",
    "causal_conv1d_ref",
    "discretize_dt",
    "selective_scan",
    "selective_scan_ref",
    "ssd_scan",
    "ssd_scan_ref",
]
