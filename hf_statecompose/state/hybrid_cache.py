"""``ComposableHybridCache``: the state of a hybrid model (Mamba layers plus attention layers).

transformers' hybrids (``jamba``, ``zamba2``, ``bamba``, ``granitemoehybrid``, ``nemotron_h``, ``falcon_h1``) keep
one cache layer per model layer in a ``DynamicCache``: a ``LinearAttentionLayer`` for a Mamba layer, a
``DynamicLayer`` (keys and values) for an attention layer, a ``LinearAttentionAndFullAttentionLayer`` for a layer
with both, a ``DummyLayer`` for an MLP / MoE layer. This cache *is* such a ``DynamicCache``, with our layer
types in the same places (:mod:`.layers`), so it can be handed to the model's own forward and ``generate``:

* a Mamba layer is a :class:`~.layers.ComposableSSMLayer`, exactly as in a Mamba / Mamba-2 state (SSM state,
  conv window, ΣΔ, ``A``; Jamba's are Mamba-1 states, the others Mamba-2's);
* an attention layer is a :class:`~.layers.ComposableAttentionLayer`: the context's keys and values
  ``[B, kv heads, L, head dim]`` as the model cached them (for RoPE models: rotated to their positions) and the
  position of each key, ``positions`` ``[B, L]`` (-1 for a padding slot);
* a layer with both parts is a :class:`~.layers.ComposableSSMAttentionLayer`.

The state-layer API of :class:`~.cache.ComposableMambaCache` (``ssm_states[v]``, ``delta_sums[v]``, ``A[v]``,
``num_layers``, ``log_decay(v)``) indexes the SSM layers only (``state_layers``; state layer ``v`` lives in model
layer ``ssm_layer_indices[v]``), so the composition rules, state files and checks of SSM states apply to them
unchanged; :attr:`attention_layers` are the layers with keys and values, composed by their own rule
(:mod:`hf_statecompose.composition.attention`).
"""

from __future__ import annotations

import torch

from .. import compat
from .architectures import architecture as layout_of
from .cache import ComposableMambaCache
from .layers import (
    ComposableAttentionLayer,
    ComposableDeltaLayer,
    ComposableSSMAttentionLayer,
    ComposableSSMLayer,
    layer_attribute,
)
from .validation import check_key_positions


def _new_layer(kind: str, ssm_layer=ComposableSSMLayer):
    if kind == "ssm":
        return ssm_layer()
    if kind == "attention":
        return ComposableAttentionLayer()
    if kind == "both":
        return ComposableSSMAttentionLayer()
    return compat.EmptyLayer()


