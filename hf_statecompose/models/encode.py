"""Encode contexts into a :class:`ComposableMambaCache`: one prefill of the backbone, no logits."""
from __future__ import annotations

import torch

from .. import compat
from ..state.cache import ComposableMambaCache
from ..state.fingerprint import base_model_of
from ..state.validation import check_left_padded_mask, check_unmasked_context_padding
from .mixers import enable_state_path, using_backend


def encode(model, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None, backend: str | None = None,
           enable_grad: bool = False) -> ComposableMambaCache:
    """See :meth:`ComposableMambaCache.encode` (the same function).

    ``encode`` does not enable ``past_states``: it swaps the model's mixers for the state-aware ones (it
    runs through them; they change no other call, since they run the stock forward unless their cache
    is a ``ComposableMambaCache``) and nothing else. The model's class stays the stock one,
    ``hsc.is_enabled(model)`` stays False, and ``model.generate(..., past_states=...)`` is refused until
    ``hsc.enable(model)`` (which cannot live here: it composes states, a layer above this one).
    """
    with torch.set_grad_enabled(enable_grad and torch.is_grad_enabled()):
        enable_state_path(model)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty [B, T] tensor of token ids, got shape {tuple(input_ids.shape)}")
        if attention_mask is not None:
            attention_mask = check_left_padded_mask(attention_mask, input_ids)
        else:
            check_unmasked_context_padding(input_ids, model.config)
        cache = ComposableMambaCache.empty_for(model)
        backbone = base_model_of(model)
        device = next(backbone.parameters()).device
        input_ids = input_ids.to(device)
        mask = attention_mask.to(device) if attention_mask is not None else None
        with using_backend(model, backend):
            backbone(input_ids=input_ids, attention_mask=mask, use_cache=True, **compat.cache_kwargs(cache))
        token_ids = input_ids.clone()
        if mask is not None:
            token_ids = token_ids.masked_fill(mask == 0, -1)
        cache.token_ids = token_ids
        return cache
