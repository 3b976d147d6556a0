"""What ``import hf_statecompose`` sets up without importing torch: post-import hooks (standard library only).

* :func:`when_imported` runs a callback right after a module has been executed (or at once if it
  already has been), so that work which needs a heavy module happens only if someone imports it.
* :func:`refuse_past_states` makes the *stock* ``forward`` / ``generate`` of transformers' Mamba and
  Mamba-2 classes refuse ``past_states=``: their ``**kwargs`` would otherwise swallow it, and a model
  that was never given :func:`hf_statecompose.enable` would silently run without its contexts.
  ``enable`` consumes ``past_states`` before it calls the stock method, so an enabled model never
  reaches the refusal; calls without ``past_states`` go to the stock method unchanged, and so does a
  ``generate`` call that names ``custom_generate`` (:func:`refuses`).

This module sits outside the layers (it is part of the root package's import): it imports nothing
from ``hf_statecompose`` and nothing beyond the standard library.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading

logger = logging.getLogger("hf_statecompose")

# module -> the classes whose stock forward / generate must refuse past_states (set by install(), from the
# architecture table: hf_statecompose.state.architectures.guarded_classes())
GUARDED: dict[str, tuple[str, ...]] = {}
_MARK = "_hf_statecompose_guard"
# how a guard is put around a stock method: (method, make_guard) -> the guarded method. install() is given
# hf_statecompose.compat.wrap_inside_deprecations, which puts the guard inside transformers' deprecation wrappers, so
# that their warnings keep pointing at the caller's line (the names of transformers' internals are the adapter's)
_wrap = None


class _PostImportFinder:
    """A ``sys.meta_path`` finder that finds nothing itself: for a watched module it asks the other
    finders for the spec and patches that spec's own loader instance so that ``exec_module`` runs the
    callbacks afterwards (the loader object stays the same, so ``__loader__``, ``get_source`` and
    resource readers are untouched). Any other name costs one dict lookup."""

    def __init__(self) -> None:
        self.pending: dict[str, list] = {}
        self.lock = threading.RLock()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        own = getattr(loader, "__dict__", None)
        # only a loader *instance* with its own attributes (a class such as BuiltinImporter serves every
        # module of its kind); a module without such a loader is imported untouched, without the callback
        if loader is None or isinstance(loader, type) or not isinstance(own, dict) or "exec_module" in own:
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            if module.__name__ == fullname:  # a loader shared by several modules (a zip): only ours
                own.pop("exec_module", None)
                self.run(fullname, module)

        own["exec_module"] = exec_module
        return spec

    def run(self, name, module) -> None:
        with self.lock:
            callbacks = self.pending.pop(name, [])
            if not self.pending and self in sys.meta_path:  # nothing left to watch: stop looking at every import
                sys.meta_path.remove(self)
        for callback in callbacks:
            _call(callback, module)


def _call(callback, module) -> None:
    try:
        callback(module)
    except Exception as error:  # a hook of ours must never break someone else's import
        logger.warning("hf_statecompose: post-import hook %r for %s failed: %r", callback, module.__name__, error)


_finder = _PostImportFinder()


def when_imported(name: str, callback) -> None:
    """Run ``callback(module)`` once, right after module ``name`` has been executed; at once if it already was.

    (A module caught half-executed, in an import cycle, keeps its loader: the callback then waits for a
    later import of the same name, which does not happen; no module watched here imports this package.)"""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        _call(callback, module)
        return
    with _finder.lock:
        _finder.pending.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def refusal(cls_name: str, method: str) -> str:
    return (
        f"{cls_name}.{method}() got past_states, but past_states needs hf_statecompose.enable(model) first: "
        "this model was never enabled (or was disabled), so it would ignore the states and silently run without "
        "any context. Call `model = hf_statecompose.enable(model)` once after loading it"
    )


def refuses(method: str, kwargs: dict) -> bool:
    """Whether a call of a never-enabled model's stock ``method`` with keyword arguments ``kwargs`` is refused:
    it passes ``past_states``, unless it is a ``generate`` call that names ``custom_generate``. transformers'
    ``generate`` hands every argument of such a call to that function (the repository's
    ``custom_generate/generate.py``, which runs the states on an enabled model, or a callable), so the states are
    not swallowed: a function that does not take them leaves them in the model's keyword arguments, where
    transformers refuses unused ones and the stock ``forward``'s own guard refuses ``past_states``."""
    if kwargs.get("past_states") is None:
        return False
    return not (method == "generate" and kwargs.get("custom_generate") is not None)


def _refusing(cls, method: str) -> None:
    original = getattr(cls, method, None)
    if original is None or getattr(original, _MARK, False):
        return

    def guard(inner):
        @functools.wraps(inner)
        def guarded(self, *args, **kwargs):
            if refuses(method, kwargs):
                raise ValueError(refusal(type(self).__name__, method))
            return inner(self, *args, **kwargs)

        return guarded

    # the guard adds a frame between the caller and the stock method: placed inside the method's own wrappers
    # (_wrap), a warning those wrappers give about the caller's arguments still points at the caller's line
    guarded = guard(original) if _wrap is None else _wrap(original, guard)
    setattr(guarded, _MARK, True)
    setattr(cls, method, guarded)


def refuse_past_states(module) -> None:
    """Guard the stock ``forward`` (and ``generate``) of the Mamba classes of a transformers modeling module."""
    for cls_name in GUARDED.get(module.__name__, ()):
        cls = getattr(module, cls_name, None)
        if cls is None:
            continue
        _refusing(cls, "forward")
        if hasattr(cls, "generate"):
            _refusing(cls, "generate")


def install(guarded: dict[str, tuple[str, ...]], wrap=None) -> None:
    """Guard the classes ``guarded`` names (module -> class names) when (and if) their module is imported.
    ``wrap(method, make_guard)``, if given (once is enough), puts each guard inside the method's own wrappers."""
    global _wrap
    if wrap is not None:
        _wrap = wrap
    for module, names in guarded.items():
        GUARDED[module] = tuple(dict.fromkeys(GUARDED.get(module, ()) + tuple(names)))
    for name in guarded:
        when_imported(name, refuse_past_states)
