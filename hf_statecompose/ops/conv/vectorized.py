"""Causal depthwise conv1d that continues a conv window, row by row, under left padding.

    x          : [B, C, T]     (channels first, as the Mamba mixers hold it)
    weight     : [C, K]
    bias       : [C] or None
    conv_state : [B, C, K]     the last K inputs seen so far (oldest first); None means zeros
    mask       : [B, T]        1 = real token, 0 = left padding
    returns      out [B, C, T] and the new window [B, C, K]

With left padding, row b's real tokens start at p_b. They must see that row's own window directly
before them, not the padding. We therefore lay out each row as
``[filler (p_b), window (K), real tokens (T - p_b)]`` inside one ``[B, C, K + T]`` buffer by a
per-row gather, run one grouped conv over it and keep the last T outputs. The outputs at padded
positions are meaningless and must be masked by the caller, exactly as transformers masks padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import _activation


def causal_conv1d(x, weight, bias=None, conv_state=None, mask=None, activation=None):
    """Vectorised version of :func:`causal_conv1d_ref` (one gather, one grouped conv)."""
    batch, channels, length = x.shape
    kernel = weight.shape[-1]
    act = _activation(activation)
    if conv_state is None and mask is None:
        # from an empty window: a zero-padded conv, no buffer to build
        out = F.conv1d(x, weight[:, None, :].to(x.dtype), bias, padding=kernel - 1, groups=channels)[:, :, :length]
        window = x[:, :, -kernel:] if length >= kernel else F.pad(x, (kernel - length, 0))
        return act(out), window.contiguous()
    if conv_state is None:
        conv_state = x.new_zeros((batch, channels, kernel))
    if tuple(conv_state.shape) != (batch, channels, kernel):
        raise ValueError(f"conv window must be [B, C, K] = {(batch, channels, kernel)}, got {tuple(conv_state.shape)}")
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [B, C, K + T]
    if mask is not None:
        pad_count = (mask.shape[1] - mask.sum(-1)).long()  # [B]; padding is on the left
        positions = torch.arange(kernel + length, device=x.device)
        # buffer[j] = window[j - p] for p <= j < p + K, filler (window[0]) before, tokens after
        src = torch.where(
            positions[None] < pad_count[:, None] + kernel,
            (positions[None] - pad_count[:, None]).clamp(min=0),
            positions[None],
        )
        full = torch.gather(full, 2, src[:, None, :].expand(batch, channels, -1))
    out = F.conv1d(full, weight[:, None, :].to(x.dtype), bias, groups=channels)[:, :, 1:]
    return act(out), full[:, :, -kernel:].contiguous()  # a copy: a view would keep the whole buffer alive
