"""Mamba-2 SSD scan from an initial state: reference, chunked torch, Triton."""

from .reference import discretize_dt, ssd_scan_ref
from .vectorized import ssd_scan

__all__ = ["discretize_dt", "ssd_scan", "ssd_scan_ref"]
