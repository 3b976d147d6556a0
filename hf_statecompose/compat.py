"""The one module that knows transformers' internals: every name, signature and private hook of transformers
that this package relies on beyond its documented public API is read here, and version checks live here and
nowhere else. When transformers moves, this module (and its tests, ``tests/test_compat.py``) is what changes.

What it covers:

* **The tested range** (:data:`TESTED_TRANSFORMERS`): ``import hf_statecompose`` on a transformers outside it
  warns once (:func:`warn_if_untested`), naming the range.
* **The cache's name.** transformers 5.24 renamed the Mamba-family argument and output field ``cache_params``
  to ``cache`` (``cache_params`` stays accepted, deprecated, until 5.40). :data:`CACHE_ARG` is the name the
  installed release's mixers, blocks, models and ``generate`` use; :func:`pop_cache` takes a cache passed under
  either name (users' code written for either release keeps working); :func:`output_cache` reads it from a
  model output; :func:`cache_output` makes this package's output dataclasses carry it under the installed
  release's name with the other name readable too.
* **The cache layer.** :class:`SSMLayerBase` is transformers' ``LinearAttentionLayer`` (what a ``DynamicCache``
  holds for an SSM layer) seen through a small accessor API (``ssm_state``, ``conv_state``, ``filled``,
  :meth:`~SSMLayerBase.fill`), with the batch operations transformers' generation calls on layers
  (``batch_repeat_interleave``, ``batch_select_indices``) that ``LinearAttentionLayer`` lacks. Subclasses
  (``hf_statecompose.state.layers``) add what composition needs and extend the batch operations, so that
  transformers' own ``reorder_cache`` / ``offload`` / ``prefetch`` / ``reset`` keep every tensor of a layer
  consistent by construction.
* **Where transformers' models live** (:func:`modeling_module`, :func:`load_class`): the architecture table
  (``state/architectures.py``) names, per architecture, the model classes whose stock ``forward`` / ``generate``
  must refuse ``past_states`` and the mixer class that ``enable`` swaps; this module turns those names into
  transformers' modules and classes.
* **The generation hook** (:class:`CacheGenerationMixin`): the private ``generate()`` methods that this
  package's own causal LMs override to keep their state cache.
* **Quiet entry points** (:func:`quiet_transformers`): the command line, the demo and ``load_demo`` run without
  transformers' "Loading weights" bars and its advice to install ``mamba_ssm`` / ``causal_conv1d`` (CUDA
  packages) when the CPU runs its reference PyTorch kernels; scoped, so that the user's logging stays theirs.
* **Tracing** (:func:`is_tracing`): whether a forward runs under ``torch.compile`` / ``torch.export`` (or on
  FakeTensors): the torch checks of transformers' own ``is_tracing``, so that eager-only work (hashing the
  weights' bytes for a state's fingerprint, ctypes kernels, data-dependent shortcuts) stays out of a traced
  graph, as transformers' models keep theirs out.

Importing this module is light (standard library only): the names that need transformers load on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import re
import types
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Any

logger = logging.getLogger("hf_statecompose")

# [lowest tested, first untested): the releases the test command runs (tests-lowest / tests-newest in noxfile.py)
TESTED_TRANSFORMERS = ("5.23", "5.26")
TESTED_TRANSFORMERS_TEXT = f">={TESTED_TRANSFORMERS[0]},<{TESTED_TRANSFORMERS[1]}"

# transformers' models live in transformers.models.<folder>.modeling_<folder>: the architecture table
# (hf_statecompose/state/architectures.py) names its transformers rows' modules through modeling_module()
_MODELING_MODULE = "transformers.models.{0}.modeling_{0}"


def modeling_module(folder: str) -> str:
    """The module of transformers' model ``folder`` (``"mamba2"`` -> ``transformers.models.mamba2.modeling_mamba2``)."""
    return _MODELING_MODULE.format(folder)