class ComposableHybridCache(ComposableMambaCache):
    """A hybrid model's state: one layer per model layer (SSM, attention, both, or empty), see the module doc."""

    def __init__(
        self,
        config,
        *,
        architecture: str,
        fingerprint: str,
        model_dtype: torch.dtype,
        model_info=None,
        num_layers: int | None = None,
    ):
        layout = layout_of(architecture)
        kinds = layout.layer_kinds(config)  # type: ignore[misc]  # every hybrid layout has layer_kinds
        if num_layers is not None and num_layers != len(kinds):
            raise ValueError(f"a {architecture} state has one layer per model layer ({len(kinds)}), not {num_layers}")
        if "ssm" not in kinds and "both" not in kinds:
            raise ValueError(
                f"this {architecture} model has no SSM layer (layer kinds {kinds}): it has no state to "
                "encode or compose; use transformers' own cache (past_key_values) for its attention layers"
            )
        if "attention" not in kinds and "both" not in kinds:
            # (transformers' forward with a cache asks an attention layer's cache for the mask's size, and fails
            # without one, as use_cache=True does without hf_statecompose)
            raise ValueError(
                f"this {architecture} model has no attention layer (layer kinds {kinds}): transformers' {architecture} "
                "forward with a cache needs one, so no state can be encoded or continued; give its config an attention "
                "layer (its layer types), or use a recurrent-only architecture (Mamba, Mamba-2)"
            )
        compat.Cache.__init__(self, layers=[_new_layer(kind, self._layer_class) for kind in kinds])
        self.config = config
        self.architecture = architecture
        self.fingerprint = fingerprint
        self.model_dtype = model_dtype
        self.model_info = dict(model_info or {})
        self.num_tokens: torch.Tensor | None = None
        self.token_ids: torch.Tensor | None = None
        self.layer_kinds = kinds
        self.ssm_layer_indices = layout.ssm_layer_indices(config)
        self.attention_layer_indices = layout.attention_layer_indices(config)

    @property
    def state_layers(self) -> list:
        return [self.layers[i] for i in self.ssm_layer_indices]

    @property
    def attention_layers(self) -> list:
        """The layers that hold keys and values (attention layers and layers with both parts), in model order."""
        return [self.layers[i] for i in self.attention_layer_indices]

    @property
    def key_mask(self) -> torch.Tensor | None:
        """``[B, L]`` bool: which key slots hold a context token (not padding); None without attention layers or keys."""
        layers = self.attention_layers
        if not layers or layers[0].positions is None:
            return None
        return layers[0].positions >= 0

    @property
    def context_length(self) -> int:
        """The number of key slots ``L`` (padding included) of the attention layers (0 without keys)."""
        layers = self.attention_layers
        return layers[0].keys.shape[-2] if layers and layers[0].has_keys else 0

    def set_positions(self, positions: torch.Tensor) -> None:
        """Record ``positions`` ``[B, L]`` (-1 for padding) as every attention layer's, checked first: int64, one per
        key slot of the layers' keys (when they hold keys), on their device, and positions an encode or composition
        makes (:func:`~.validation.check_key_positions`: per row left padding, then ``0 .. m`` without a gap)."""
        where = "set_positions(positions)"

        def refuse(problem: str):
            raise ValueError(f"{where}: {problem}")

        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.dim() != 2:
            refuse(
                "positions must be an int64 tensor [B, L] (-1 for padding), got "
                f"{getattr(positions, 'dtype', type(positions).__name__)} {tuple(getattr(positions, 'shape', ()))}"
            )
        keyed = next((layer for layer in self.attention_layers if layer.has_keys), None)
        if keyed is not None:
            expected = (keyed.keys.shape[0], keyed.keys.shape[-2])
            if tuple(positions.shape) != expected:
                refuse(f"positions have shape {tuple(positions.shape)}, the keys {expected} ([B, L]: one per key slot)")
            if positions.device != keyed.keys.device:
                refuse(f"positions are on {positions.device}, the keys on {keyed.keys.device}")
        check_key_positions(positions, where, refuse=refuse)
        for layer in self.attention_layers:
            layer.positions = positions

    @classmethod
    def _model_info(cls, model) -> dict:
        config = model.config
        return {
            "model_type": config.model_type,
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
        }

    _repr_name = "ComposableHybridCache"

    def _repr_layers(self) -> str:
        return (
            f"layers={len(self.layers)} ({len(self.ssm_layer_indices)} SSM, {len(self.attention_layer_indices)} "
            f"attention), keys={self.context_length}"
        )


class ComposableDeltaRuleCache(ComposableHybridCache):
    """A delta-rule hybrid's state (Qwen3-Next, Qwen3.5, Olmo-Hybrid: gated DeltaNet layers plus attention layers;
    Kimi Linear: Kimi delta attention layers plus MLA layers).

    Its SSM layers are :class:`~.layers.ComposableDeltaLayer` objects: a delta-rule layer's recurrent state
    ``ssm_states[v]`` ``[B, H, k_dim, v_dim]`` (float32), conv window ``conv_states[v]`` ``[B, 2·key_dim + value_dim,
    K]``, the scalar part of its decay as ΣΔ ``[B, H]`` with ``A`` ``[H]`` (as Mamba-2's; Kimi delta attention, which
    decays each key channel: ``[B, H, k_dim]``), and the context's
    transition ``transitions[v]`` ``[B, H, k_dim, k_dim]`` (float32): the product of the layer's steps
    ``exp(g_t) (I − β_t k_t k_tᵀ)`` (KDA: ``(I − β_t k_t k_tᵀ) Diag(exp g_t)``) over the context, latest on the left. A context maps a state ``S`` to
    ``M S + S_C``; the composer composes these affine maps (in order for ``caso``, their mean over the cyclic
    orders for ``picaso_r``, over all orders for ``picaso_s``). The mixers keep the transition up to date whenever a
    layer holds one (it costs one more recurrence of width ``k_dim`` beside the state's ``v_dim``)."""

    _layer_class = ComposableDeltaLayer

    transitions = layer_attribute(
        "transition", "Per SSM layer: the context's transition ``[B, H, k_dim, k_dim]`` (float32), latest step left."
    )

    _repr_name = "ComposableDeltaRuleCache"
