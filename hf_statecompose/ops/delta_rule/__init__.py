"""Delta-rule layers (gated DeltaNet, Kimi delta attention): the recurrence with each context's transition (token by
token, the reference; by chunks, chunk_delta_rule), and the compositions of contexts as affine maps (in order, mean
over cyclic orders, mean over all orders)."""

from __future__ import annotations

from .chunked import chunk_delta_rule
from .compose import MAX_ALL_ORDERS, compose_in_order, mean_over_orders, mean_over_rotations
from .reference import (
    compose_in_order_reference,
    delta_rule_reference,
    mean_over_orders_reference,
    rotations,
)

__all__ = [
    "MAX_ALL_ORDERS",
    "chunk_delta_rule",
    "compose_in_order",
    "compose_in_order_reference",
    "delta_rule_reference",
    "mean_over_orders",
    "mean_over_orders_reference",
    "mean_over_rotations",
    "rotations",
]
