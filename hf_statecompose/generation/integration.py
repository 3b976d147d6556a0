"""``enable(model)``: ``past_states=`` for ``generate`` and ``forward`` of Mamba / Mamba-2 models.

What ``enable`` changes, and why it changes nothing else:

* each mixer's class is swapped for a subclass whose ``forward`` runs our initial-state-aware path
  (:mod:`hf_statecompose.models`) only when ``cache_params`` is a ``ComposableMambaCache``; any other
  call goes to the stock forward untouched;
* ``model.forward`` and ``model.generate`` are wrapped: without ``past_states`` they call the originals
  with the same arguments. With ``past_states`` the states are checked, composed into a fresh
  ``ComposableMambaCache`` with one row per query row (expanded for beams / return sequences), and
  passed as ``cache_params``. ``generate`` therefore returns what stock generate returns: the query
  as passed plus the new tokens.
"""
from __future__ import annotations

import functools
import inspect

import torch

from ..composition.composer import StateComposer
from ..models import disable_state_path, enable_state_path, get_backend, set_backend, using_backend  # noqa: F401
from ..state.cache import ComposableMambaCache
from ..state.fingerprint import base_model_of, model_fingerprint
from ..state.validation import check_against_model, check_is_state


def is_enabled(model) -> bool:
    return getattr(model, "_hf_statecompose_enabled", False)


def enable(model, backend: str | None = None):
    """Teach a Mamba / Mamba-2 model ``past_states=`` (idempotent; returns the model).

    Calls without ``past_states`` behave exactly as before. ``backend`` (``"auto"``, ``"torch"`` or
    ``"triton"``, see :mod:`hf_statecompose.ops.backends`) picks the kernels of the state-aware path;
    ``None`` keeps the model's current choice (``"auto"`` the first time).
    """
    enable_state_path(model, backend)
    if is_enabled(model):
        return model
    if hasattr(model, "generate"):
        model.generate = _wrap_generate(model, model.generate)
    model.forward = _wrap_forward(model, model.forward)
    object.__setattr__(model, "_hf_statecompose_enabled", True)
    return model


def disable(model):
    """Undo :func:`enable`."""
    if not is_enabled(model):
        return model
    disable_state_path(model)
    for name in ("forward", "generate"):
        if name in model.__dict__:
            del model.__dict__[name]
    object.__setattr__(model, "_hf_statecompose_enabled", False)
    return model


# ---------------------------------------------------------------------------------------------- compose
def compose_for_batch(model, past_states, composition, batch_size: int) -> ComposableMambaCache:
    """One composed state row per query row, checked against ``model``."""
    composer = composition if isinstance(composition, StateComposer) else StateComposer(composition)
    fingerprint = model_fingerprint(model)
    if isinstance(past_states, ComposableMambaCache):
        raise TypeError("past_states must be a list of states (or a list of lists, one per row), not a single state")
    if isinstance(past_states, (list, tuple)) and past_states and all(isinstance(s, (list, tuple)) for s in past_states):
        if len(past_states) != batch_size:
            raise ValueError(
                f"past_states has {len(past_states)} lists but the query batch has {batch_size} rows; "
                "pass one list of states per row, or a flat list of batch-1 states used for every row"
            )
        rows = []
        for r, row_states in enumerate(past_states):
            _check_batch_one(row_states, f"past_states[{r}]")
            _check_each_against_model(row_states, model, fingerprint, f"past_states[{r}]")
            rows.append(composer.compose(row_states, model=model))
        composed = ComposableMambaCache.stack(rows)
    else:
        if not isinstance(past_states, (list, tuple)):
            raise TypeError(f"past_states must be a list of ComposableMambaCache, got {type(past_states).__name__}")
        _check_each_against_model(past_states, model, fingerprint, "past_states")
        composed = composer.compose(list(past_states), model=model)
        if composed.batch_size == 1 and batch_size > 1:
            composed = composed.repeat_interleave(batch_size)
        elif composed.batch_size != batch_size:
            raise ValueError(
                f"past_states have batch size {composed.batch_size} but the query batch has {batch_size} rows; "
                "use batch-1 states (shared by all rows), states with one row per query row, or one list per row"
            )
    check_against_model(composed, model, fingerprint)
    return composed