def load_class(module: str, name: str):
    """Class ``name`` of ``module`` (a modeling module of transformers' or of this package), or None if the
    installed release lacks it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # a release without that model
        return None


# the names a cache travels under: `cache` (transformers >= 5.24, every family), `cache_params` (the Mamba family
# before 5.24), `past_key_values` (the hybrids, as every attention model, before 5.24)
CACHE_NAMES = ("cache", "cache_params", "past_key_values")


def _release(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: '5.24.0.dev0' -> (5, 24, 0), '5.25' -> (5, 25)."""
    match = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


@functools.cache
def transformers_version() -> str | None:
    """The installed transformers' version string (None if it is not installed); read without importing it."""
    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def is_tested_transformers(text: str | None = None) -> bool:
    """Whether transformers ``text`` (default: the installed one) lies in :data:`TESTED_TRANSFORMERS`."""
    text = transformers_version() if text is None else text
    if text is None:
        return False
    low, high = (_release(v) for v in TESTED_TRANSFORMERS)
    return low <= _release(text) < high


_warned = False


def warn_if_untested() -> None:
    """Warn once (a ``UserWarning`` and the log) when the installed transformers is outside the tested range."""
    global _warned
    text = transformers_version()
    if _warned or text is None or is_tested_transformers(text):
        return
    _warned = True
    message = (
        f"hf_statecompose is tested with transformers {TESTED_TRANSFORMERS_TEXT}, but transformers {text} is "
        f"installed: it reads transformers' cache and mixer internals, which change between releases. Install a "
        f"tested release (pip install 'transformers{TESTED_TRANSFORMERS_TEXT}')"
    )
    warnings.warn(message, UserWarning, stacklevel=3)


def cache_is_renamed(text: str | None = None) -> bool:
    """transformers >= 5.24 names the Mamba-family cache ``cache`` (argument and output field)."""
    text = transformers_version() if text is None else text
    return text is not None and _release(text) >= _release("5.24")


_cache_arg_name: str | None = None


def _cache_arg() -> str:
    # kept in a global (not an lru_cache, which torch.compile ignores and traces through) once known
    global _cache_arg_name
    if _cache_arg_name is None:
        _cache_arg_name = "cache" if cache_is_renamed() else "cache_params"
    return _cache_arg_name


def pop_cache(kwargs: dict, default=None):
    """Remove and return the cache passed in ``kwargs`` under either name (``cache`` or ``cache_params``).
    Both names with different values is refused, as transformers refuses it."""
    values = [value for value in (kwargs.pop(name) for name in CACHE_NAMES if name in kwargs) if value is not None]
    if len(values) > 1 and values[0] is not values[1]:
        raise ValueError("pass the cache once, as `cache` (or the older name `cache_params`), not both")
    return values[0] if values else default


def cache_parameter(function) -> str | None:
    """The name under which ``function`` (a stock ``forward`` of transformers') takes its cache on the installed
    release: the one of :data:`CACHE_NAMES` in its own signature (under the wrappers of ``deprecate_kwarg``, whose old
    names it renames to this one before the call), or None. A cache passed under another name is, for that forward,
    just another keyword argument: stock passes it on (to ``**kwargs``) and never reads it as its cache."""
    try:
        parameters = inspect.signature(without_deprecations(function)).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin or C function
        return None
    return next((name for name in CACHE_NAMES if name in parameters), None)


def cache_names_taken(function) -> tuple[str, ...]:
    """Every name under which ``function`` takes its cache on the installed release: its own
    (:func:`cache_parameter`) and the older names that its ``deprecate_kwarg`` wrappers rename to it (with a
    ``FutureWarning``), e.g. ``("cache", "cache_params")`` for a Mamba ``forward`` of 5.24."""
    own = cache_parameter(function)
    names = [own] if own is not None else []
    while function is not None:  # through every wrapper (can_return_tuple, ...) down to the function itself
        if not _is_deprecation_wrapper(function):
            function = getattr(function, "__wrapped__", None)
            continue
        cells = dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__)))
        if cells.get("new_name") in names and cells.get("old_name") in CACHE_NAMES:
            names.append(cells["old_name"])
        function = cells["func"]
    return tuple(names)


