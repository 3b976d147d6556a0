"""Causal depthwise conv continuing a window: the plain reference and shared helpers.
Shapes: see vectorized.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTIVATIONS = {None: lambda t: t, "silu": F.silu, "swish": F.silu}


def _activation(name):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unsupported conv activation {name!r}; expected one of {sorted(map(str, _ACTIVATIONS))}"
        ) from None


def causal_conv1d_ref(x, weight, bias=None, conv_state=None, mask=None, activation=None):
    """Row-by-row reference: drop each row's padding, prepend its window, convolve, put back."""
    batch, channels, length = x.shape
    kernel = weight.shape[-1]
    act = _activation(activation)
    if conv_state is None:
        conv_state = x.new_zeros((batch, channels, kernel))
    out = x.new_zeros((batch, channels, length))
    new_state = torch.empty_like(conv_state)
    for b in range(batch):
        keep = mask[b].bool() if mask is not None else torch.ones(length, dtype=torch.bool, device=x.device)
        real = x[b][:, keep]  # [C, T_b]
        seq = torch.cat([conv_state[b].to(x.dtype), real], dim=-1)  # [C, K + T_b]
        y = F.conv1d(seq[None], weight[:, None, :].to(x.dtype), bias, groups=channels)[0]  # [C, T_b + 1]
        out[b][:, keep] = act(y[:, 1:])
        new_state[b] = seq[:, -kernel:]
    return out, new_state
