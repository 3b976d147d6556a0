"""Composing the attention layers of hybrid states (keys and values), beside the SSM layers' rules.

A hybrid state (:class:`~hf_statecompose.state.hybrid_cache.ComposableHybridCache`) holds, per attention layer, the
context's keys and values and the position each key was encoded at. Composing n states gives each attention
layer the keys and values of **all** contexts (the union: attention reads every context token exactly, nothing
is averaged), placed by a policy:

* ``"concat"`` (default): one after another in the list's order, as in the concatenated text. State k's keys
  move by the total span of the states before it (a span is a state's last position + 1: its length for an
  encoded state), and the query continues after the total. For RoPE models the moved keys are re-rotated to
  their new positions: RoPE rotates each pair of dims by ``p·θ_i``, rotations compose, so a key encoded at
  ``p`` becomes the key at ``p + δ`` by one more rotation by ``δ·θ_i`` (partial RoPE: only the rotated dims).
  The keys then equal those of the concatenation *as far as the keys depend on their position*; what they
  do not see is the other contexts (each context was encoded alone), which is the approximation of every
  composition method (APE, Block-Attention, PICASO alike).
* ``"shared"``: every context at the positions it was encoded at (0, 1, ... for each), the query after the
  longest one: order-free placement, as APE (Yang et al., 2025) aligns parallel contexts. Keys are not moved.
* ``"none"``: no keys: the attention layers see only the query (to measure what the attention part adds).

For attention without positional encoding (Jamba, Nemotron-H, Granite-4.0-H with ``position_embedding_type``
None, Zamba2 without ``use_mem_rope``) the placement changes nothing but the recorded positions: attention over
the union of keys and values does not depend on their order, so with an order-free SSM rule (PICASO-S, soup)
the whole composition is invariant to the order of the states.

Padding: each state's padding slots (``positions == -1``) are dropped from the middle; the composed layers are
left padded per row (padding first), the same positions in every attention layer.
"""

from __future__ import annotations

import torch

from ..state.architectures import architecture

ATTENTION_POLICIES = ("concat", "shared", "none")


def spans(state) -> torch.Tensor:
    """``[B]``: per row, the last key position + 1 of ``state`` (0 without keys)."""
    layers = state.attention_layers
    if not layers or not layers[0].has_keys or layers[0].positions.shape[-1] == 0:
        return torch.zeros(state.batch_size, dtype=torch.long, device=state.device)
    return layers[0].positions.max(dim=-1).values.clamp(min=-1) + 1


def rotary_frequencies(model, config, rotary_dims: int, device) -> torch.Tensor:
    """The inverse frequencies ``θ_i`` ``[rotary_dims / 2]`` of the model's RoPE: read from the model's rotary
    embedding when ``model`` is given (any RoPE variant the model computes), else the default RoPE of the
    config (``rope_theta``, ``partial_rotary_factor``); other RoPE types need the model."""
    if model is not None:
        for module in model.modules():
            inv_freq = getattr(module, "inv_freq", None)
            if isinstance(inv_freq, torch.Tensor) and inv_freq.numel() == rotary_dims // 2:
                return inv_freq.detach().to(device=device, dtype=torch.float64)
    parameters = dict(getattr(config, "rope_parameters", None) or {})
    kind = parameters.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"re-rotating keys of a {kind!r} RoPE needs the model: compose with model=model")
    theta = float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return 1.0 / (theta ** (torch.arange(0, rotary_dims, 2, dtype=torch.float64, device=device) / rotary_dims))


def rerotate(keys: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor, rotary_dims: int) -> torch.Tensor:
    """Keys ``[B, H, L, D]`` rotated by ``shift`` ``[B, L]`` more positions (NeoX-style RoPE on the first
    ``rotary_dims`` dims, halves rotated together, as transformers' ``rotate_half``); computed in float64."""
    angles = shift.to(torch.float64)[:, None, :, None] * inv_freq  # [B, 1, L, rot/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated, rest = keys[..., :rotary_dims].to(torch.float64), keys[..., rotary_dims:]
    half = rotary_dims // 2
    turned = torch.cat([-rotated[..., half:], rotated[..., :half]], -1)
    out = (rotated * cos + turned * sin).to(keys.dtype)
    return torch.cat([out, rest], -1) if rest.shape[-1] else out


def compose_attention(out, states, policy: str = "concat", model=None) -> None:
    """Fill the attention layers of ``out`` (a hybrid state with its SSM layers composed) from ``states`` (list
    order, one batch), placed by ``policy`` (module docstring). Keys and values come out in the model dtype."""
    if not getattr(out, "attention_layer_indices", ()):
        return
    if policy not in ATTENTION_POLICIES:
        raise ValueError(f"unknown attention policy {policy!r}; choose one of {', '.join(ATTENTION_POLICIES)}")
    first = states[0]
    batch, device, dtype = first.batch_size, first.device, first.model_dtype
    if policy == "none":
        for target, source in zip(out.attention_layers, first.attention_layers):
            empty = source.keys[:, :, :0].to(dtype)
            target.fill_keys(
                empty, source.values[:, :, :0].to(dtype), torch.zeros(batch, 0, dtype=torch.long, device=device)
            )
        return
    layout = architecture(first.architecture)
    rotary_dims = layout.rotary_dims(first.config)
    offsets, total = [], torch.zeros(batch, dtype=torch.long, device=device)
    for state in states:
        offsets.append(total.clone() if policy == "concat" else torch.zeros_like(total))
        total = total + spans(state) if policy == "concat" else torch.maximum(total, spans(state))
    positions = torch.cat(
        [
            torch.where(s.attention_layers[0].positions >= 0, s.attention_layers[0].positions + offsets[k][:, None], -1)
            for k, s in enumerate(states)
        ],
        dim=-1,
    )
    shift = torch.cat(
        [
            torch.where(s.attention_layers[0].positions >= 0, offsets[k][:, None], 0).expand_as(
                s.attention_layers[0].positions
            )
            for k, s in enumerate(states)
        ],
        dim=-1,
    )
    real = positions >= 0
    # left padding per row: padding first, the real keys in their order (a stable sort of the mask), then drop
    # the columns that are padding in every row
    order = torch.sort(real.to(torch.int8), dim=-1, stable=True).indices
    keep = int(real.sum(-1).max()) if real.numel() else 0
    order = order[:, order.shape[1] - keep :]
    positions = positions.gather(1, order)
    shift = shift.gather(1, order)
    moved = rotary_dims > 0 and bool((shift != 0).any())
    inv_freq = rotary_frequencies(model, first.config, rotary_dims, device) if moved else None
    for j, target in enumerate(out.attention_layers):
        keys = torch.cat([s.attention_layers[j].keys.to(dtype) for s in states], dim=-2)
        values = torch.cat([s.attention_layers[j].values.to(dtype) for s in states], dim=-2)
        # (keys and values may differ in width: Kimi's MLA caches its latent and its rotary part)
        index = order[:, None, :, None]
        keys = keys.gather(2, index.expand(*keys.shape[:2], keep, keys.shape[3]))
        values = values.gather(2, index.expand(*values.shape[:2], keep, values.shape[3]))
        if inv_freq is not None:  # moved
            keys = rerotate(keys, shift, inv_freq, rotary_dims)
        target.fill_keys(keys, values, positions)