def resolve_cache(cache, kwargs: dict):
    """In a ``forward(..., cache=None, **kwargs)``: the cache, whether it came as ``cache`` or as ``cache_params``
    in ``kwargs`` (removed from them)."""
    return pop_cache({**{name: kwargs.pop(name) for name in CACHE_NAMES if name in kwargs}, "cache": cache})


def cache_given(kwargs: dict) -> bool:
    """Whether ``kwargs`` hold a cache under either name."""
    return any(kwargs.get(name) is not None for name in CACHE_NAMES)


def cache_kwargs(cache, hybrid: bool = False) -> dict:
    """``{name: cache}`` with the installed release's name for the cache argument of the Mamba family (or, with
    ``hybrid``, of the hybrid models: ``past_key_values`` before 5.24, ``cache`` since)."""
    if hybrid and not cache_is_renamed():
        return {"past_key_values": cache}
    return {_cache_arg(): cache}


def output_cache(output):
    """The cache of a model output (a ``ModelOutput`` of transformers' Mamba-family models or of this package's)."""
    for name in (_cache_arg(), *CACHE_NAMES):
        try:
            value = output[name] if isinstance(output, dict) else getattr(output, name)
        except (KeyError, AttributeError):
            continue
        return value
    return None


def cache_output(cls):
    """Class decorator for this package's ``ModelOutput`` subclasses: write the class with a field ``cache``;
    on transformers < 5.24 the field is named ``cache_params`` (what that release's ``generate`` looks for in
    outputs) and ``cache`` reads it; on >= 5.24 it is ``cache`` and ``cache_params`` stays readable (transformers'
    ``ModelOutput`` provides it). Then applies ``@dataclass``."""
    annotations = dict(inspect.get_annotations(cls))
    if "cache" not in annotations:
        raise TypeError(f"{cls.__name__} declares no `cache` field")
    if cache_is_renamed():
        return dataclasses.dataclass(cls)
    cls.__annotations__ = {("cache_params" if key == "cache" else key): value for key, value in annotations.items()}
    cls.cache_params = cls.__dict__.get("cache")
    if "cache" in cls.__dict__:
        delattr(cls, "cache")
    cls = dataclasses.dataclass(cls)
    cls.cache = property(lambda self: self.cache_params, doc="The cache (its name from transformers 5.24 on).")
    return cls


# what makes transformers' generate() assisted (speculative) decoding: a draft model, prompt lookup, early exit of the
# model itself, multi-token prediction heads (generate()'s arguments, and the same names in a GenerationConfig)
ASSISTED_GENERATION_ARGUMENTS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")


def refuse_assisted_generation(kwargs: dict, generation_config=None, *, starting_from: str) -> None:
    """Refuse assisted / speculative decoding (:data:`ASSISTED_GENERATION_ARGUMENTS` set in ``kwargs`` or in
    ``generation_config``) with one line that says why. Its verifier rolls the state back to the last accepted token
    after every draft: transformers 5.25 keeps the recurrent state after each token of a forward for that
    (``activate_past_recording`` / ``crop``), and before 5.25 refused stateful models. The state path here computes a
    layer's new state in one scan over the tokens (SSM state, conv window, ΣΔ, transitions) and keeps no such
    history, so a rollback would be wrong or fail; refused before any token is generated."""
    asked = [name for name in ASSISTED_GENERATION_ARGUMENTS if kwargs.get(name) not in (None, False)]
    if not asked and generation_config is not None:
        asked = [
            name
            for name in ASSISTED_GENERATION_ARGUMENTS[1:]
            if name not in kwargs and getattr(generation_config, name, None) not in (None, False)
        ]
    if asked:
        raise ValueError(
            f"assisted generation ({asked[0]}=...) cannot start from {starting_from}: its verifier rolls the state back "
            "to the last accepted token, which needs the recurrent state after every token, and the state path keeps "
            "none; generate without it, or pass the context's tokens before the query"
        )


