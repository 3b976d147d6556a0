"""hf_statecompose as a transformers ``custom_generate`` method: generation from composed context states on a stock,
never-enabled Mamba / Mamba-2 / hybrid model.

    out = model.generate(query_ids, custom_generate="<this repository or folder>", trust_remote_code=True,
                         past_states=[state, ...], composition="picaso_r", max_new_tokens=32)

is ``hf_statecompose.enable(model)`` followed by ``model.generate(query_ids, past_states=..., composition=...)``,
token for token, and leaves the model as it was: it is enabled for the call only (``hf_statecompose.enabled(model)``;
``enable`` swaps the classes of the model and of its SSM mixers and sets the mixers' backend, nothing else) and given
back its classes and backend when the call ends, also when it fails. Calls that overlap on one model (threads) share
that enabling: the model stays enabled until the last of them returns, and each call is the same call run alone (its
tokens and the cache it returns). A model the user enabled stays enabled and is used as it is.

Enabled in place, not through a copy: the states are checked against the model's fingerprint, which is cached per
model object (a copy would hash every weight again on each call), and a copy would share the mixers whose classes
``enable`` swaps anyway.

transformers loads this file with ``trust_remote_code=True`` (it runs on the caller's machine) after checking
``requirements.txt`` beside it; it uses only hf_statecompose's public API.
"""

from __future__ import annotations

import hf_statecompose as hsc


def _enabled(model):
    """``hf_statecompose.enabled(model)``; an installed release without it (0.2.0) is refused in one line."""
    enabled = getattr(hsc, "enabled", None)
    if enabled is None:
        raise ImportError(
            f"this custom_generate needs hf_statecompose.enabled (the release after 0.2.0); the installed "
            f"hf_statecompose {getattr(hsc, '__version__', '?')} lacks it: pip install -U hf_statecompose"
        )
    return enabled(model)


def _has_composed_cache(kwargs: dict) -> bool:
    return any(isinstance(value, hsc.ComposableMambaCache) for value in kwargs.values())


def generate(model, *args, **kwargs):
    """``model.generate(*args, **kwargs)`` with ``past_states=`` / ``composition=`` / ``attention=`` as
    :func:`hf_statecompose.enable` gives them, on the model as it is (a stock model is enabled for this call only).

    transformers calls it with the arguments of ``model.generate`` (``inputs``, ``generation_config``,
    ``max_new_tokens``, ...) by name, ``custom_generate`` and ``trust_remote_code`` left out."""
    if kwargs.get("past_states") is None:
        if hsc.is_enabled(model) and _has_composed_cache(kwargs):
            # an enabled model's generate composed the states already and passed them on as its cache (when this
            # call enabled a stock model, that generate keeps it enabled until it returns: so does this block)
            with _enabled(model):
                return model.generate(*args, **kwargs)
        raise ValueError(
            "custom_generate=hf_statecompose generates from composed context states: pass "
            "past_states=[state, ...] (each from hf_statecompose.encode(model, context_ids), or a state file / store), "
            "with composition= (default 'picaso_r'); without states, call generate without custom_generate"
        )
    with _enabled(model):  # a stock model enabled until the last overlapping call returns, then as it was
        return model.generate(*args, **kwargs)
