"""The state-aware mixer classes and the choice of kernels (backend) per model.

:func:`enable_state_path` swaps each transformers mixer's class for a subclass whose ``forward`` runs
our initial-state-aware path (``mamba.py`` / ``mamba2.py`` beside this file) when the cache it is given (``cache``,
``cache_params`` before transformers 5.24) is a ``ComposableMambaCache``; any other call goes to the stock forward untouched.
Which forward runs for which stock mixer class is the architecture table's (``mixer_class`` / ``mixer_forward`` of
each row in ``state/architectures.py``).

The subclasses are made at run time (one per stock mixer class, cached), so pickle cannot find them by
name: each reduces itself to :func:`_new_state_aware_mixer` and the stock class, importable names that
re-create the state-aware mixer on load. That is what lets ``copy.deepcopy``, ``pickle`` and
``torch.save`` of a model with these mixers work.

A mixer class with ``_hsc_runs_on_cache = True`` (SeRpEnt-Mamba's ``SeRpEntMixer``, COFFEE's
``CoffeeSequenceMixer``) always runs on this
package's cache: it is left as it is, and reads the backend from its ``_hsc_backend`` attribute.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from .. import compat
from ..ops.backends import check_backend_name
from ..state.architectures import ARCHITECTURES, architecture
from ..state.cache import ComposableMambaCache
from ..state.fingerprint import architecture_of, base_model_of

_COMPOSABLE_MIXER_CLASSES: dict[type, type] = {}


class _StateAwareMixer:
    """Base of every ``Composable<Mixer>`` class: lets instances survive pickle / deepcopy."""

    _hsc_stock_class: type

    def __reduce_ex__(self, protocol):
        # the class itself cannot be pickled by name (made by type() at run time): rebuild it from the stock class
        return _new_state_aware_mixer, (self._hsc_stock_class,), self.__getstate__()


def _new_state_aware_mixer(base: type):
    """An empty instance of the state-aware subclass of ``base`` (pickle then restores its ``__dict__``)."""
    cls: Any = _composable_mixer_class(base)
    return cls.__new__(cls)


def _composable_mixer_class(base: type) -> type:
    if base not in _COMPOSABLE_MIXER_CLASSES:
        path = _path_for(base)
        # the name the stock forward takes its cache under on the installed release (`cache` from transformers 5.24,
        # `cache_params` before): a cache under another name is, for stock, an unknown keyword that it passes on and
        # never reads, so this forward does not read it either (it passes it on too)
        stock: Any = base
        name = compat.cache_parameter(stock.forward)
        stock_forward = compat.without_deprecations(stock.forward)

        def forward(self, hidden_states, *args, **kwargs):
            # the stock signature is (hidden_states, cache, attention_mask); this runs inside copies of the stock
            # forward's deprecation wrappers, so an old name the stock forward renames has been renamed already
            args = list(args)
            if args:
                cache = args.pop(0)
            elif name is not None:
                cache = kwargs.pop(name, None)
            else:  # pragma: no cover - every stock mixer of the table names its cache
                cache = compat.pop_cache(kwargs)
            attention_mask = args.pop(0) if args else kwargs.pop("attention_mask", None)
            if not isinstance(cache, ComposableMambaCache):
                cache_kwargs = {name: cache} if name is not None else compat.cache_kwargs(cache)
                return stock_forward(
                    self, hidden_states, *args, attention_mask=attention_mask, **cache_kwargs, **kwargs
                )
            length = hidden_states.shape[1]
            mask = None
            if attention_mask is not None and attention_mask.dim() == 2 and length > 1:
                mask = attention_mask[:, -length:]
                mask = None if bool((mask == 1).all()) else mask.to(hidden_states.dtype)
            out = path(self, hidden_states, cache, mask)
            if self.layer_idx == _first_ssm_layer(cache):
                count = mask.sum(-1) if mask is not None else torch.full((hidden_states.shape[0],), length)
                cache.add_tokens(count.to(device=hidden_states.device))
            return out

        _COMPOSABLE_MIXER_CLASSES[base] = type(
            f"Composable{base.__name__}",
            (_StateAwareMixer, base),
            {
                "forward": compat.wrap_inside_deprecations(stock.forward, lambda _: forward),
                "_hsc_stock_class": base,
            },
        )
    return _COMPOSABLE_MIXER_CLASSES[base]


class _KernelizedForward:
    """The ``forward`` of a mixer whose forward was replaced on the instance (Hub kernels, see
    :func:`_route_instance_forward`): a call on this package's cache runs the state-aware class's forward (the state
    path), any other call the instance's forward, as the model ran it before ``enable``."""

    def __init__(self, mixer, instance_forward):
        self.mixer = mixer
        self.instance_forward = instance_forward

    def __call__(self, hidden_states, *args, **kwargs):
        # where the class forward finds the cache: the first positional argument, else a name the stock forward
        # takes it under on the installed release (compat.cache_names_taken)
        names = compat.cache_names_taken(self.mixer._hsc_stock_class.forward)
        cache = args[0] if args else next((kwargs[n] for n in names if kwargs.get(n) is not None), None)
        if isinstance(cache, ComposableMambaCache):
            return type(self.mixer).forward(self.mixer, hidden_states, *args, **kwargs)
        return self.instance_forward(hidden_states, *args, **kwargs)