def _make_deprecation_wrapper_code():
    """The code object of the wrapper that transformers' ``deprecate_kwarg`` puts around a method (every such
    wrapper shares it; its closure holds the wrapped function as ``func``), or None where it has no such wrapper."""
    try:
        from transformers.utils.deprecation import deprecate_kwarg
    except ImportError:  # pragma: no cover - both tested releases have it
        return None
    code = deprecate_kwarg("old", "999.0", new_name="new")(lambda new=None: new).__code__
    return code if "func" in code.co_freevars else None


# made once, on first use (enable's wrap_inside_deprecations, before any call of an enabled forward), then a plain
# global: the enabled forward reads it on every call, also inside torch.compile(fullgraph=True), whose tracer ignores
# functools.cache and would trace into deprecate_kwarg and break the graph. Not at import: it imports transformers
_UNSET = object()
_DEPRECATION_WRAPPER_CODE: Any = _UNSET


def _deprecation_wrapper_code():
    global _DEPRECATION_WRAPPER_CODE
    if _DEPRECATION_WRAPPER_CODE is _UNSET:
        _DEPRECATION_WRAPPER_CODE = _make_deprecation_wrapper_code()
    return _DEPRECATION_WRAPPER_CODE


def _is_deprecation_wrapper(function) -> bool:
    code = _deprecation_wrapper_code()
    return code is not None and getattr(function, "__code__", None) is code and function.__closure__ is not None


def wrap_inside_deprecations(function, wrap):
    """``wrap(inner)`` put where ``function``'s own body is: inside the wrappers of transformers' ``deprecate_kwarg``
    that ``function`` has (transformers 5.24 renames ``cache_params`` / ``past_key_values`` to ``cache`` with them),
    as a copy of those wrappers (``function`` itself is not changed). Their ``FutureWarning`` (``stacklevel=2``) then
    points at the line that called the method, the user's, not at this package's wrapper; and ``wrap`` sees the
    arguments under their new names. Without such wrappers: ``wrap(function)``."""
    if not _is_deprecation_wrapper(function):
        return wrap(function)
    at = function.__code__.co_freevars.index("func")
    cells = list(function.__closure__)
    inner = wrap_inside_deprecations(cells[at].cell_contents, wrap)
    cells[at] = types.CellType(inner)
    copy = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, tuple(cells)
    )
    functools.update_wrapper(copy, function)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__wrapped__ = inner  # introspection (inspect.signature) sees wrap's function
    return copy


def without_deprecations(function):
    """``function`` without the wrappers of transformers' ``deprecate_kwarg`` (for a method whose caller is already
    inside copies of them: :func:`wrap_inside_deprecations`)."""
    while _is_deprecation_wrapper(function):
        function = function.__closure__[function.__code__.co_freevars.index("func")].cell_contents
    return function


# transformers' advice when a CUDA kernel package (mamba_ssm, causal_conv1d) is missing and its reference PyTorch
# implementation runs instead (``use_kernel_func_from_hub_with_fallback``: logged on the first call of each kernel)
FALLBACK_LOGGER = "transformers.integrations.hub_kernels"
FALLBACK_NOTICE = "is falling back to its reference PyTorch implementation"


