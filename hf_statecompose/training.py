"""Fine-tuning for composition (PICASO paper, arXiv 2502.17605, Section 5): the loss of a continuation
given a query and the *composed* state of k contexts.

* **BPTC** (backpropagation through composition): the contexts are encoded with the autograd graph kept,
  so the gradient reaches the weights through the query tokens, the composition weights (ΣΔ) and the
  context encodings.
* **BP2C** (backpropagation to composition): the contexts are encoded under ``torch.no_grad()``; the
  composed state is a constant, the gradient reaches the weights through the query tokens only.
  Cheaper: no graph over the context tokens (and the states could come from a store).

A batch is a list of :class:`CompositionExample` (one query row each, its own contexts); all rows of a
batch should have the same number of contexts (the paper samples one k per batch), but any mix works.
``recipes/finetune.py`` runs this with PEFT LoRA under accelerate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _torch_compat, compat
from .state.cache import ComposableMambaCache

OBJECTIVES = ("bptc", "bp2c")


@dataclass
class CompositionExample:
    """One training row: ``contexts`` (1-D token id tensors, composition order: first = oldest),
    ``query`` ids, then ``target`` ids whose loss is taken."""

    query: torch.Tensor
    target: torch.Tensor
    contexts: list = field(default_factory=list)


def _left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, length - len(r) :] = r
            mask[i, length - len(r) :] = 1
    return ids, mask


def encode_contexts(
    model, contexts: list[torch.Tensor], objective: str = "bptc", pad_id: int = 0, checkpoint: bool = False
) -> list:
    """All contexts in one left-padded batched encode; returns one batch-1 state per context.

    ``"bptc"`` keeps the graph (gradients flow into the encodings), ``"bp2c"`` encodes without it.
    ``checkpoint=True`` (BPTC only) keeps no activations of the context tokens: the encode is run again
    in the backward pass (``torch.utils.checkpoint``), trading compute for memory. (transformers' own
    layer checkpointing cannot be used with a cache: its replay would start from the updated state.)"""
    _check_objective(objective)
    if not contexts:
        return []
    if any(c.dim() != 1 or c.numel() == 0 for c in contexts):
        raise ValueError("every context must be a non-empty 1-D tensor of token ids")
    model = unwrap(model)
    device = next(model.parameters()).device
    ids, mask = _left_pad(list(contexts), pad_id)
    # the mask always goes along (all ones when nothing is padded): without one, encode would take a context's
    # real pad-id tokens for padding and refuse them
    ids, mask = ids.to(device), mask.to(device)
    if objective == "bptc" and checkpoint and torch.is_grad_enabled():
        state = _checkpointed_encode(model, ids, mask)
    else:
        state = ComposableMambaCache.encode(model, ids, attention_mask=mask, enable_grad=objective == "bptc")
    return [state.select([i]) for i in range(len(contexts))]


def _checkpointed_encode(model, ids, mask):
    from torch.utils.checkpoint import checkpoint

    first = {}

    def run(ids):
        state = ComposableMambaCache.encode(model, ids, attention_mask=mask, enable_grad=True)
        first.setdefault("state", state)  # A, token counts and ids: the same in the replay
        return tuple(
            t for i in range(state.num_layers) for t in (state.ssm_states[i], state.conv_states[i], state.delta_sums[i])
        )

    tensors = checkpoint(run, ids, use_reentrant=False)
    template = first["state"]
    state = template.filled_like(tensors[0::3], tensors[1::3], tensors[2::3], A=template.A)
    state.num_tokens, state.token_ids = template.num_tokens, template.token_ids
    return state


def composition_loss(
    model,
    examples: list[CompositionExample],
    objective: str = "bptc",
    composition="picaso_r",
    pad_id: int = 0,
    checkpoint_contexts: bool = False,
    reduction: str = "token",
) -> torch.Tensor:
    """Cross-entropy of the targets, each row conditioned on the composition of its own contexts (rows
    without contexts: on nothing, exactly as the plain model).

    The objective decides whether the gradient flows into the context encodings (``"bptc"``) or stops
    at the composed state (``"bp2c"``). ``reduction="token"``: the mean over every target token of the
    batch (transformers' convention); ``"row"``: the mean of each row's mean, so that rows with short
    targets (a one-word answer) weigh as much as rows with long ones (equal when all targets have the
    same length)."""
    _check_objective(objective)
    if reduction not in ("token", "row"):
        raise ValueError(f"reduction must be 'token' or 'row', got {reduction!r}")
    if not examples:
        raise ValueError("examples is empty")
    device = next(model.parameters()).device
    rows, labels = [], []
    for ex in examples:
        if ex.query.numel() == 0 or ex.target.numel() == 0:
            raise ValueError("every example needs a non-empty query and target")
        rows.append(torch.cat([ex.query, ex.target]))
        labels.append(torch.cat([torch.full_like(ex.query, -100), ex.target]))
    ids, mask = _left_pad(rows, pad_id)
    label_ids, _ = _left_pad(labels, -100)
    ids, mask, label_ids = ids.to(device), mask.to(device), label_ids.to(device)

    with_contexts = [i for i, ex in enumerate(examples) if ex.contexts]
    without = [i for i, ex in enumerate(examples) if not ex.contexts]
    if reduction == "row":  # weight each target token by 1 / (its row's target length)
        weights = torch.zeros_like(label_ids, dtype=torch.float32)
        for r, ex in enumerate(examples):
            weights[r, -ex.target.numel() :] = 1.0 / ex.target.numel()
    else:
        weights = (label_ids != -100).float()
    total = torch.zeros((), device=device)
    if with_contexts:
        flat = [c for i in with_contexts for c in examples[i].contexts]
        states = encode_contexts(model, flat, objective, pad_id, checkpoint=checkpoint_contexts)
        per_row, start = [], 0
        for i in with_contexts:
            n = len(examples[i].contexts)
            per_row.append(states[start : start + n])
            start += n
        sel = torch.tensor(with_contexts, device=device)
        total = total + _summed_loss(
            model, ids[sel], mask[sel], label_ids[sel], weights[sel], past_states=per_row, composition=composition
        )
    if without:
        sel = torch.tensor(without, device=device)
        # an empty state: the same values as the plain model, through our kernels (stock Mamba-1 trains ~20x slower on CPU)
        empty = ComposableMambaCache.empty_for(unwrap(model))
        total = total + _summed_loss(
            model, ids[sel], mask[sel], label_ids[sel], weights[sel], use_cache=True, **compat.cache_kwargs(empty)
        )
    return total / weights.sum()


def unwrap(model):
    """The model inside distributed / compile wrappers (``DistributedDataParallel.module``, ...): encoding
    goes to its backbone directly, while the query forward goes through the wrapper (gradient sync)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return _torch_compat.unwrap_compiled(model)


def _summed_loss(model, ids, mask, labels, weights=None, **kwargs):
    """Σ weight · cross-entropy over the labelled tokens (weights default to 1)."""
    attention_mask = None if bool(mask.all()) else mask
    logits = model(input_ids=ids, attention_mask=attention_mask, **kwargs).logits
    logits = logits[:, :-1].float()
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
    )
    if weights is None:
        return losses.sum()
    return (losses * weights[:, 1:].reshape(-1).to(losses.dtype)).sum()


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; choose one of {OBJECTIVES}")
