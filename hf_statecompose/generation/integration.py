"""``enable(model)``: ``past_states=`` for ``generate`` and ``forward`` of the models of the architecture table.

What ``enable`` changes, and why it changes nothing else:

* each mixer's class is swapped for a subclass whose ``forward`` runs our initial-state-aware path
  (:mod:`hf_statecompose.models`) only when its cache is a ``ComposableMambaCache``; any other
  call goes to the stock forward untouched (SeRpEnt-Mamba's mixers always run on its cache: they stay);
* the model's class is swapped for a subclass of its stock class (same name, same module, made once per
  stock class) whose ``forward`` and ``generate`` take ``past_states=`` / ``composition=`` / ``attention=``. Without
  ``past_states`` they call the stock methods with the same arguments. With ``past_states`` the query is
  checked (a ``[batch, length]`` tensor, length >= 1, a left-padded 0/1 mask), the states are checked,
  composed into a fresh ``ComposableMambaCache`` with one row per query row (expanded for beams / return
  sequences), and passed as the cache (``cache``; ``cache_params`` before transformers 5.24); ``past_states`` never reaches the stock methods.
  ``generate`` therefore returns what stock generate returns: the query as passed plus the new tokens.

Nothing refers to a particular instance (the methods live on the classes): ``copy.deepcopy`` (trl's reference models, EMA
copies), ``pickle`` / ``torch.save(model)``, ``.to()``, ``.half()`` and PEFT wrapping carry the enabled
behaviour with the object and run *its* weights. The classes are made at run time, so pickle cannot find
them by name; instances reduce themselves to :func:`_new_enabled_model` and the stock class, which
re-creates the enabled class on load. The subclass keeps the stock ``__name__`` because transformers
writes ``type(model).__name__`` into ``config.architectures`` on ``save_pretrained``.

:func:`enabled` enables a model for a block only (what the repository's ``custom_generate`` method does for its
call): blocks and calls that overlap, in any threads, share one enabling, and the last one out gives the model back
exactly as the first found it. The enabled ``generate`` (and ``forward`` with states or a composed cache) runs inside
such a block itself, so that a block that ends elsewhere never disables the model under a call that is running.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from typing import Any

import torch

from .. import compat
from ..composition.attention import ATTENTION_POLICIES
from ..composition.composer import StateComposer
from ..models import disable_state_path, enable_state_path, get_backend, set_backend, using_backend  # noqa: F401
from ..models.encode import check_vocabulary
from ..models.mixers import refuse_layer_checkpointing
from ..state.cache import ComposableMambaCache
from ..state.fingerprint import architecture_of, model_fingerprint
from ..state.validation import check_against_model, check_is_state, check_left_padded_mask, pad_runs

_ENABLED_CLASSES: dict[type, type] = {}


class _EnabledModel:
    """Base of every enabled model class ``<Stock>(_EnabledModel, <Stock>)`` made by :func:`enable`."""

    _hsc_stock_class: type

    def __reduce_ex__(self, protocol):
        # the class was made by type() at run time and cannot be pickled by name: rebuild it from the stock class
        return _new_enabled_model, (self._hsc_stock_class,), self.__getstate__()


def _new_enabled_model(stock: type):
    """An empty instance of the enabled subclass of ``stock`` (pickle / deepcopy then restore its ``__dict__``)."""
    cls: Any = _enabled_class(stock)
    return cls.__new__(cls)


def _transformers_model(model):
    """The transformers model that ``enable`` changes: the model itself, or the one inside a PEFT model."""
    if hasattr(model, "get_base_model") and not isinstance(model, _EnabledModel):
        inner = model.get_base_model()
        if inner is not model:
            return inner
    return model


def is_enabled(model) -> bool:
    """Whether ``model`` (or the transformers model inside a PEFT model) takes ``past_states=``."""
    return isinstance(_transformers_model(model), _EnabledModel)


def enable(model, backend: str | None = None):
    """Teach a model of a supported architecture ``past_states=`` (idempotent; returns the model). The supported
    architectures are the rows of the architecture table (:data:`hf_statecompose.state.architectures.ARCHITECTURES`,
    listed in the docs' support table); any other model is refused with a ``TypeError`` that lists them.

    Calls without ``past_states`` behave exactly as before. ``backend`` (``"auto"``, ``"torch"`` or
    ``"triton"``, see :mod:`hf_statecompose.ops.backends`) picks the kernels of the state-aware path;
    ``None`` keeps the model's current choice (``"auto"`` the first time). A PEFT model is enabled
    through the transformers model inside it (PEFT passes ``past_states`` down); enabling a model and
    then wrapping it with PEFT works too. ``model.__class__`` becomes a subclass of the stock class
    (``isinstance`` checks still hold); :func:`disable` gives the stock class back.
    """
    inner = _transformers_model(model)
    architecture_of(inner)  # a clear TypeError, listing the supported architectures, for any other model
    enable_state_path(inner, backend)
    if not isinstance(inner, _EnabledModel):
        inner.__class__ = _enabled_class(type(inner))
        _rebind_instance_forwards(inner)
    return model


def disable(model):
    """Undo :func:`enable`: the stock model class and mixer classes, exactly."""
    inner = _transformers_model(model)
    architecture_of(inner)
    if isinstance(inner, _EnabledModel):
        inner.__class__ = inner._hsc_stock_class
        _rebind_instance_forwards(inner)
    disable_state_path(inner)
    return model


# ---------------------------------------------------------------------------------------------- enabled for a block
class _Block:
    """A model that :func:`enabled` enabled: how many blocks and calls are inside it, and what the last one out
    gives back (every module's class: ``enable`` swaps the model's class and its mixers', and ``hf_statecompose.encode``
    leaves a stock model's mixers swapped; the state-path backend, which :func:`disable` drops)."""

    __slots__ = ("backend", "classes", "count", "model")

    def __init__(self, model) -> None:
        self.model, self.count = model, 0
        self.classes = [(module, type(module)) for module in model.modules()]
        self.backend = None
        with contextlib.suppress(TypeError):  # an unsupported model: enable says so, listing the supported ones
            self.backend = get_backend(model)

    def restore(self) -> None:
        with contextlib.suppress(TypeError):  # an unsupported model: enable refused it before it changed anything
            disable(self.model)  # the stock classes (and accelerate's hooks pointed at them again)
        for module, cls in self.classes:
            if type(module) is not cls:  # mixers that hf_statecompose.encode had swapped before the block
                module.__class__ = cls
        if self.backend is not None:
            set_backend(self.model, self.backend)


# id(transformers model) -> its block (which holds the model: the id cannot be reused while the block is open)
_BLOCKS: dict[int, _Block] = {}
_BLOCKS_LOCK = threading.RLock()


@contextlib.contextmanager
def enabled(model):
    """``model`` enabled inside the ``with`` block only, and afterwards exactly as it was: every module's class and
    the state-path backend. Thread-safe and reentrant::

        with hsc.enabled(model):
            out = model.generate(query, past_states=states, max_new_tokens=32)

    Blocks that overlap on one model (nested, or in other threads) share one enabling: the first enables the model,
    the last one out gives it back; the model's ``generate`` (and ``forward`` with ``past_states`` or a composed
    cache) counts as such a block while it runs, so that a block ending in another thread never disables the model
    under a running call. This is how the repository's ``custom_generate`` method runs a stock model, so concurrent
    ``custom_generate`` calls on one model are each the call run alone. A block that raises is left as well.

    A model that is enabled already (:func:`enable`) is used as it is and stays enabled. Call neither :func:`enable`
    nor :func:`disable` on the model while blocks are open: the last one out gives back the model as the first found
    it. An unsupported model is refused with :func:`enable`'s ``TypeError`` and left as it was. Yields ``model``."""
    inner = _transformers_model(model)
    key = id(inner)
    with _BLOCKS_LOCK:
        block = _BLOCKS.get(key)
        if block is None and not isinstance(inner, _EnabledModel):
            block = _Block(model)
            try:
                enable(model)
            except BaseException:
                block.restore()
                raise
            _BLOCKS[key] = block
        if block is not None:
            block.count += 1
    if block is None:  # enabled by its user: used as it is
        yield model
        return
    try:
        yield model
    finally:
        with _BLOCKS_LOCK:
            block.count -= 1
            if block.count == 0:
                del _BLOCKS[key]
                block.restore()


def _rebind_instance_forwards(model):
    """accelerate's hooks keep the forward they wrap in the instance, bound (``_old_forward``; and
    ``remove_hook_from_module`` leaves it as ``forward``). Point such a stock / enabled forward at the
    class's current one: a model hooked before ``enable`` (``device_map`` over several devices) then takes
    ``past_states``, and a disabled one refuses it, instead of running the class it had when hooked."""
    stock = model._hsc_stock_class if isinstance(model, _EnabledModel) else type(model)
    ours = (stock.forward, _enabled_class(stock).forward)
    for name in ("_old_forward", "forward"):
        bound = model.__dict__.get(name)
        if isinstance(bound, types.MethodType) and bound.__self__ is model and bound.__func__ in ours:
            model.__dict__[name] = types.MethodType(type(model).forward, model)


def _with_states_signature(method, stock_method):
    """``method`` documented and introspected as ``stock_method`` plus ``past_states`` / ``composition`` /
    ``attention``:
    transformers inspects ``forward``'s parameters (``_validate_model_kwargs`` and others)."""
    # name and doc only: no __wrapped__ (introspection would skip this method) and no copied attributes
    functools.update_wrapper(method, stock_method, updated=())
    del method.__wrapped__
    signature = inspect.signature(stock_method)
    parameters = list(signature.parameters.values())
    at = next((i for i, p in enumerate(parameters) if p.kind is inspect.Parameter.VAR_KEYWORD), len(parameters))
    extra = [
        inspect.Parameter("past_states", inspect.Parameter.KEYWORD_ONLY, default=None),
        inspect.Parameter("composition", inspect.Parameter.KEYWORD_ONLY, default="picaso_r"),
        inspect.Parameter("attention", inspect.Parameter.KEYWORD_ONLY, default=None),
    ]
    method.__signature__ = signature.replace(parameters=parameters[:at] + extra + parameters[at:])
    return method


def _enabled_class(stock: type[torch.nn.Module]) -> type:
    """The enabled subclass of ``stock`` (made once; it closes over the class, never over an instance)."""
    if stock not in _ENABLED_CLASSES:
        # the stock methods are looked up at each call, so that later patches of the stock class still apply
        forward_signature = inspect.signature(stock.forward)
        # the one name the stock forward takes its cache under on the installed release (`cache` from transformers
        # 5.24; `cache_params` / `past_key_values` before): under any other name a cache is an unknown keyword that
        # stock passes on and never reads, and so does this forward (compat.cache_parameter)
        cache_name = compat.cache_parameter(stock.forward) or compat.CACHE_ARG
        # every name it takes a cache under: its own and the older ones its deprecation wrappers rename to it
        cache_names = compat.cache_names_taken(stock.forward) or (cache_name,)

        def forward(self, *args, past_states=None, composition="picaso_r", attention=None, **kwargs):
            if past_states is not None or any(
                isinstance(kwargs.get(name), ComposableMambaCache) for name in cache_names
            ):
                # on the state path, the model stays enabled until this call returns (see generate)
                with enabled(self):
                    return _forward(
                        self, *args, past_states=past_states, composition=composition, attention=attention, **kwargs
                    )
            return _forward(
                self, *args, past_states=past_states, composition=composition, attention=attention, **kwargs
            )

        def _forward(self, *args, past_states=None, composition="picaso_r", attention=None, **kwargs):
            if past_states is None:
                _refuse_attention_without_states(attention)
                cache = next(
                    (kwargs[name] for name in cache_names if isinstance(kwargs.get(name), ComposableMambaCache)), None
                )
                if cache is not None:
                    refuse_layer_checkpointing(self)
                check = cache is not None and cache.take_output_check()
                out = compat.without_deprecations(stock.forward)(self, *args, **kwargs)
                if check:
                    check_output_finite(out, cache)
                return out
            refuse_layer_checkpointing(self)
            named = _by_name(forward_signature, self, args, kwargs)
            given = [name for name in cache_names if named.get(name) is not None]
            if given:
                raise ValueError(f"pass either past_states or a cache ({given[0]}=), not both")
            composition = composer_for(composition, attention)
            batch = _check_query(named, ("input_ids",), self)
            for name in cache_names:
                named.pop(name, None)
            composed = compose_for_batch(self, past_states, composition, batch, model_inputs=named)
            named[cache_name] = composed
            named["use_cache"] = True
            check = composed.take_output_check()
            out = compat.without_deprecations(stock.forward)(self, **named)
            if check:
                check_output_finite(out, composed)
            _record_appended_positions(composed, named)
            return out

        # forward and generate run inside copies of the stock methods' deprecation wrappers (and call the stock
        # methods without theirs): transformers' warnings about a deprecated argument name point at the caller's line
        namespace = {
            "forward": compat.wrap_inside_deprecations(
                stock.forward, lambda _: _with_states_signature(forward, stock.forward)
            ),
            "_hsc_stock_class": stock,
            "__module__": stock.__module__,
            "__qualname__": stock.__qualname__,
            "__doc__": stock.__doc__,
        }
        if hasattr(stock, "generate"):
            generate_signature = inspect.signature(stock.generate)

            def generate(self, *args, past_states=None, composition="picaso_r", attention=None, **kwargs):
                # The model stays enabled until this call returns, also when it was enabled by a block (enabled())
                # that ends meanwhile in another thread; and if that block ended between the lookup of this method
                # and this line (the model is stock again), it is enabled again for this call. The stock method is
                # called as `stock.generate(self, ...)`, not through super(), which needs self to be of this class.
                with enabled(self):
                    return _generate(
                        self, *args, past_states=past_states, composition=composition, attention=attention, **kwargs
                    )

            def _generate(self, *args, past_states=None, composition="picaso_r", attention=None, **kwargs):
                if past_states is None:
                    _refuse_attention_without_states(attention)
                    _query_follows(kwargs.get(cache_name))  # a state handed as the cache: the query follows it
                    if isinstance(kwargs.get(cache_name), ComposableMambaCache):
                        kwargs[cache_name].check_next_output()
                    return compat.without_deprecations(stock.generate)(self, *args, **kwargs)
                named = _by_name(generate_signature, self, args, kwargs)
                if compat.cache_given(named):
                    raise ValueError("pass either past_states or a cache (cache / cache_params), not both")
                composition = composer_for(composition, attention)
                batch = _check_query(named, ("inputs", "input_ids"), self)
                config = named.get("generation_config") or self.generation_config
                compat.refuse_assisted_generation(named, config, starting_from="past_states")
                _check_inferred_mask(named, config)
                expand = max(
                    named.get("num_beams", getattr(config, "num_beams", 1)) or 1,
                    named.get("num_return_sequences", getattr(config, "num_return_sequences", 1)) or 1,
                )
                composed = compose_for_batch(
                    self, past_states, composition, batch, model_inputs=named, pad_token_id=_pad_for_mask(named, config)
                )
                # generate() expands input_ids for beams / return sequences but never a user cache: do it here
                compat.pop_cache(named)
                cache = composed.repeat_interleave(expand) if expand > 1 else composed
                _query_follows(cache)
                cache.check_next_output()
                named[cache_name] = cache
                named["use_cache"] = True
                out = compat.without_deprecations(stock.generate)(self, **named)
                _record_appended_positions(cache, named)
                return out

            namespace["generate"] = compat.wrap_inside_deprecations(
                stock.generate, lambda _: _with_states_signature(generate, stock.generate)
            )
        _ENABLED_CLASSES[stock] = type(stock.__name__, (_EnabledModel, stock), namespace)
    return _ENABLED_CLASSES[stock]


# ---------------------------------------------------------------------------------------------- compose
def composer_for(composition, attention: str | None = None):
    """``composition`` (a method name or a :class:`StateComposer`) with the ``attention=`` placement of a
    ``generate`` / ``forward`` call: ``composition="soup", attention="shared"`` is
    ``StateComposer("soup", attention="shared")``. ``attention=None`` (the default) keeps ``composition`` as it is;
    a composer whose own ``attention`` differs from the one given is refused (which one was meant is unknown)."""
    if attention is None:
        return composition
    if not isinstance(attention, str) or attention not in ATTENTION_POLICIES:
        raise ValueError(
            f"attention={attention!r} is not an attention placement; choose one of {', '.join(ATTENTION_POLICIES)} "
            "(hybrid models: how the states' keys are placed, see StateComposer)"
        )
    if isinstance(composition, StateComposer):
        if composition.attention != attention:
            raise ValueError(
                f"attention={attention!r} conflicts with composition={composition!r}, whose attention is "
                f"{composition.attention!r}: pass the placement in one place (StateComposer(..., attention=...) "
                "or attention= with a method name)"
            )
        return composition
    return StateComposer(composition, attention=attention)


def _refuse_attention_without_states(attention) -> None:
    """``attention=`` places the composed states' keys: without ``past_states`` there is nothing to place."""
    if attention is not None:
        raise ValueError("attention= places the keys of past_states; pass it with past_states (or leave it out)")


def _is_hybrid(state) -> bool:
    return bool(getattr(state, "attention_layer_indices", ()))


def _pad_for_mask(named: dict, config):
    """The pad id from which stock ``generate`` infers a mask when none is given (None when it infers none:
    no pad id, or pad is also eos)."""
    pad = named.get("pad_token_id", getattr(config, "pad_token_id", None))
    eos = named.get("eos_token_id", getattr(config, "eos_token_id", None))
    if pad is None or (pad in eos if isinstance(eos, (list, tuple)) else pad == eos):
        return None
    return int(pad)


def _hybrid_query_inputs(composed, named: dict, pad_token_id=None) -> None:
    """A hybrid's query continues after the composed keys: its attention mask is ``[key mask | query mask]``
    (the query's left padding kept, the keys' padding masked) and its positions start after the composed
    keys' last position, per row (``position_ids`` passed explicitly: stock Bamba would restart RoPE at 0, and
    with the ``"shared"`` placement the start is not the number of keys). A user's ``position_ids`` are kept."""
    query_mask, shape, device = _query_mask(named, pad_token_id)
    key_mask = composed.key_mask
    if key_mask is None:
        key_mask = torch.zeros(shape[0], 0, dtype=torch.long, device=device)
    named["attention_mask"] = torch.cat([key_mask.to(device=device, dtype=query_mask.dtype), query_mask], dim=-1)
    if named.get("position_ids") is None:
        positions = composed.attention_layers[0].positions
        start = (
            (positions.max(dim=-1).values.clamp(min=-1) + 1)
            if positions.shape[-1]
            else torch.zeros(shape[0], dtype=torch.long, device=positions.device)
        )
        steps = (query_mask.long().cumsum(-1) - 1).masked_fill(query_mask == 0, 0)
        named["position_ids"] = (start.to(device)[:, None] + steps).masked_fill(query_mask == 0, 0)


def _query_mask(named: dict, pad_token_id=None):
    """The query's attention mask ``[B, L]``: the user's, else the one stock ``generate`` infers (ids that are not the
    pad token), else ones; with the query's shape and device."""
    ids = next((named[name] for name in ("inputs", "input_ids") if torch.is_tensor(named.get(name))), None)
    embeds: Any = named.get("inputs_embeds")  # a tensor where ids is None
    shape = tuple(ids.shape) if ids is not None else tuple(embeds.shape[:2])
    device = (ids if ids is not None else embeds).device
    mask = named.get("attention_mask")
    if mask is None:
        mask = (
            ids.ne(pad_token_id).long()
            if ids is not None and pad_token_id is not None
            else torch.ones(shape, dtype=torch.long, device=device)
        )
    return mask, shape, device


def check_output_finite(out, cache) -> None:
    """The first forward from composed states (or a state handed to ``generate``) must give finite outputs: a state
    whose values are finite but overflow the forward (a crafted one, filled with 3e38) would otherwise give NaN
    logits silently. One reduction and one host sync, at the first step only (:meth:`ComposableMambaCache.
    check_next_output`)."""
    from ..state.validation import all_finite

    tensor = getattr(out, "logits", None)
    if tensor is None:
        tensor = getattr(out, "last_hidden_state", None)
    if tensor is None and isinstance(out, tuple) and out and torch.is_tensor(out[0]):
        tensor = out[0]
    if not torch.is_tensor(tensor) or all_finite(tensor.detach()):
        return
    largest = max(
        (float(t.detach().abs().max()) for t in cache.ssm_states if torch.is_tensor(t) and t.numel()), default=0.0
    )
    raise ValueError(
        "the forward from these states gave NaN or inf outputs at its first step: a state's values overflow this "
        f"model's forward (its largest SSM state entry now {largest:.3g}), or are not finite (edited after their "
        "check by a route no version counter follows); a state this model encoded gives finite outputs: re-encode "
        "the context"
    )


def _query_follows(cache) -> None:
    """``generate`` from a state of a model without attention layers (composed from ``past_states``, or handed as the
    cache): the prompt is the query, which follows the state's tokens
    (:meth:`~hf_statecompose.state.cache.ComposableMambaCache.query_follows`). A hybrid's state holds keys, and its
    prompt's mask covers them (:func:`_hybrid_query_inputs`), as transformers expects of any cache with keys."""
    if isinstance(cache, ComposableMambaCache) and not _is_hybrid(cache):
        cache.query_follows()


def _record_appended_positions(cache, named: dict) -> None:
    """After a hybrid's forward / generate from composed keys: the positions of the keys the call appended, as the
    call placed them. transformers' attention appends keys without a mask, so the layers took every new slot for a
    real token; here the query's padding slots become -1 and the real ones continue after the composed keys'
    last position, padding skipped, then the generated tokens one by one (the ``position_ids`` this module
    passes). Rows of an expanded cache (beams, return sequences) are copies of their query row's."""
    mask, layers = named.get("attention_mask"), getattr(cache, "attention_layers", None)
    if not layers or not torch.is_tensor(mask) or layers[0].positions is None:
        return
    positions = layers[0].positions
    ids: Any = next(
        (named[name] for name in ("inputs", "input_ids", "inputs_embeds") if torch.is_tensor(named.get(name))), None
    )
    keys = mask.shape[-1] - ids.shape[1]  # the call had a query (ids or embeds)
    appended = positions.shape[-1] - keys
    if keys < 0 or appended <= 0 or positions.shape[0] % mask.shape[0]:
        return
    repeat = positions.shape[0] // mask.shape[0]
    query_mask = mask[:, keys:].to(device=positions.device, dtype=torch.long).repeat_interleave(repeat, dim=0)
    real = torch.cat(
        [query_mask, query_mask.new_ones(query_mask.shape[0], max(0, appended - query_mask.shape[-1]))], dim=-1
    )[:, :appended]
    start = (
        positions[:, :keys].max(dim=-1, keepdim=True).values.clamp(min=-1) + 1
        if keys
        else positions.new_zeros(positions.shape[0], 1)
    )
    placed = torch.where(real > 0, start + real.cumsum(-1) - 1, -1)
    for layer in layers:
        layer.positions = torch.cat([layer.positions[:, :keys], placed], dim=-1)


def compose_for_batch(
    model, past_states, composition, batch_size: int, model_inputs: dict | None = None, pad_token_id=None
) -> ComposableMambaCache:
    """One composed state row per query row, checked against ``model``. For a hybrid model, ``model_inputs`` (the
    call's arguments by name) get the attention mask and positions that continue after the composed keys."""
    composed = _compose_for_batch(model, past_states, composition, batch_size)
    composed.check_next_output()
    if model_inputs is not None and _is_hybrid(composed):
        _hybrid_query_inputs(composed, model_inputs, pad_token_id)
    return composed


def _compose_for_batch(model, past_states, composition, batch_size: int) -> ComposableMambaCache:
    composer = composition if isinstance(composition, StateComposer) else StateComposer(composition)
    fingerprint = model_fingerprint(model)
    if isinstance(past_states, ComposableMambaCache):
        raise TypeError("past_states must be a list of states (or a list of lists, one per row), not a single state")
    if (
        isinstance(past_states, (list, tuple))
        and past_states
        and all(isinstance(s, (list, tuple)) for s in past_states)
    ):
        if len(past_states) != batch_size:
            raise ValueError(
                f"past_states has {len(past_states)} lists but the query batch has {batch_size} rows; "
                "pass one list of states per row, or a flat list of batch-1 states used for every row"
            )
        rows = []
        for r, row_states in enumerate(past_states):
            _check_batch_one(row_states, f"past_states[{r}]")
            _check_each_against_model(row_states, model, fingerprint, f"past_states[{r}]")
            row, trusted = _compose(composer, row_states, model, f"past_states[{r}]")
            rows.append(row)
        composed = type(rows[0]).stack(rows)  # the states' own class: a subclass's extras follow their rows
    else:
        if not isinstance(past_states, (list, tuple)):
            raise TypeError(f"past_states must be a list of ComposableMambaCache, got {type(past_states).__name__}")
        _check_each_against_model(past_states, model, fingerprint, "past_states")
        composed, trusted = _compose(composer, past_states, model, "past_states")
        if composed.batch_size == 1 and batch_size > 1:
            composed = composed.repeat_interleave(batch_size)
        elif composed.batch_size != batch_size:
            raise ValueError(
                f"past_states have batch size {composed.batch_size} but the query batch has {batch_size} rows; "
                "use batch-1 states (shared by all rows), states with one row per query row, or one list per row"
            )
    if not trusted:
        # a composer subclass's own compose: its result is checked against the model (its contents were built
        # from the states checked above); StateComposer's result is made of those states' checked tensors
        check_against_model(composed, model, fingerprint, contents=False)
    return composed


def _compose(composer, states, model, name: str):
    """``(composer.compose(states), whether the result needs no check)``. The states were checked against ``model``
    just before (:func:`_check_each_against_model`: the call's one verdict on them), so :class:`StateComposer` is
    told so (``validated=True``) and its errors name the states as the user passed them (``name[k]``); a subclass
    that overrides ``compose`` is called as it is and its result checked."""
    if type(composer).compose is StateComposer.compose:
        return composer.compose(list(states), model, validated=True, where=name), True
    return composer.compose(list(states), model=model), False


def _check_each_against_model(states, model, fingerprint, where):
    """Fail fast, before any arithmetic, on states that do not belong to this model or whose contents a state
    file would not pass (each state object is checked once, :func:`check_state_once`)."""
    if not isinstance(states, (list, tuple)) or len(states) == 0:
        raise ValueError(f"{where} is empty: pass at least one ComposableMambaCache")
    for k, state in enumerate(states):
        check_is_state(state, f"{where}[{k}]")
        check_against_model(state, model, fingerprint, f"{where}[{k}]")


def _check_batch_one(states, where):
    for k, state in enumerate(states):
        if isinstance(state, ComposableMambaCache) and state.batch_size != 1:
            raise ValueError(f"{where}[{k}] has batch size {state.batch_size}; per-row lists take batch-1 states")


def _by_name(signature, model, args, kwargs) -> dict:
    """Every argument by its name, however it was passed, so that it can be read and replaced."""
    try:
        bound = signature.bind_partial(model, *args, **kwargs)
    except TypeError as error:
        raise TypeError(f"{error} (with past_states)") from None
    named = {}
    for name, value in list(bound.arguments.items())[1:]:  # [0] is self
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError("with past_states, pass the model's arguments by name")
        else:
            named[name] = value
    return named


def _embedding_width(model) -> int | None:
    """The width of the model's input embeddings (what ``inputs_embeds`` must have), None if unknown."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return getattr(embeddings, "embedding_dim", None) or getattr(model.config, "hidden_size", None)


def _check_query(named: dict, id_names: tuple[str, ...], model) -> int:
    """Check the query of a ``past_states`` call of ``model`` and its mask (replaced by the checked int64
    mask); the batch size. Ids outside the vocabulary are refused (the embedding would raise torch's
    bare "index out of range").

    The states are composed per row and the query continues from them, so a right-padded row would run
    its padding through the state and a wrong-shaped mask would pad the wrong tokens: refuse, as ``encode`` does.
    """
    ids = next((named[name] for name in id_names if named.get(name) is not None), None)
    embeds = named.get("inputs_embeds")
    if ids is None and embeds is None:
        raise ValueError("past_states needs the query: pass input_ids (or inputs_embeds) of shape [batch, length]")
    if ids is not None:
        if not torch.is_tensor(ids) or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            found = f"a {ids.dtype} tensor" if torch.is_tensor(ids) else type(ids).__name__
            raise TypeError(f"input_ids must be a tensor of token ids (torch.long), got {found}")
        if ids.dim() != 2:
            fix = "; for a single query use input_ids[None]" if ids.dim() == 1 else ""
            raise ValueError(
                f"input_ids must have shape [batch, length] with past_states, got shape {tuple(ids.shape)}{fix}"
            )
        shape = tuple(ids.shape)
        check_vocabulary(model, ids)
        if embeds is not None and (not torch.is_tensor(embeds) or tuple(embeds.shape[:2]) != shape):
            given = tuple(embeds.shape) if torch.is_tensor(embeds) else type(embeds).__name__
            raise ValueError(f"inputs_embeds {given} does not match input_ids {shape}; pass one of them")
    else:
        if not torch.is_tensor(embeds) or embeds.dim() != 3:
            found = f"shape {tuple(embeds.shape)}" if torch.is_tensor(embeds) else type(embeds).__name__
            raise ValueError(f"inputs_embeds must have shape [batch, length, hidden] with past_states, got {found}")
        shape = tuple(embeds.shape[:2])
    width = _embedding_width(model)
    if embeds is not None and torch.is_tensor(embeds) and width is not None and embeds.shape[-1] != width:
        raise ValueError(
            f"inputs_embeds have width {embeds.shape[-1]}, the model's embeddings {width}: pass "
            "model.get_input_embeddings()(input_ids) (shape [batch, length, hidden_size]) or input_ids"
        )
    if shape[0] == 0:
        raise ValueError("the query batch is empty (0 rows): pass at least one query row with past_states")
    if shape[1] == 0:
        raise ValueError(
            "the query is empty (length 0): generation continues from the composed state with at least one "
            "query token, whose logits give the first new token; pass e.g. the BOS token or a separator as the query"
        )
    mask = named.get("attention_mask")
    if mask is not None:
        if not torch.is_tensor(mask):
            raise TypeError(f"attention_mask must be a tensor of 0/1 of shape {shape}, got {type(mask).__name__}")
        # check_left_padded_mask compares the mask's shape with this stand-in for the query (no memory on 'meta')
        named["attention_mask"] = check_left_padded_mask(mask, torch.empty(shape, device="meta"))
    return shape[0]


def _check_inferred_mask(named: dict, config) -> None:
    """Without ``attention_mask``, stock ``generate`` takes every ``pad_token_id`` in the query for padding
    (unless pad is also eos). Check that mask as an explicit one: a right-padded query would otherwise run
    its padding after the state, with only a logged warning."""
    ids = next((named[name] for name in ("inputs", "input_ids") if named.get(name) is not None), None)
    if ids is None or named.get("attention_mask") is not None:
        return
    pad = named.get("pad_token_id", getattr(config, "pad_token_id", None))
    eos = named.get("eos_token_id", getattr(config, "eos_token_id", None))
    if pad is None or not torch.is_tensor(ids) or ids.dim() != 2:
        return
    if pad in eos if isinstance(eos, (list, tuple)) else pad == eos:
        _check_padding_shared_with_eos(ids, int(pad))
        return
    inferred = ids.ne(int(pad))
    if bool(inferred.all()):
        return
    try:
        check_left_padded_mask(inferred, ids)
    except ValueError as error:
        raise ValueError(
            f"{error} (no attention_mask was given, so generate takes the query's pad_token_id {int(pad)} for padding; "
            "pass attention_mask explicitly)"
        ) from None


def _check_padding_shared_with_eos(ids: torch.Tensor, pad: int) -> None:
    """When pad is also eos, stock ``generate`` infers no mask and runs every token: padding would go through the
    composed state as if it were query. A row that ends with pad / eos after its tokens is right padded (or
    asks to continue after an eos); rows that start with different numbers of it are left padded. Refuse both:
    only a mask says which tokens are padding."""
    leading, trailing = pad_runs(ids, pad)
    length = ids.shape[1]
    ends = (trailing > 0) & (trailing < length)
    if bool(ends.any()):
        row = int(ends.nonzero()[0, 0])
        raise ValueError(
            f"query row {row} ends with token {pad}, which is both pad_token_id and eos_token_id, and no "
            "attention_mask was given: generate cannot tell right padding from an eos, and would run it after the "
            "state as query. Pass attention_mask (left padded: tokenizer.padding_side = 'left'), or drop the "
            "trailing token"
        )
    if int(leading.min()) != int(leading.max()):
        raise ValueError(
            f"the query looks left padded (rows start with {int(leading.min())} to {int(leading.max())} of token "
            f"{pad}, which is both pad_token_id and eos_token_id) and no attention_mask was given: generate infers "
            "no mask when pad is eos, so the padding would run after the state as query. Pass attention_mask"
        )