def _route_instance_forward(mixer) -> None:
    """Keep the state path of a mixer whose ``forward`` was replaced on the instance.

    transformers kernelizes a model at load (``from_pretrained(use_kernels=...)``, on by default from 5.25 unless
    ``USE_HUB_KERNELS=0``): the ``kernels`` package's ``kernelize`` binds a Hub layer's forward on each module whose
    layer it maps on that device (``module.forward = MethodType(layer.forward, module)``; e.g. Qwen3.5's
    GatedDeltaNet on sm_121 / gfx1151 GPUs). An instance attribute shadows the class, so the class swap of
    :func:`enable_state_path` alone would leave such a mixer off the state path (states silently ignored). The
    instance forward is kept for every call that is not on this package's cache; re-kernelizing (``model.train()``
    switches kernels' mode) rebinds it, and the next ``enable`` / ``encode`` routes it again."""
    instance_forward = mixer.__dict__.get("forward")
    if instance_forward is not None and not isinstance(instance_forward, _KernelizedForward):
        mixer.__dict__["forward"] = _KernelizedForward(mixer, instance_forward)


def _first_ssm_layer(cache) -> int:
    """The model layer of the first SSM state layer: its mixer counts the tokens (a hybrid's first layer may be attention)."""
    indices = getattr(cache, "ssm_layer_indices", None)
    return indices[0] if indices else 0


def ssm_mixers(model) -> list:
    """The SSM mixer modules of ``model``'s layers, in layer order (a hybrid's attention / MLP layers have none)."""
    backbone = base_model_of(model)
    layout = architecture(architecture_of(model))
    if not layout.is_hybrid:
        return [block.mixer for block in backbone.layers]
    return [mixer for mixer in (layout.mixer_of(block) for block in backbone.layers) if mixer is not None]


def stock_mixer_classes(imported_only: bool = False) -> dict:
    """model_type -> the stock mixer class that ``enable`` swaps, for every row of the architecture table that has
    one and whose model the installed transformers has (``imported_only``: only the rows whose module is imported
    already, without importing the others)."""
    classes = {
        name: row.stock_mixer_class()
        for name, row in ARCHITECTURES.items()
        if row.mixer_class is not None and (not imported_only or row.model_module in sys.modules)
    }
    return {name: cls for name, cls in classes.items() if cls is not None}


def _path_for(mixer_class: type):
    """Our forward for a stock mixer class (or None if it is not one we know): the ``mixer_forward`` of the row whose
    stock mixer it is (or, failing that, the first row whose stock mixer it subclasses). A mixer's class and its
    bases are imported: the rows of modules not imported yet cannot be its."""
    stock = stock_mixer_classes(imported_only=True)
    found = next((name for name, cls in stock.items() if cls is mixer_class), None)
    if found is None:
        found = next((name for name, cls in stock.items() if issubclass(mixer_class, cls)), None)
    return None if found is None else ARCHITECTURES[found].mixer_forward_function()


