"""hf_statecompose as a transformers ``custom_generate`` method: generation from composed context states on a stock,
never-enabled Mamba / Mamba-2 / hybrid model.

    out = model.generate(query_ids, custom_generate="<this repository or folder>", trust_remote_code=True,
                         past_states=[state, ...], composition="picaso_r", max_new_tokens=32)

is ``hf_statecompose.enable(model)`` followed by ``model.generate(query_ids, past_states=..., composition=...)``,
token for token, and leaves the model as it was: it is enabled for the call only (``enable`` swaps the classes of the
model and of its SSM mixers and sets the mixers' backend, nothing else) and given back its classes and backend when
the call ends, also when it fails. A model the user enabled stays enabled and is used as it is.

Enabled in place, not through a copy: the states are checked against the model's fingerprint, which is cached per
model object (a copy would hash every weight again on each call), and a copy would share the mixers whose classes
``enable`` swaps anyway.

transformers loads this file with ``trust_remote_code=True`` (it runs on the caller's machine) after checking
``requirements.txt`` beside it; it uses only hf_statecompose's public API.
"""

from __future__ import annotations

import contextlib
import threading

import hf_statecompose as hsc

# id(model) -> [the number of calls of this function running on it, what to restore when the last one ends]: the
# first call enables the model, the last one restores it, so that concurrent calls never disable it under each other
_ENABLED_HERE: dict[int, list] = {}
_LOCK = threading.Lock()


def _as_it_is(model):
    """What the call may change and gives back: every module's class (``enable`` swaps the model's class and its
    SSM mixers'; ``hsc.encode`` leaves the mixers swapped on a model it ran) and the state-path backend."""
    backend = None
    with contextlib.suppress(TypeError):  # an unsupported model: enable says so, listing the supported ones
        backend = hsc.get_backend(model)
    return [(module, type(module)) for module in model.modules()], backend


def _restore(model, before) -> None:
    classes, backend = before
    with contextlib.suppress(TypeError):  # an unsupported model: enable refused it before it changed anything
        hsc.disable(model)  # the stock classes (and accelerate's hooks pointed at them again)
    for module, cls in classes:
        if type(module) is not cls:  # mixers that hsc.encode had swapped before this call
            module.__class__ = cls
    if backend is not None:
        hsc.set_backend(model, backend)  # (disable drops it)


@contextlib.contextmanager
def _enabled_for_the_call(model):
    """``model`` enabled inside the block, and afterwards exactly as it was. A model the user enabled is used as it is."""
    key = id(model)
    with _LOCK:
        ours = key in _ENABLED_HERE or not hsc.is_enabled(model)
        if ours and key not in _ENABLED_HERE:
            before = _as_it_is(model)
            try:
                hsc.enable(model)  # an unsupported model: the package's TypeError, listing the supported ones
            except BaseException:
                _restore(model, before)
                raise
            _ENABLED_HERE[key] = [0, before]
        if ours:
            _ENABLED_HERE[key][0] += 1
    try:
        yield
    finally:
        if ours:
            with _LOCK:
                _ENABLED_HERE[key][0] -= 1
                if _ENABLED_HERE[key][0] == 0:
                    _restore(model, _ENABLED_HERE.pop(key)[1])


def _has_composed_cache(kwargs: dict) -> bool:
    return any(isinstance(value, hsc.ComposableMambaCache) for value in kwargs.values())


def generate(model, *args, **kwargs):
    """``model.generate(*args, **kwargs)`` with ``past_states=`` / ``composition=`` / ``attention=`` as
    :func:`hf_statecompose.enable` gives them, on the model as it is (a stock model is enabled for this call only).

    transformers calls it with the arguments of ``model.generate`` (``inputs``, ``generation_config``,
    ``max_new_tokens``, ...) by name, ``custom_generate`` and ``trust_remote_code`` left out."""
    if kwargs.get("past_states") is None:
        if hsc.is_enabled(model) and _has_composed_cache(kwargs):
            # an enabled model's generate composed the states already and passed them on as its cache
            return model.generate(*args, **kwargs)
        raise ValueError(
            "custom_generate=hf_statecompose generates from composed context states: pass "
            "past_states=[state, ...] (each from hf_statecompose.encode(model, context_ids), or a state file / store), "
            "with composition= (default 'picaso_r'); without states, call generate without custom_generate"
        )
    with _enabled_for_the_call(model):
        return model.generate(*args, **kwargs)
