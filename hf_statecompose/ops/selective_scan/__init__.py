"""Mamba-1 selective scan from an initial state: reference, vectorised torch (eager and compiled), Triton."""

from .reference import selective_scan_ref
from .vectorized import selective_scan

__all__ = ["selective_scan", "selective_scan_ref"]
