"""Ops, one folder each (``selective_scan``, ``ssd``, ``conv``, ``compose``, ``linear_recurrence``): a plain
reference, a vectorised torch path and a Triton kernel with the same signature, side by side; ``backends``
picks one.

The names below are imported on first use (PEP 562), so that the torch-free parts (the composition-method
registry ``compose.methods``, read by the CLI) can be imported without torch."""

import importlib

# public name -> the op folder that defines it
_EXPORTS = {
    "causal_conv1d": "conv",
    "causal_conv1d_ref": "conv",
    "compose_ssm_ref": "compose",
    "compose_ssm_torch": "compose",
    "discretize_dt": "ssd",
    "linear_recurrence": "linear_recurrence",
    "linear_recurrence_reference": "linear_recurrence",
    "selective_scan": "selective_scan",
    "selective_scan_ref": "selective_scan",
    "ssd_scan": "ssd",
    "ssd_scan_ref": "ssd",
}

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
]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
