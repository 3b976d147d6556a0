"""Encode contexts into a :class:`ComposableMambaCache`: one prefill of the backbone, no logits."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .. import compat
from ..state.cache import ComposableMambaCache
from ..state.fingerprint import base_model_of
from ..state.validation import (
    EMPTY_CONTEXT,
    check_left_padded_mask,
    check_unmasked_context_padding,
    refuse_empty_contexts,
)
from .mixers import enable_state_path, refuse_layer_checkpointing, using_backend


def encode(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    backend: str | None = None,
    enable_grad: bool = False,
) -> ComposableMambaCache:
    """See :meth:`ComposableMambaCache.encode` (the same function).

    ``encode`` does not enable ``past_states``: it swaps the model's mixers for the state-aware ones (it
    runs through them; they change no other call, since they run the stock forward unless their cache
    is a ``ComposableMambaCache``) and nothing else. The model's class stays the stock one,
    ``hsc.is_enabled(model)`` stays False, and ``model.generate(..., past_states=...)`` is refused until
    ``hsc.enable(model)`` (which cannot live here: it composes states, a layer above this one).
    """
    input_ids, attention_mask = _ids_and_mask(input_ids, attention_mask)
    with torch.set_grad_enabled(enable_grad and torch.is_grad_enabled()):
        enable_state_path(model)
        refuse_layer_checkpointing(model)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a non-empty [B, T] tensor of token ids, got shape {tuple(input_ids.shape)}"
            )
        if input_ids.shape[0] == 0:
            raise ValueError(f"input_ids has no rows (shape {tuple(input_ids.shape)}): pass at least one context")
        if input_ids.shape[1] == 0:
            raise ValueError(f"input_ids (shape {tuple(input_ids.shape)}) is a context of no tokens; {EMPTY_CONTEXT}")
        check_vocabulary(model, input_ids)
        if attention_mask is not None:
            if tuple(attention_mask.shape) == tuple(input_ids.shape) and attention_mask.dim() == 2:
                refuse_empty_contexts((attention_mask != 0).sum(-1), "attention_mask", "all padding")
            attention_mask = check_left_padded_mask(attention_mask, input_ids)
        else:
            check_unmasked_context_padding(input_ids, model.config)
        cache = ComposableMambaCache.empty_for(model)
        backbone = base_model_of(model)
        device = next(backbone.parameters()).device
        input_ids = input_ids.to(device)
        mask = attention_mask.to(device) if attention_mask is not None else None
        hybrid = bool(getattr(cache, "attention_layer_indices", ()))
        extra = {}
        if hybrid:
            # positions as generate(context + query) gives them (from the mask: padding does not count), so that a
            # left-padded row's keys are rotated exactly as that row alone would rotate them
            extra["position_ids"] = context_positions(mask, input_ids).clamp(min=0)
        with using_backend(model, backend):
            backbone(
                input_ids=input_ids,
                attention_mask=mask,
                use_cache=True,
                **compat.cache_kwargs(cache, hybrid=hybrid),
                **extra,
            )
        if hybrid:
            cache.set_positions(context_positions(mask, input_ids))
        token_ids = input_ids.clone()
        if mask is not None:
            token_ids = token_ids.masked_fill(mask == 0, -1)
        cache.token_ids = token_ids
        return cache


_TOKENIZE = "tokenize first: hsc.encode(model, tok(texts, return_tensors='pt'))"


def _ids_and_mask(input_ids, attention_mask):
    """The token ids and the mask, from tensors or from a tokenizer's output (a ``BatchEncoding`` or a dict with
    ``input_ids`` and, for a padded batch, ``attention_mask``: both are taken). Anything else is refused."""
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise TypeError(
                f"input_ids was a {type(input_ids).__name__} without 'input_ids' (keys {sorted(input_ids)}); "
                f"{_TOKENIZE}"
            )
        given = input_ids.get("attention_mask")
        if given is not None and attention_mask is not None:
            raise ValueError(
                "the attention_mask came twice (in the tokenizer's output and as attention_mask=): pass it once"
            )
        attention_mask = given if attention_mask is None else attention_mask
        input_ids = input_ids["input_ids"]
    if not torch.is_tensor(input_ids):
        hint = " (return_tensors='pt' makes the tokenizer give tensors)" if isinstance(input_ids, (list, tuple)) else ""
        raise TypeError(
            f"input_ids must be a tensor of token ids of shape [batch, length], got {type(input_ids).__name__}{hint}; "
            f"{_TOKENIZE}"
        )
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids (torch.long), got a {input_ids.dtype} tensor")
    if attention_mask is not None and not torch.is_tensor(attention_mask):
        raise TypeError(
            f"attention_mask must be a tensor of 0/1 of the shape of input_ids, got {type(attention_mask).__name__}"
        )
    return input_ids, attention_mask


def check_vocabulary(model, input_ids: torch.Tensor) -> None:
    """Every id in ``[0, vocabulary size)`` (the embedding's rows), one host sync."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    size = getattr(embeddings, "num_embeddings", None) or getattr(model.config, "vocab_size", None)
    if size is None or input_ids.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise ValueError(
            f"input_ids hold id {bad}, outside the model's vocabulary [0, {size}): tokenize with the model's own "
            "tokenizer (and do not pass -100 labels or -1 padding as ids)"
        )


def context_positions(mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` int64: each real token's position among its row's real tokens (0, 1, ...), -1 for padding."""
    if mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1).clone()
    mask = mask.to(torch.long)
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, -1)
