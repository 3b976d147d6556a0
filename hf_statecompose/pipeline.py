"""The whole job in one call: retrieve stored states, compose, generate; and losses of continuations."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .generation.integration import enable
from .state.cache import ComposableMambaCache


@dataclass
class RetrievalGeneration:
    """What :func:`generate_with_retrieval` returns."""

    text: str  # the new text only
    sequences: torch.LongTensor  # query ids + new ids, as generate returns them
    retrieved: list  # StoreEntry list, best first (with .score, .text, .state)


def context_order(retrieved: list) -> list:
    """States in composition order: least relevant first, the most relevant last (next to the query),
    which is the order the paper's ``concat`` uses; order-invariant methods do not care."""
    return [entry.state for entry in reversed(retrieved)]


def generate_with_retrieval(
    model,
    tokenizer,
    query: str,
    store,
    k: int = 5,
    composition="picaso_r",
    exclude: Iterable[str] = (),
    **generate_kwargs,
) -> RetrievalGeneration:
    """Retrieve the ``k`` stored contexts most similar to ``query``, compose their states with
    ``composition`` (a method name or a :class:`StateComposer`), and generate from the composition.

    No context token is read again (except by the model-based ``concat`` / ``piconcat_r`` baselines).
    ``k=0`` (or an empty store) generates from the query alone. ``generate_kwargs`` go to
    ``model.generate`` (default ``max_new_tokens=32``, greedy).
    """
    enable(model)
    if not isinstance(query, str) or not query:
        raise ValueError("query must be a non-empty string")
    retrieved = store.retrieve(query, k, exclude=exclude) if k > 0 else []
    device = next(model.parameters()).device
    encoded = tokenizer(query, return_tensors="pt")
    input_ids = encoded["input_ids"].to(device)
    if input_ids.shape[1] == 0:
        raise ValueError("the query has no tokens")
    generate_kwargs.setdefault("max_new_tokens", 32)
    if getattr(tokenizer, "pad_token_id", None) is not None:
        generate_kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    attention_mask = encoded.get("attention_mask")
    if attention_mask is not None:
        generate_kwargs.setdefault("attention_mask", attention_mask.to(device))
    if retrieved:
        sequences = model.generate(
            input_ids, past_states=context_order(retrieved), composition=composition, **generate_kwargs
        )
    else:
        sequences = model.generate(input_ids, **generate_kwargs)
    text = tokenizer.decode(sequences[0, input_ids.shape[1] :], skip_special_tokens=True)
    return RetrievalGeneration(text, sequences, retrieved)


@torch.no_grad()
def continuation_losses(model, states: list, query_ids: torch.Tensor, continuation_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats/token) of ``continuation_ids`` after ``query_ids``, for each entry of
    ``states``: a composed state (batch 1) or ``None`` (no context). One batched forward for all the
    states; returns ``[len(states)]`` float64."""
    query_ids = query_ids.reshape(1, -1)
    continuation_ids = continuation_ids.reshape(1, -1)
    if query_ids.shape[1] == 0 or continuation_ids.shape[1] == 0:
        raise ValueError("query and continuation must both have tokens")
    device = next(model.parameters()).device
    ids = torch.cat([query_ids, continuation_ids], 1).to(device)
    q, c = query_ids.shape[1], continuation_ids.shape[1]
    target = continuation_ids.to(device)

    def losses(logits):
        logits = logits[:, q - 1 : q + c - 1].double()
        return (
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.expand(logits.shape[0], -1).reshape(-1), reduction="none"
            )
            .view(logits.shape[0], c)
            .mean(1)
        )

    out = torch.empty(len(states), dtype=torch.float64)
    with_state = [i for i, s in enumerate(states) if s is not None]
    without = [i for i, s in enumerate(states) if s is None]
    if without:
        out[without] = losses(model(input_ids=ids).logits).cpu().expand(len(without))
    if with_state:
        stacked = ComposableMambaCache.stack([states[i] for i in with_state])
        logits = model(input_ids=ids.expand(len(with_state), -1), past_states=[stacked]).logits
        out[with_state] = losses(logits).cpu()
    return out