def enable_state_path(model, backend: str | None = None):
    """Swap ``model``'s mixers for the state-aware ones (idempotent). ``backend``: see :func:`set_backend`;
    ``None`` keeps the model's current choice (``"auto"`` the first time)."""
    architecture_of(model)  # raises a clear TypeError for other models
    backbone = base_model_of(model)
    # a model whose states cannot be composed says why (COFFEE with a baseline mixer or the linear feedback gate)
    unsupported = getattr(backbone, "_hsc_states_unsupported", None)
    reason = unsupported() if callable(unsupported) else None
    if reason:
        raise TypeError(f"{type(model).__name__}: {reason}")
    if backend is not None or get_backend(model) is None:
        set_backend(model, "auto" if backend is None else backend)
    for mixer in ssm_mixers(model):
        base = type(mixer)
        if getattr(mixer, "_hsc_runs_on_cache", False):
            continue
        if not isinstance(mixer, _StateAwareMixer):
            if _path_for(base) is None:
                raise TypeError(
                    f"unsupported mixer {base.__name__}; expected one of the architecture table's: "
                    f"{', '.join(cls.__name__ for cls in stock_mixer_classes().values())}"
                )
            mixer.__class__ = _composable_mixer_class(base)
        _route_instance_forward(mixer)
    return model


def state_path_enabled(model) -> bool:
    """Whether ``model``'s mixers are the state-aware ones."""
    return all(
        isinstance(mixer, _StateAwareMixer) or getattr(mixer, "_hsc_runs_on_cache", False)
        for mixer in ssm_mixers(model)
    )


def disable_state_path(model):
    """Give the mixers their stock classes back, and drop the backend choice: the mixers are stock again."""
    for mixer in ssm_mixers(model):
        if isinstance(mixer, _StateAwareMixer):
            mixer.__class__ = mixer._hsc_stock_class
        routed = mixer.__dict__.get("forward")
        if isinstance(routed, _KernelizedForward):  # the Hub kernel's forward, as the load left it
            mixer.__dict__["forward"] = routed.instance_forward
        mixer.__dict__.pop("_hsc_backend", None)
    return model


def get_backend(model) -> str | None:
    """The backend the state-aware path of an enabled model uses (None before it is enabled, and for a hybrid
    configured without SSM layers: no mixer to run it)."""
    mixers = ssm_mixers(model)
    return getattr(mixers[0], "_hsc_backend", None) if mixers else None


def set_backend(model, backend: str):
    """Choose the kernels (``"auto"``, ``"torch"``, ``"triton"``) of the state-aware path of ``model``."""
    check_backend_name(backend)
    for mixer in ssm_mixers(model):
        object.__setattr__(mixer, "_hsc_backend", backend)
    return model


@contextlib.contextmanager
def using_backend(model, backend: str | None):
    """Temporarily run ``model``'s state-aware path on ``backend`` (None: leave it as it is)."""
    if backend is None:
        yield model
        return
    previous = get_backend(model)
    set_backend(model, backend)
    try:
        yield model
    finally:
        set_backend(model, previous or "auto")


def refuse_layer_checkpointing(model):
    """transformers' layer checkpointing replays each layer in the backward pass with the cache it was
    given, which our mixers have updated by then: the replay would start from the wrong state and the
    gradients would be silently wrong (and transformers >= 5.24 drops the cache from checkpointed layers, so the
    state would silently stay empty). Refuse instead."""
    if not (model.training and torch.is_grad_enabled()):
        return
    if any(getattr(layer, "gradient_checkpointing", False) for layer in base_model_of(model).layers):
        raise ValueError(
            "gradient checkpointing of the layers (model.activation_checkpointing_enable()) cannot be combined with "
            "past_states or a ComposableMambaCache while training: the backward replay would start from the updated "
            "state. Disable it (model.activation_checkpointing_disable()) and, to save memory on the contexts, use "
            "hf_statecompose.training.composition_loss(..., checkpoint_contexts=True)"
        )