def _check_each_against_model(states, model, fingerprint, where):
    """Fail fast, before any arithmetic, on states that do not belong to this model."""
    if not isinstance(states, (list, tuple)) or len(states) == 0:
        raise ValueError(f"{where} is empty: pass at least one ComposableMambaCache")
    for k, state in enumerate(states):
        check_is_state(state, f"{where}[{k}]")
        check_against_model(state, model, fingerprint, f"{where}[{k}]")


def _check_batch_one(states, where):
    for k, state in enumerate(states):
        if isinstance(state, ComposableMambaCache) and state.batch_size != 1:
            raise ValueError(f"{where}[{k}] has batch size {state.batch_size}; per-row lists take batch-1 states")


def _batch_size_of(args, kwargs, names):
    for name in names:
        value = kwargs.get(name)
        if torch.is_tensor(value):
            return value.shape[0]
    for value in args:
        if torch.is_tensor(value):
            return value.shape[0]
    raise ValueError("past_states needs input_ids (or inputs_embeds) to know the batch size")


def _wrap_forward(model, original):
    @functools.wraps(original)
    def forward(*args, past_states=None, composition="picaso_r", **kwargs):
        if past_states is None:
            if isinstance(kwargs.get("cache_params"), ComposableMambaCache):
                _refuse_layer_checkpointing(model)
            return original(*args, **kwargs)
        _refuse_layer_checkpointing(model)
        if kwargs.get("cache_params") is not None:
            raise ValueError("pass either past_states or cache_params, not both")
        batch = _batch_size_of(args, kwargs, ("input_ids", "inputs_embeds"))
        kwargs["cache_params"] = compose_for_batch(model, past_states, composition, batch)
        kwargs["use_cache"] = True
        return original(*args, **kwargs)

    return forward


def _refuse_layer_checkpointing(model):
    """transformers' layer checkpointing replays each layer in the backward pass with the cache it was
    given, which our mixers have updated by then: the replay would start from the wrong state and the
    gradients would be silently wrong. Refuse instead."""
    if not (model.training and torch.is_grad_enabled()):
        return
    if any(getattr(layer, "gradient_checkpointing", False) for layer in base_model_of(model).layers):
        raise ValueError(
            "gradient checkpointing of the layers (model.activation_checkpointing_enable()) cannot be combined with "
            "past_states or a ComposableMambaCache while training: the backward replay would start from the updated "
            "state. Disable it (model.activation_checkpointing_disable()) and, to save memory on the contexts, use "
            "hf_statecompose.training.composition_loss(..., checkpoint_contexts=True)"
        )


def _wrap_generate(model, original):
    @functools.wraps(original)
    def generate(*args, past_states=None, composition="picaso_r", **kwargs):
        if past_states is None:
            return original(*args, **kwargs)
        if kwargs.get("cache_params") is not None:
            raise ValueError("pass either past_states or cache_params, not both")
        bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
        batch = _batch_size_of((), {**bound, **kwargs}, ("inputs", "input_ids", "inputs_embeds"))
        config = kwargs.get("generation_config") or bound.get("generation_config") or model.generation_config
        expand = max(
            kwargs.get("num_beams", getattr(config, "num_beams", 1)) or 1,
            kwargs.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1,
        )
        composed = compose_for_batch(model, past_states, composition, batch)
        # generate() expands input_ids for beams / return sequences but never a user cache: do it here
        kwargs["cache_params"] = composed.repeat_interleave(expand) if expand > 1 else composed
        kwargs["use_cache"] = True
        return original(*args, **kwargs)

    return generate
