"""Causal depthwise conv that continues a conv window: reference, torch, Triton."""

from .reference import causal_conv1d_ref
from .vectorized import causal_conv1d

__all__ = ["causal_conv1d", "causal_conv1d_ref"]