class _DropFallbackNotices(logging.Filter):
    """Drops transformers' kernel-fallback notices (:data:`FALLBACK_NOTICE`), lets every other record through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return FALLBACK_NOTICE not in record.getMessage()


@contextlib.contextmanager
def quiet_kernel_fallbacks():
    """Run a block without transformers' kernel-fallback notices ("``causal_conv1d_fn`` is falling back to its
    reference PyTorch implementation ... install ``causal_conv1d``"): advice to install CUDA packages, noise where
    this package's entry points run the models on the CPU. Only those records are dropped (a filter on
    :data:`FALLBACK_LOGGER`, removed on exit); every other warning of transformers' or this package's still shows.
    Standard library only: it does not import transformers (the command line enters it before its cheap checks).
    transformers logs each notice once per process (``warning_once``): one dropped here is not repeated later."""
    notices, drop = logging.getLogger(FALLBACK_LOGGER), _DropFallbackNotices()
    notices.addFilter(drop)
    try:
        yield
    finally:
        notices.removeFilter(drop)


@contextlib.contextmanager
def quiet_loading():
    """Run a block without transformers' (and the Hub's) progress bars, "Loading weights" included; the setting
    is restored on exit (nested uses included). This package's own progress bars are not transformers' and show."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_transformers():
    """:func:`quiet_kernel_fallbacks` and :func:`quiet_loading`: how this package's entry points (the demo,
    :func:`~hf_statecompose.demo.load_demo`, the command line, lm-eval's) run transformers, whose small checkpoints
    load in milliseconds and run on the CPU. Scoped: the user's logging and progress-bar settings stay theirs."""
    with quiet_kernel_fallbacks(), quiet_loading():
        yield


def is_tracing(tensor=None) -> bool:
    """Whether code runs while a graph is traced: ``torch.compile`` / ``torch.export`` (dynamo, strict or not),
    ``torch.jit`` tracing, or ``tensor`` is a FakeTensor (a fake-tensor mode without dynamo). What transformers'
    own ``is_tracing`` checks for torch, in about a tenth of its time (it also polls CUDA stream capture and jax):
    this runs on every op call, eager decoding included."""
    import torch

    from . import _torch_compat

    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    return tensor is not None and _torch_compat.is_fake_tensor(tensor)


