"""The cache layer is the unit of state: one object per state layer holds every per-layer tensor of a state.

:class:`ComposableSSMLayer` is transformers' ``LinearAttentionLayer`` (through
:class:`hf_statecompose.compat.SSMLayerBase`, which hides its internals) that also owns the context's ΣΔ
(``delta_sum``, ``[B, D]`` for Mamba-1 / ``[B, H]`` for Mamba-2, one row per batch row) and the layer's ``A``
(no batch dimension). Because ΣΔ lives on the layer, transformers' own batch operations on the layer
(``reorder_cache`` for beams, ``batch_select_indices``, ``batch_repeat_interleave``, ``offload`` /
``prefetch``, ``reset``) keep it consistent with the SSM state by construction: there is no parallel list on
the cache to forget. :class:`SeRpEntSSMLayer` adds SeRpEnt's resampling tensors the same way.

A hybrid model's attention layers are a second layer type of the same state, :class:`ComposableAttentionLayer`
(keys and values with the positions they were encoded at), and Falcon-H1's / Zamba2's layers with both parts a
third, :class:`ComposableSSMAttentionLayer`; a state is a list of layers, each composed by its own rule.

The cache keeps list-like per-layer views (``cache.ssm_states[l]``, ``cache.delta_sums[l]``, ``cache.A[l]``,
SeRpEnt's ``cache.clocks[v]``, ...) for the documented API: reading and assigning an item reads and assigns
the layer's attribute (:class:`LayerView`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import compat
from .architectures import SERPENT_MAMBA


class ComposableSSMLayer(compat.SSMLayerBase):
    """An SSM layer's state: SSM state, conv window, ΣΔ (``delta_sum``) and ``A``."""

    _row_tensors: tuple[str, ...] = ("delta_sum",)
    _fixed_tensors = ("A",)


class SeRpEntSSMLayer(ComposableSSMLayer):
    """A SeRpEnt (layer, branch) state: a Mamba-1 layer's plus the resampling tensors (clock, the last K
    inputs with their times and valid mask, the last branch output), each ``[B, ...]``."""

    _row_tensors = ComposableSSMLayer._row_tensors + tuple(extra.attribute for extra in SERPENT_MAMBA.extras)


class ComposableDeltaLayer(ComposableSSMLayer):
    """A delta-rule layer's state (gated DeltaNet, Kimi delta attention): an SSM layer's tensors plus the context's transition
    ``transition`` ``[B, H, k_dim, k_dim]`` (float32), the product of its steps, latest on the left."""

    _row_tensors = ComposableSSMLayer._row_tensors + ("transition",)


class ComposableAttentionLayer(compat.AttentionLayerBase):
    """An attention layer's state: keys and values ``[B, kv heads, L, head dim]`` and their positions ``[B, L]``
    (int64, -1 for padding slots)."""


class ComposableSSMAttentionLayer(compat.SSMAttentionLayerBase):
    """A layer with both parts (Falcon-H1, Zamba2's hybrid layers): an SSM layer's tensors and an attention layer's."""

    _row_tensors = ("delta_sum", "positions")
    _fixed_tensors = ("A",)


class LayerView(Sequence):
    """``cache.<name>[l]`` reads (and ``cache.<name>[l] = x`` sets) attribute ``attribute`` of state layer ``l``."""

    __slots__ = ("_attribute", "_layers")

    def __init__(self, layers, attribute: str):
        self._layers = layers
        self._attribute = attribute

    def __len__(self):
        return len(self._layers)

    def __getitem__(self, layer_idx):
        if isinstance(layer_idx, slice):
            return [self[i] for i in range(*layer_idx.indices(len(self)))]
        return getattr(self._layers[layer_idx], self._attribute)

    def __setitem__(self, layer_idx, value):
        setattr(self._layers[layer_idx], self._attribute, value)

    def __repr__(self):
        return f"LayerView({self._attribute!r}, {len(self)} layers)"


def layer_attribute(attribute: str, doc: str) -> property:
    """A cache property: a :class:`LayerView` of ``attribute`` over the cache's state layers (``cache.state_layers``:
    every layer of a pure SSM cache, the SSM layers of a hybrid's); assigning a list sets the attribute of every one."""

    def get(cache):
        return LayerView(cache.state_layers, attribute)

    def set_(cache, values):
        values = list(values)
        layers = cache.state_layers
        if len(values) != len(layers):
            raise ValueError(f"{attribute}: {len(values)} values for {len(layers)} layers")
        for layer, value in zip(layers, values):
            setattr(layer, attribute, value)

    return property(get, set_, doc=doc)