def _make_ssm_layer_base():
    import torch
    from transformers.cache_utils import LinearAttentionLayer

    class SSMLayerBase(LinearAttentionLayer):
        """transformers' ``LinearAttentionLayer`` with one state (index 0), through accessors that hide its
        per-state dicts, plus the batch operations generation calls on layers. A subclass that carries more
        per-row tensors lists their attribute names in ``_row_tensors`` (each ``[B, ...]`` or None) and those
        follow every batch operation; ``_fixed_tensors`` (no batch dimension, e.g. ``A``) follow devices only."""

        _row_tensors: tuple[str, ...] = ()
        _fixed_tensors: tuple[str, ...] = ()

        def __init__(self):
            super().__init__(number_of_states=1)
            for name in self._row_tensors + self._fixed_tensors:
                setattr(self, name, None)

        # ------------------------------------------------------------------ accessors
        @property
        def ssm_state(self):
            return self.recurrent_states[0]

        @ssm_state.setter
        def ssm_state(self, value):
            self.recurrent_states[0] = value

        @property
        def conv_state(self):
            return self.conv_states[0]

        @conv_state.setter
        def conv_state(self, value):
            self.conv_states[0] = value

        @property
        def filled(self) -> bool:
            return bool(self.has_previous_state[0])

        def fill(self, ssm_state, conv_state) -> None:
            """Hold these tensors (assigned, not copied: autograd sees them) as the layer's state."""
            self.recurrent_states[0] = ssm_state
            self.conv_states[0] = conv_state
            self.is_recurrent_states_initialized[0] = True
            self.is_conv_states_initialized[0] = True
            self.has_previous_state[0] = True
            self.conv_kernel_size[0] = conv_state.shape[-1]
            self.dtype, self.device = conv_state.dtype, conv_state.device

        def set_seen_tokens(self, count) -> None:
            """transformers >= 5.25 counts the tokens a linear layer has seen (``cumulative_length_linear``, a 0-dim
            int64 tensor that its ``get_seq_length`` returns and its own updates advance in place): set it to
            ``count`` (a 0-dim tensor, copied). Before 5.25 layers count nothing: a no-op."""
            if "cumulative_length_linear" in self.__dict__:
                self.cumulative_length_linear = count.detach().to(dtype=torch.long).clone()

        def _map_row_tensors(self, fn, names=None) -> None:
            """``fn`` of each per-row tensor (or of ``names``) that is set."""
            for name in self._row_tensors if names is None else names:
                value = getattr(self, name)
                if value is not None:
                    setattr(self, name, fn(value))

        # ------------------------------------------------------------------ transformers' batch operations
        def reorder_cache(self, beam_idx):
            super().reorder_cache(beam_idx)
            self._map_row_tensors(lambda t: t.index_select(0, beam_idx.to(t.device)))

        def batch_select_indices(self, indices):
            if not self.filled:
                return
            self.ssm_state = self.ssm_state[indices]
            self.conv_state = self.conv_state[indices]
            self._map_row_tensors(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

        def batch_repeat_interleave(self, repeats: int):
            if not self.filled:
                return
            self.ssm_state = self.ssm_state.repeat_interleave(repeats, dim=0)
            self.conv_state = self.conv_state.repeat_interleave(repeats, dim=0)
            self._map_row_tensors(lambda t: t.repeat_interleave(repeats, dim=0))

        def offload(self):
            super().offload()
            self._map_row_tensors(lambda t: t.to("cpu", non_blocking=True), self._row_tensors + self._fixed_tensors)

        def prefetch(self):
            super().prefetch()
            if self.device is None:
                return
            self._map_row_tensors(
                lambda t: t.to(self.device, non_blocking=True) if t.device != self.device else t,
                self._row_tensors + self._fixed_tensors,
            )

        def reset(self) -> None:
            """transformers' reset: zero states, no previous state; the per-row extras are forgotten with them."""
            super().reset()
            for name in self._row_tensors:
                setattr(self, name, None)

    SSMLayerBase.__module__, SSMLayerBase.__qualname__ = __name__, "SSMLayerBase"
    return SSMLayerBase


def _make_attention_layer_base():
    import torch
    from transformers.cache_utils import DynamicLayer

    class AttentionLayerBase(DynamicLayer):
        """transformers' ``DynamicLayer`` (an attention layer's keys and values, ``[B, heads, L, head_dim]``) that
        also holds the position each key was encoded (and, for RoPE, rotated) at: ``positions`` ``[B, L]`` int64,
        -1 where the slot is padding. transformers' attention calls :meth:`update` with the new keys and values
        only (no positions): the new slots get the positions after the row's last one (taken as real tokens).
        The batch operations generation calls on layers keep ``positions`` with its rows."""

        _row_tensors: tuple[str, ...] = ("positions",)
        _fixed_tensors: tuple[str, ...] = ()

        def __init__(self):
            DynamicLayer.__init__(self)
            self.positions = None

        @property
        def has_keys(self) -> bool:
            return bool(self.is_initialized) and self.keys is not None and self.keys.dim() == 4

        def fill_keys(self, keys, values, positions) -> None:
            """Hold these keys, values and positions (assigned, not copied) as the layer's."""
            self.keys, self.values, self.positions = keys, values, positions
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = DynamicLayer.update(self, key_states, value_states, *args, **kwargs)
            batch, length = key_states.shape[0], key_states.shape[-2]
            step = torch.arange(length, device=key_states.device)
            if self.positions is None or self.positions.shape[-1] + length != keys.shape[-2]:
                self.positions = step.expand(batch, length).clone() if keys.shape[-2] == length else None
            else:
                last = (
                    self.positions.max(dim=-1, keepdim=True).values.clamp(min=-1)
                    if self.positions.shape[-1]
                    else self.positions.new_full((self.positions.shape[0], 1), -1)
                )
                self.positions = torch.cat([self.positions, last + 1 + step], dim=-1)
            return keys, values

        def _map_positions(self, fn) -> None:
            if self.positions is not None:
                self.positions = fn(self.positions)

        def reorder_cache(self, beam_idx):
            DynamicLayer.reorder_cache(self, beam_idx)
            self._map_positions(lambda t: t.index_select(0, beam_idx.to(t.device)))

        def batch_select_indices(self, indices):
            DynamicLayer.batch_select_indices(self, indices)
            self._map_positions(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

        def batch_repeat_interleave(self, repeats: int):
            DynamicLayer.batch_repeat_interleave(self, repeats)
            self._map_positions(lambda t: t.repeat_interleave(repeats, dim=0))

        def crop(self, tokens_to_remove: int) -> None:
            DynamicLayer.crop(self, tokens_to_remove)
            if self.positions is not None and self.keys is not None:
                self.positions = self.positions[:, : self.keys.shape[-2]]

        def offload(self):
            DynamicLayer.offload(self)
            self._map_positions(lambda t: t.to("cpu", non_blocking=True))

        def prefetch(self):
            DynamicLayer.prefetch(self)
            if self.device is not None:
                self._map_positions(lambda t: t.to(self.device, non_blocking=True))

        def reset(self) -> None:
            DynamicLayer.reset(self)
            self.positions = None

    AttentionLayerBase.__module__, AttentionLayerBase.__qualname__ = __name__, "AttentionLayerBase"
    return AttentionLayerBase


def _make_ssm_attention_layer_base():
    ssm, attention = _lazy("SSMLayerBase"), _lazy("AttentionLayerBase")

    class SSMAttentionLayerBase(ssm, attention):
        """One layer with both an SSM state and attention keys / values (transformers'
        ``LinearAttentionAndFullAttentionLayer``: Falcon-H1's parallel layers, Zamba2's hybrid layers): the SSM
        accessors of :class:`SSMLayerBase` and the keys, values and positions of :class:`AttentionLayerBase`,
        each batch operation applied to both parts."""

        _row_tensors = ssm._row_tensors + attention._row_tensors

        def __init__(self):
            attention.__init__(self)
            ssm.__init__(self)

        def lazy_initialization(self, *args, **kwargs) -> None:
            # as transformers' LinearAttentionAndFullAttentionLayer: keys / values come as 2 positional args
            if len(args) == 2 and not kwargs:
                attention.lazy_initialization(self, *args)
            else:
                ssm.lazy_initialization(self, *args, **kwargs)

        def update(self, key_states, value_states, *args, **kwargs):
            return attention.update(self, key_states, value_states, *args, **kwargs)

        def reorder_cache(self, beam_idx):
            ssm.reorder_cache(self, beam_idx)
            attention.reorder_cache(self, beam_idx)

        def batch_select_indices(self, indices):
            ssm.batch_select_indices(self, indices)
            attention.batch_select_indices(self, indices)

        def batch_repeat_interleave(self, repeats: int):
            ssm.batch_repeat_interleave(self, repeats)
            attention.batch_repeat_interleave(self, repeats)

        def crop(self, tokens_to_remove: int) -> None:
            attention.crop(self, tokens_to_remove)

        def offload(self):
            ssm.offload(self)
            attention.offload(self)

        def prefetch(self):
            ssm.prefetch(self)
            attention.prefetch(self)

        def reset(self) -> None:
            ssm.reset(self)
            attention.reset(self)

        def get_seq_length(self) -> int:
            return attention.get_seq_length(self)

        def get_mask_sizes(self, query_length: int):
            return attention.get_mask_sizes(self, query_length)

        def get_max_length(self) -> int:
            return -1

    SSMAttentionLayerBase.__module__, SSMAttentionLayerBase.__qualname__ = __name__, "SSMAttentionLayerBase"
    return SSMAttentionLayerBase


def _make_empty_layer():
    import transformers.cache_utils as cache_utils

    dummy = getattr(cache_utils, "DummyLayer", None)
    if dummy is None:  # pragma: no cover - both tested releases have it
        raise ImportError(
            "transformers.cache_utils.DummyLayer is missing: this transformers is outside the tested range"
        )
    return dummy


def _make_generation_mixin():
    import torch
    from transformers.generation import GenerationMixin

    class CacheGenerationMixin(GenerationMixin):
        """``generate()`` for a model whose whole state is one cache object that the model makes itself
        (``self._hsc_empty_cache()``), passed under the release's cache name. transformers makes such a cache
        only for classes it knows as Mamba-like; here, as it does for Mamba, a user's cache is kept, else an
        empty one is made. After the prompt every token fed is real, so the attention mask is dropped from the
        decoding steps."""

        def _hsc_empty_cache(self):  # pragma: no cover - the model class provides it
            raise NotImplementedError

        @functools.wraps(GenerationMixin.generate)  # generate()'s own signature (past_states binds arguments to it)
        def generate(self, *args, **kwargs):
            # a model that always runs on this package's cache: no assisted decoding (its rollback needs a history of
            # states that the cache does not keep); transformers < 5.25 refused it through `_is_stateful`
            refuse_assisted_generation(
                kwargs,
                kwargs.get("generation_config") or self.generation_config,
                starting_from=f"a {type(self).__name__}'s state cache",
            )
            return super().generate(*args, **kwargs)

        def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
            cache = pop_cache(model_kwargs)
            if cache is not None:
                if generation_config.cache_implementation is not None:
                    raise ValueError("Passing both `cache_implementation` and a cache is unsupported; use one")
                cache._is_user_defined = True
            elif generation_config.use_cache is not False:
                cache = self._hsc_empty_cache()
            if cache is not None:
                model_kwargs.update(cache_kwargs(cache))

        # transformers 5.23 types GenerationMixin's method (its own signature, self a GenerativePreTrainedModel);
        # 5.24 does not: the ignores cover 5.23 and are allowed to be unused on 5.24
        def prepare_inputs_for_generation(  # type: ignore[override, unused-ignore]
            self,
            input_ids,
            inputs_embeds=None,
            use_cache=None,
            cache=None,
            cache_params=None,
            attention_mask: torch.LongTensor | None = None,
            is_first_iteration: bool | None = False,
            **kwargs,
        ):
            # both names in the signature: generate() validates its model kwargs against it
            cache = pop_cache({"cache": cache, "cache_params": cache_params})
            model_inputs = super().prepare_inputs_for_generation(  # type: ignore[misc, unused-ignore]
                input_ids,
                inputs_embeds=inputs_embeds,
                use_cache=use_cache,
                attention_mask=attention_mask,
                is_first_iteration=is_first_iteration,
                **cache_kwargs(cache),
                **kwargs,
            )
            if use_cache and not is_first_iteration:
                model_inputs["attention_mask"] = None  # after the prompt every token fed is real
            return model_inputs

    CacheGenerationMixin.__module__, CacheGenerationMixin.__qualname__ = __name__, "CacheGenerationMixin"
    return CacheGenerationMixin


_LAZY = {
    "CACHE_ARG": _cache_arg,
    "SSMLayerBase": _make_ssm_layer_base,
    "AttentionLayerBase": _make_attention_layer_base,
    "SSMAttentionLayerBase": _make_ssm_attention_layer_base,
    "EmptyLayer": _make_empty_layer,
    "CacheGenerationMixin": _make_generation_mixin,
    "Cache": lambda: importlib.import_module("transformers.cache_utils").Cache,
    "DynamicCache": lambda: importlib.import_module("transformers.cache_utils").DynamicCache,
    "LinearAttentionLayer": lambda: importlib.import_module("transformers.cache_utils").LinearAttentionLayer,
}


def _lazy(name: str):
    """A lazily made name, made once (a second ``__getattr__`` call would make a second class)."""
    return globals()[name] if name in globals() else __getattr__(name)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _LAZY[name]()
    globals()[name] = value
    return value
