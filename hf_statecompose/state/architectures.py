"""One description per architecture of what its states hold: the single source that the cache, validation,
state files, fingerprints and the composer read, instead of tests on the architecture's name.

For each architecture (``model_type`` of the config): how many *state layers* a model has (one per layer for
Mamba / Mamba-2 / COFFEE; one per (layer, branch) for SeRpEnt-Mamba, ``v = layer * num_branches + branch``), the
per-row shapes of the SSM state, the conv window and ΣΔ and the shape of ``A``, whether the decay is per
element (Mamba-1: ``ΣΔ[d] · A[d, n]``) or per head (Mamba-2: ``ΣΔ[h] · A[h]``), where the ``A_log`` of state
layer ``v`` lives in a model, which cache class holds the states, and the extra per-layer tensors beyond the
SSM state, the conv window and ΣΔ (SeRpEnt's resampling state) with their dtypes, shapes, file names and
value checks.

Every function of a config here reads only plain config entries (no derived properties), so that a config
rebuilt from a state file's JSON, or the JSON itself seen through attributes, answers the same.

Each row also holds what the rest of the package knows about the architecture: its display name, the module and
model classes that define it (for transformers' models, the classes whose stock ``forward`` / ``generate`` refuse
``past_states`` until :func:`hf_statecompose.enable`), the stock SSM mixer class that ``enable`` swaps and the
state-aware forward it runs, and its line in the docs' support table. ``compat``'s loader, the guard, the mixer
dispatch (``models/mixers.py``), ``fingerprint.architecture_of`` / ``base_model_of``, the error messages that list
what is supported and the docs' table (:func:`support_table`) are derived from the rows: adding an architecture is
adding its row (:func:`register`, or an entry of :data:`ARCHITECTURES` here).

Importing this module is light (no torch: the functions that need it import it when called), because the root
package reads the rows on ``import hf_statecompose`` to guard transformers' classes.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from .. import compat

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExtraTensor:
    """A per-state-layer tensor beyond the SSM state, conv window and ΣΔ: ``getattr(cache, attribute)[v]``,
    ``[B, *row_shape(config)]`` of ``dtype(model_dtype)``, stored in files as ``f"{file_key}.{v}"``."""

    attribute: str
    file_key: str
    label: str
    row_shape: Callable[[Any], tuple]
    dtype: Callable[[torch.dtype], torch.dtype]
    # stores keep it in their storage dtype, as the SSM states (a delta-rule transition: bf16 in a bf16 store), and
    # read it back in ``dtype``; otherwise it is stored in its own dtype, never rounded (SeRpEnt's clocks and masks)
    stored_like_state: bool = False


@dataclass(frozen=True)
class Architecture:
    name: str
    per_element_decay: bool  # ΣΔ [B, D] with A [D, N] (Mamba-1 semantics) vs ΣΔ [B, H] with A [H]
    num_state_layers: Callable[[Any], int]
    state_shapes: Callable[[Any], tuple]  # per-row (SSM state, conv window)
    decay_shapes: Callable[[Any], tuple]  # (per-row ΣΔ, A)
    A_log_of: Callable[[torch.nn.Module, int], torch.Tensor | None]  # (backbone, state layer) -> A_log or None
    cache_module: str  # module (in this package) and class of the cache that holds these states
    cache_class_name: str
    extras: tuple[ExtraTensor, ...] = field(default=())
    # value checks of the extras of one state layer, after their dtypes and shapes were checked:
    # ({attribute: tensor of that layer}, layer, refuse(problem), *, config, num_tokens, encoded, decay, rounding) -> None;
    # refuse raises
    check_extra_values: Callable | None = None
    # checks across the state layers, after each layer's: ([{attribute: tensor} of every layer], refuse) -> None
    check_extras_across_layers: Callable | None = None
    # hybrids (Mamba layers + attention layers): the kind of every model layer, "ssm" (an SSM state layer),
    # "attention" (keys and values), "both" (Falcon-H1's parallel layers, Zamba2's hybrid layers) or "none" (an
    # MLP / MoE layer). None: every model layer is one SSM state layer (or, for SeRpEnt, several)
    layer_kinds: Callable[[Any], tuple] | None = None
    # attribute paths from a decoder layer to its SSM mixer, tried in order
    mixer_paths: tuple = (("mixer",),)
    # the attribute path from an SSM mixer to its A_log (what tells a mixer from an attention module at a shared path)
    A_log_path: tuple[str, ...] = ("A_log",)
    # per attention layer: (key / value heads, head dim), or (heads, key dim, value dim) where they differ (Kimi's MLA
    # caches its latent as the keys and the rotary key part as the values); :meth:`attention_dims` reads either
    attention_shape: Callable[[Any], tuple] | None = None
    # how many dims of a head RoPE rotates (0: attention without positional encoding)
    rotary_dims: Callable[[Any], int] = field(default=lambda c: 0)
    # ---- what the rest of the package knows about the architecture (enable, its guard, errors, docs)
    display_name: str = ""  # as the docs and the error messages name it ("Mamba-2", "Falcon-H1")
    # the module that defines the models (for transformers' own: compat.modeling_module(<its models/ folder>))
    model_module: str = ""
    model_classes: tuple[str, ...] = ()  # in model_module: the bare model and the causal LM
    # whether the stock forward / generate of model_classes must refuse past_states until enabled (transformers'
    # models, whose **kwargs would swallow it: hf_statecompose/_guard.py); this package's own models refuse it themselves
    guarded: bool = True
    # the stock SSM mixer class (in model_module) that enable swaps for a state-aware subclass, and the forward
    # ("module:function") that subclass runs on this package's cache; None: the model's mixers run on the cache
    # themselves (SeRpEnt-Mamba, COFFEE)
    mixer_class: str | None = None
    mixer_forward: str | None = None
    # the docs' support table: what composing these states does
    composition_note: str = "every method"

    @property
    def is_own(self) -> bool:
        """Whether the architecture is this package's own (not one of transformers' models)."""
        return self.model_module.startswith(f"{__package__.split('.')[0]}.")

    def label(self) -> str:
        """``Display (`model_type`)``, as the docs and the error messages name the architecture."""
        return f"{self.display_name or self.name} (`{self.name}`{', this package' if self.is_own else ''})"

    def stock_mixer_class(self) -> type | None:
        """The stock mixer class that ``enable`` swaps (None if the row has none, or the installed transformers
        lacks the model)."""
        if self.mixer_class is None:
            return None
        return compat.load_class(self.model_module, self.mixer_class)

    def mixer_forward_function(self) -> Callable:
        """The state-aware forward of :attr:`mixer_forward` (``"module:function"``), imported."""
        if self.mixer_forward is None:
            raise TypeError(f"{self.name} has no state-aware mixer forward: its mixers run on the cache themselves")
        module, _, function = self.mixer_forward.partition(":")
        return getattr(importlib.import_module(module), function)

    @property
    def is_hybrid(self) -> bool:
        return self.layer_kinds is not None

    def ssm_layer_indices(self, config) -> tuple:
        """The model layers that hold the SSM state layers, in state-layer order (hybrids; else 0..n-1)."""
        if self.layer_kinds is None:
            return tuple(range(self.num_state_layers(config)))
        return tuple(i for i, kind in enumerate(self.layer_kinds(config)) if kind in ("ssm", "both"))

    def attention_layer_indices(self, config) -> tuple:
        """The model layers that hold keys and values (none for the pure SSM architectures)."""
        if self.layer_kinds is None:
            return ()
        return tuple(i for i, kind in enumerate(self.layer_kinds(config)) if kind in ("attention", "both"))

    def mixer_of(self, block):
        """The SSM mixer module of decoder layer ``block`` (None if it has none)."""
        for path in self.mixer_paths:
            module = block
            for name in path:
                module = getattr(module, name, None)
            if module is not None and _attribute(module, self.A_log_path) is not None:
                return module
        return None

    def attention_dims(self, config) -> tuple[int, int, int]:
        """(key / value heads, key dim, value dim) of an attention layer's cached keys and values."""
        shape = self.attention_shape(config)  # type: ignore[misc]  # set for every hybrid
        return shape[0], shape[1], shape[-1]

    def cache_class(self) -> type:
        return getattr(importlib.import_module(f"{__package__}.{self.cache_module}"), self.cache_class_name)

    def is_cache_class(self, cls: type) -> bool:
        """Whether ``cls`` is :meth:`cache_class`, compared by name: no import, so that a forward traced by
        ``torch.compile(fullgraph=True)`` (which cannot trace ``importlib``) stays one graph."""
        return cls.__module__ == f"{__package__}.{self.cache_module}" and cls.__qualname__ == self.cache_class_name


def _attribute(obj, path: tuple[str, ...]):
    for name in path:
        obj = getattr(obj, name, None)
    return obj


def _torch():
    import torch

    return torch


def _mixer_A_log(backbone, v):
    return getattr(getattr(backbone.layers[v], "mixer", None), "A_log", None)


# ---------------------------------------------------------------------------------------------- Mamba, Mamba-2
# the state-aware mixer forwards (hf_statecompose.models: imported by the mixer dispatch, models/mixers.py)
_MAMBA_FORWARD = "hf_statecompose.models.mamba:mamba_mixer_forward"
_MAMBA2_FORWARD = "hf_statecompose.models.mamba2:mamba2_mixer_forward"

MAMBA = Architecture(
    name="mamba",
    per_element_decay=True,
    num_state_layers=lambda c: c.num_hidden_layers,
    state_shapes=lambda c: ((c.intermediate_size, c.state_size), (c.intermediate_size, c.conv_kernel)),
    decay_shapes=lambda c: ((c.intermediate_size,), (c.intermediate_size, c.state_size)),
    A_log_of=_mixer_A_log,
    cache_module="cache",
    cache_class_name="ComposableMambaCache",
    display_name="Mamba",
    model_module=compat.modeling_module("mamba"),
    model_classes=("MambaModel", "MambaForCausalLM"),
    mixer_class="MambaMixer",
    mixer_forward=_MAMBA_FORWARD,
)

# FalconMamba (transformers' falcon_mamba, e.g. falcon-mamba-7b): Mamba-1 with weightless RMS norms on Δ, B and C
# inside the mixer; its states are Mamba-1 states in every respect
FALCON_MAMBA = dataclasses.replace(
    MAMBA,
    name="falcon_mamba",
    display_name="FalconMamba",
    model_module=compat.modeling_module("falcon_mamba"),
    model_classes=("FalconMambaModel", "FalconMambaForCausalLM"),
    mixer_class="FalconMambaMixer",
)


def _mamba2_state_shapes(c):
    intermediate = int(c.expand * c.hidden_size)
    conv_dim = intermediate + 2 * c.n_groups * c.state_size
    return (c.num_heads, c.head_dim, c.state_size), (conv_dim, c.conv_kernel)


MAMBA2 = Architecture(
    name="mamba2",
    per_element_decay=False,
    num_state_layers=lambda c: c.num_hidden_layers,
    state_shapes=_mamba2_state_shapes,
    decay_shapes=lambda c: ((c.num_heads,), (c.num_heads,)),
    A_log_of=_mixer_A_log,
    cache_module="cache",
    cache_class_name="ComposableMambaCache",
    display_name="Mamba-2",
    model_module=compat.modeling_module("mamba2"),
    model_classes=("Mamba2Model", "Mamba2ForCausalLM"),
    mixer_class="Mamba2Mixer",
    mixer_forward=_MAMBA2_FORWARD,
)


# ---------------------------------------------------------------------------------------------- SeRpEnt-Mamba
def _branches(c) -> int:
    return len(c.branch_compressions)


def _branch_channels(c) -> int:  # i_b
    return c.intermediate_size // _branches(c)


def _serpent_A_log(backbone, v):
    layer = backbone.layers[v // len(backbone.layers[0].mixer.branches)]
    branches = layer.mixer.branches
    return getattr(getattr(branches[v % len(branches)], "ssm", None), "A_log", None)


# the resampling clock's fixed point (:mod:`.serpent_cache`): each real token advances it by round(δ · 2^20), δ in [κ, 1]
SERPENT_CLOCK_BITS = 20
SERPENT_CLOCK_ONE = 1 << SERPENT_CLOCK_BITS


def _min_clock_step(config, v: int) -> int:
    """The least clock step a real token of state layer ``v`` can make: exactly ``2^20`` for κ = 1 (δ is 1), else
    ``round(δ · 2^20)`` with δ >= κ computed in float32, so ``floor(κ · 2^20) - 1`` leaves room for its rounding."""
    compressions = config.branch_compressions
    kappa = float(compressions[v % len(compressions)])
    return SERPENT_CLOCK_ONE if kappa >= 1.0 else max(0, math.floor(kappa * SERPENT_CLOCK_ONE) - 1)


def _check_resampling_values(
    extras: dict, v: int, refuse, *, config, num_tokens=None, encoded: bool = False, decay=None, rounding: float = 0.0
) -> None:
    """The invariants every real encoding satisfies (modeling_serpent.SeRpEntBranch.forward builds the state):

    * the clock only moves with real tokens: each adds a step s in [s_min, 2^20] (``round(δ · 2^20)``, δ in
      [κ, 1]; exactly 2^20 for κ = 1; padding adds 0), so clock >= 0, and clock > 0 means a real token was seen;
    * every real token enters the window with its clock value as its time; the window is the last K of all the
      real tokens seen, in order, right aligned (invalid slots first): so with clock > 0 at least one slot is
      valid; the latest valid time equals the clock (the latest real token set both); consecutive valid times
      differ by one token's step, in [s_min, 2^20] (strictly increasing for every κ >= 2^-19); the first valid
      time is >= s_min, and when the window is not full it holds every real token so far, so its first time
      is the first token's step, <= 2^20;
    * invalid slots (no token yet, or padding) are never read (the model multiplies them by the mask): their
      times lie in [0, clock] as the valid ones' do, their inputs are finite;
    * no grid point exists before the clock reaches 2^20, so until then the last output is exactly zero;
    * with the token counts (``num_tokens`` [B], when known): at most that many valid slots and a clock of at
      most ``num_tokens · 2^20``; for a state still as encoded (it carries token_ids: every one of its
      ``num_tokens`` tokens was real and seen from an empty state) exactly ``min(K, num_tokens)`` valid slots
      and a clock of at least ``num_tokens · s_min``.

    Across layers (every layer and branch sees the same real tokens, so the same number of valid slots):
    :func:`_check_resampling_across_layers`."""
    import torch

    clock, times, valid = extras["clocks"], extras["window_times"], extras["window_valid"]
    one, least, window = SERPENT_CLOCK_ONE, _min_clock_step(config, v), valid.shape[1]
    if (clock < 0).any():
        refuse(f"layer {v} resampling clock is negative ({clock.min().item()})")
    if (times < 0).any() or (times > clock[:, None]).any():
        refuse(f"layer {v} resampling window times must lie in [0, clock] (a neighbour cannot come after the clock)")
    if window > 1 and (valid[:, :-1] & ~valid[:, 1:]).any():
        refuse(f"layer {v} resampling window valid mask is not right aligned (a missing neighbour after a real one)")
    count = valid.sum(1)
    seen = count > 0
    if ((clock > 0) & ~seen).any():
        row = int(((clock > 0) & ~seen).nonzero()[0, 0])
        refuse(
            f"layer {v} resampling clock is {int(clock[row])} (row {row}) but no window neighbour is valid: the clock "
            "only moves with real tokens, and every real token enters the window"
        )
    if window and (valid[:, -1] & (times[:, -1] != clock)).any():
        refuse(
            f"layer {v} resampling latest valid neighbour's time differs from the clock: the latest real token set both"
        )
    if window > 1:
        steps = times[:, 1:] - times[:, :-1]
        if (valid[:, :-1] & ((steps < least) | (steps > one))).any():
            refuse(
                f"layer {v} resampling window times must grow by one token's clock step between valid neighbours, "
                f"in [{least}, {one}] for this branch (κ = {float(config.branch_compressions[v % len(config.branch_compressions)]):g})"
            )
    if window and seen.any():
        first = times.gather(1, (window - count).clamp(max=window - 1)[:, None])[:, 0]
        if (seen & (first < least)).any():
            refuse(f"layer {v} resampling first valid neighbour's time is below one token's least clock step {least}")
        if (seen & (count < window) & (first > one)).any():
            refuse(
                f"layer {v} resampling window is not full, so it holds every real token so far, but its first "
                f"valid time is after the first token's (at most {one})"
            )
    last_output = extras["last_outputs"]
    for label, tensor in (("window inputs", extras["window_inputs"]), ("last output", last_output)):
        if not torch.isfinite(tensor).all():
            refuse(f"layer {v} resampling {label} contain NaN or inf")
    if ((clock < one) & (last_output != 0).flatten(1).any(1)).any():
        refuse(
            f"layer {v} resampling last output is not zero before the first grid point (clock < {one}: the model "
            "reads zeros until it creates one)"
        )
    if num_tokens is None:
        return
    if (count > num_tokens).any():
        row = int((count > num_tokens).nonzero()[0, 0])
        refuse(
            f"layer {v} resampling window holds {int(count[row])} valid neighbours, more than num_tokens "
            f"({int(num_tokens[row])}) (row {row})"
        )
    if (clock > num_tokens * one).any():
        refuse(f"layer {v} resampling clock exceeds num_tokens x {one}: each token advances it by at most {one}")
    if encoded:
        if (count != num_tokens.clamp(max=window)).any() or (clock < num_tokens * least).any():
            refuse(
                f"layer {v} resampling state is not that of an encoding of num_tokens tokens (the state carries "
                f"token_ids, so it was encoded from an empty state: min(K, num_tokens) valid neighbours and a "
                f"clock of at least num_tokens x {least})"
            )


def _check_resampling_across_layers(layers: list, refuse) -> None:
    """Every layer and branch sees the same real tokens, so every state layer's window holds as many valid
    neighbours (per row) as the first one's."""
    if len(layers) < 2:
        return
    import torch

    counts = torch.stack([extras["window_valid"].sum(1) for extras in layers])  # [layers, B]
    differ = counts != counts[:1]
    if bool(differ.any()):
        v, row = (int(i) for i in differ.nonzero()[0])
        refuse(
            f"the resampling windows hold different numbers of valid neighbours: layer 0 has "
            f"{int(counts[0, row])}, layer {v} has {int(counts[v, row])} (row {row}); every layer and branch "
            "sees the same real tokens"
        )


SERPENT_MAMBA = Architecture(
    name="serpent_mamba",
    per_element_decay=True,  # every (layer, branch) is a Mamba-1 SSM
    num_state_layers=lambda c: c.num_hidden_layers * _branches(c),
    state_shapes=lambda c: ((_branch_channels(c), c.state_size), (_branch_channels(c), c.conv_kernel)),
    decay_shapes=lambda c: ((_branch_channels(c),), (_branch_channels(c), c.state_size)),
    A_log_of=_serpent_A_log,
    cache_module="serpent_cache",
    cache_class_name="ComposableSeRpEntCache",
    extras=(
        ExtraTensor("clocks", "resample.clock", "resampling clock", lambda c: (), lambda d: _torch().int64),
        ExtraTensor(
            "window_inputs",
            "resample.inputs",
            "resampling window inputs",
            lambda c: (c.resample_window, c.hidden_size),
            lambda d: _torch().promote_types(d, _torch().float32),
        ),
        ExtraTensor(
            "window_times",
            "resample.times",
            "resampling window times",
            lambda c: (c.resample_window,),
            lambda d: _torch().int64,
        ),
        ExtraTensor(
            "window_valid",
            "resample.valid",
            "resampling window valid mask",
            lambda c: (c.resample_window,),
            lambda d: _torch().bool,
        ),
        ExtraTensor(
            "last_outputs",
            "resample.last_output",
            "resampling last output",
            lambda c: (c.hidden_size // _branches(c),),
            lambda d: d,
        ),
    ),
    check_extra_values=_check_resampling_values,
    check_extras_across_layers=_check_resampling_across_layers,
    display_name="SeRpEnt-Mamba",
    model_module="hf_statecompose.models.serpent.modeling_serpent",
    model_classes=("SeRpEntMambaModel", "SeRpEntMambaForCausalLM"),
    guarded=False,  # refuses past_states itself (models/causal_lm.py)
    composition_note="every method; the resampling state is the last context's",
)


# ---------------------------------------------------------------------------------------------- COFFEE
def _coffee_elements(c) -> int:
    """E·n: the state elements of one COFFEE layer, E = the mixer's features (``intermediate_size`` for the
    ``"lm"`` head, ``hidden_size`` for the paper's ``"core"`` module)."""
    width = c.hidden_size if getattr(c, "head", "lm") == "core" else c.intermediate_size
    return width * c.state_size


def _coffee_A_log(backbone, v):
    return getattr(getattr(backbone.layers[v], "mixer", None), "decay_A_log", None)


# COFFEE (hf_statecompose.models.coffee): one state layer per layer, held by the plain ComposableMambaCache as
# a Mamba-1 state with one channel per state element. The mixer's state [B, E, n] is stored flattened:
#   ssm_states[l]  [B, E·n, 1] float32 (the state element (e, j) at row e·n + j);
#   conv_states[l] [B, E·n, 0] in the model dtype: empty, COFFEE has no conv;
#   delta_sums[l]  [B, E·n] = -Σ_k log(1 + λΔ(k)) >= 0 over the context's tokens (advance_layer adds them up);
#   A[l]           [E·n, 1] = -1 (= -exp(A_log) with the mixer block's zero buffer decay_A_log [E·n, 1]);
# so that log_decay(l) = ΣΔ · A = Σ_k log(1 + λΔ(k)), each element's product of step multipliers over the
# context (per element, Mamba-1 semantics): what the composer's decay-based weights read.
COFFEE = Architecture(
    name="coffee",
    per_element_decay=True,
    num_state_layers=lambda c: c.num_hidden_layers,
    state_shapes=lambda c: ((_coffee_elements(c), 1), (_coffee_elements(c), 0)),
    decay_shapes=lambda c: ((_coffee_elements(c),), (_coffee_elements(c), 1)),
    A_log_of=_coffee_A_log,
    cache_module="cache",
    cache_class_name="ComposableMambaCache",
    display_name="COFFEE",
    model_module="hf_statecompose.models.coffee.modeling_coffee",
    model_classes=("CoffeeModel", "CoffeeForCausalLM"),
    guarded=False,  # refuses past_states itself (models/causal_lm.py)
    composition_note="every method (an approximation under state feedback)",
)

# ---------------------------------------------------------------------------------------------- hybrids
# Mamba layers plus attention layers (transformers' jamba, zamba2, bamba, granitemoehybrid, nemotron_h, falcon_h1).
# A state holds one SSM state layer per Mamba layer (as Mamba-2's, or Mamba-1's for Jamba) and, per attention
# layer, the context's keys and values [B, kv heads, L, head dim] with their positions [B, L] (-1: padding); the
# cache (.hybrid_cache) keeps one layer object per model layer, aligned with the model's layer indices.
_SSM_KINDS = {
    "linear_attention": "ssm",
    "mamba": "ssm",
    "m": "ssm",
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "hybrid": "both",
    "mlp": "none",
    "moe": "none",
    "-": "none",
    "e": "none",
}


def _kinds(names) -> tuple:
    kinds = []
    for name in names:
        kind = _SSM_KINDS.get(str(name).lower())
        if kind is None:
            raise ValueError(f"unknown layer type {name!r} in the config (hf_statecompose knows {sorted(_SSM_KINDS)})")
        kinds.append(kind)
    return tuple(kinds)


def _listed_kinds(*keys):
    def kinds(c):
        for key in keys:
            names = getattr(c, key, None)
            if names:
                return _kinds(names)
        raise ValueError(f"the config lists no layer types ({' / '.join(keys)})")

    return kinds


def _jamba_kinds(c):
    return tuple(
        "attention" if i % c.attn_layer_period == c.attn_layer_offset else "ssm" for i in range(c.num_hidden_layers)
    )


def _bamba_kinds(c):
    attention = set(getattr(c, "attn_layer_indices", None) or ())
    return tuple("attention" if i in attention else "ssm" for i in range(c.num_hidden_layers))


_HYBRID_NOTE = "SSM layers by the method, attention keys of all contexts"


def _mamba2_hybrid(
    name,
    *,
    heads,
    head_dim,
    state,
    groups,
    kernel,
    kinds,
    mixer_paths,
    attention_shape,
    rotary_dims,
    display_name,
    model_classes,
    mixer_class,
    mixer_forward=_MAMBA2_FORWARD,
):
    def shapes(c):
        h, p, n, g = getattr(c, heads), getattr(c, head_dim), getattr(c, state), getattr(c, groups)
        return (h, p, n), (h * p + 2 * g * n, getattr(c, kernel))

    return Architecture(
        name=name,
        per_element_decay=False,
        num_state_layers=lambda c: sum(kind in ("ssm", "both") for kind in kinds(c)),
        state_shapes=shapes,
        decay_shapes=lambda c: ((getattr(c, heads),), (getattr(c, heads),)),
        A_log_of=None,  # set below (it reads the layout)
        cache_module="hybrid_cache",
        cache_class_name="ComposableHybridCache",
        layer_kinds=kinds,
        mixer_paths=mixer_paths,
        attention_shape=attention_shape,
        rotary_dims=rotary_dims,
        display_name=display_name,
        model_module=compat.modeling_module(name),
        model_classes=model_classes,
        mixer_class=mixer_class,
        mixer_forward=mixer_forward,
        composition_note=_HYBRID_NOTE,
    )


def _head_dim(c):
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _kv_shape(c):
    return (getattr(c, "num_key_value_heads", None) or c.num_attention_heads, _head_dim(c))


def _rope_fraction(c) -> float:
    parameters = getattr(c, "rope_parameters", None) or {}
    return float(parameters.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)) or 1.0)


BAMBA = _mamba2_hybrid(
    "bamba",
    heads="mamba_n_heads",
    head_dim="mamba_d_head",
    state="mamba_d_state",
    groups="mamba_n_groups",
    kernel="mamba_d_conv",
    kinds=_bamba_kinds,
    mixer_paths=(("mamba",),),
    attention_shape=_kv_shape,
    rotary_dims=lambda c: int(_head_dim(c) * _rope_fraction(c)),
    display_name="Bamba",
    model_classes=("BambaModel", "BambaForCausalLM"),
    mixer_class="BambaMixer",
)
GRANITE_MOE_HYBRID = _mamba2_hybrid(
    "granitemoehybrid",
    heads="mamba_n_heads",
    head_dim="mamba_d_head",
    state="mamba_d_state",
    groups="mamba_n_groups",
    kernel="mamba_d_conv",
    kinds=_listed_kinds("layer_types", "layers_block_type"),
    mixer_paths=(("mamba",),),
    attention_shape=_kv_shape,
    rotary_dims=lambda c: _head_dim(c) if getattr(c, "position_embedding_type", None) == "rope" else 0,
    display_name="Granite-4.0-H",
    model_classes=("GraniteMoeHybridModel", "GraniteMoeHybridForCausalLM"),
    mixer_class="GraniteMoeHybridMambaLayer",
)
NEMOTRON_H = _mamba2_hybrid(
    "nemotron_h",
    heads="mamba_num_heads",
    head_dim="mamba_head_dim",
    state="ssm_state_size",
    groups="n_groups",
    kernel="conv_kernel",
    kinds=_listed_kinds("layers_block_type", "layer_types"),
    mixer_paths=(("mixer",),),
    attention_shape=_kv_shape,
    rotary_dims=lambda c: 0,
    display_name="Nemotron-H",
    model_classes=("NemotronHModel", "NemotronHForCausalLM"),
    mixer_class="NemotronHMamba2Mixer",
)
FALCON_H1 = _mamba2_hybrid(
    "falcon_h1",
    heads="mamba_n_heads",
    head_dim="mamba_d_head",
    state="mamba_d_state",
    groups="mamba_n_groups",
    kernel="mamba_d_conv",
    kinds=lambda c: ("both",) * c.num_hidden_layers,
    mixer_paths=(("mamba",),),
    attention_shape=_kv_shape,
    rotary_dims=_head_dim,
    display_name="Falcon-H1",
    model_classes=("FalconH1Model", "FalconH1ForCausalLM"),
    mixer_class="FalconH1Mixer",
    mixer_forward="hf_statecompose.models.falcon_h1:falcon_h1_mixer_forward",
)
ZAMBA2 = _mamba2_hybrid(
    "zamba2",
    heads="n_mamba_heads",
    head_dim="mamba_headdim",
    state="mamba_d_state",
    groups="mamba_ngroups",
    kernel="mamba_d_conv",
    kinds=_listed_kinds("layers_block_type", "layer_types"),
    mixer_paths=(("mamba",), ("mamba_decoder", "mamba")),
    attention_shape=lambda c: (getattr(c, "num_key_value_heads", None) or c.num_attention_heads, c.attention_head_dim),
    rotary_dims=lambda c: c.attention_head_dim if getattr(c, "use_mem_rope", False) else 0,
    display_name="Zamba2",
    model_classes=("Zamba2Model", "Zamba2ForCausalLM"),
    mixer_class="Zamba2MambaMixer",
)


def _jamba_inner(c) -> int:
    return int(c.mamba_expand * c.hidden_size)


JAMBA = Architecture(
    name="jamba",
    per_element_decay=True,  # Mamba-1 mixers
    num_state_layers=lambda c: sum(kind == "ssm" for kind in _jamba_kinds(c)),
    state_shapes=lambda c: ((_jamba_inner(c), c.mamba_d_state), (_jamba_inner(c), c.mamba_d_conv)),
    decay_shapes=lambda c: ((_jamba_inner(c),), (_jamba_inner(c), c.mamba_d_state)),
    A_log_of=None,  # type: ignore[arg-type]  # set below (it reads the layout), as for every hybrid
    cache_module="hybrid_cache",
    cache_class_name="ComposableHybridCache",
    layer_kinds=_jamba_kinds,
    mixer_paths=(("mamba",),),
    attention_shape=_kv_shape,
    display_name="Jamba",
    model_module=compat.modeling_module("jamba"),
    model_classes=("JambaModel", "JambaForCausalLM"),
    mixer_class="JambaMambaMixer",
    mixer_forward=_MAMBA_FORWARD,
    composition_note=_HYBRID_NOTE,
)


def _hybrid_A_log_of(layout):
    def A_log_of(backbone, v):
        layers = layout.ssm_layer_indices(backbone.config)
        if not 0 <= v < len(layers):
            return None
        mixer = layout.mixer_of(backbone.layers[layers[v]])
        A_log = _attribute(mixer, layout.A_log_path)
        # one per head: Kimi's forget gate keeps it [1, 1, H, 1] (a view, so that edits reach the parameter)
        return A_log.view(-1) if A_log is not None and len(layout.decay_shapes(backbone.config)[1]) == 1 else A_log

    return A_log_of


HYBRIDS = tuple(
    dataclasses.replace(a, A_log_of=_hybrid_A_log_of(a))
    for a in (JAMBA, ZAMBA2, BAMBA, GRANITE_MOE_HYBRID, NEMOTRON_H, FALCON_H1)
)
for _a in HYBRIDS:  # the A_log lookup closes over the first object: point it at the final one
    object.__setattr__(_a, "A_log_of", _hybrid_A_log_of(_a))

# ---------------------------------------------------------------------------------------------- delta-rule hybrids
# Gated DeltaNet layers plus attention layers (transformers' qwen3_next, qwen3_5_text, qwen3_5_moe_text,
# olmo_hybrid; Kimi Linear's Kimi delta attention below). A GDN layer's state per value head is S [k_dim, v_dim] with the step
# S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ: a matrix transition, so a state layer carries, beside the
# SSM state (``ssm_states[v]`` [B, H, k_dim, v_dim], float32) and the conv window ([B, 2·key_dim + value_dim, K]),
# its context's *transition* ``transitions[v]`` [B, H, k_dim, k_dim] (float32): the product of the steps, latest on
# the left, so that encoding A then B gives S_AB = M_B S_A + S_B (hf_statecompose.ops.delta_rule). ΣΔ is the
# scalar part of the decay, as for Mamba-2: ΣΔ[h] = Σ_t softplus(a_t + dt_bias)[h] and A = −exp(A_log) [H], so
# exp(A · ΣΔ) is the product of the α_t (what soup / weighted and the checks read; the order-based methods read M).
_GDN_FORWARD = "hf_statecompose.models.gated_deltanet:gated_deltanet_mixer_forward"
_DELTA_NOTE = (
    "delta-rule layers as affine maps by the method (`picaso_s` up to 12 states), attention keys of all contexts"
)


def _gdn_state_shapes(c):
    heads, k_dim, v_dim = c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    conv_dim = 2 * c.linear_num_key_heads * k_dim + heads * v_dim
    return (heads, k_dim, v_dim), (conv_dim, c.linear_conv_kernel_dim)


# what a real transition may exceed its bound by: float32 rounding of the encode (measured at most 1e-7 relative,
# benchmarks/state_checks.py); below TRANSITION_FLOOR a transition contributes nothing a float32 state can hold (the
# products of long contexts underflow there, where their bound exp(A·ΣΔ) is smaller still)
TRANSITION_RTOL = 1e-4
TRANSITION_FLOOR = 1e-30
# a determinant is reliable only down to the rounding of the product: below this, KDA's bound is taken as this
_LOG_DET_FLOOR = -13.8  # log(1e-6)


def _spectral_norm(matrices):
    """The exact largest singular value of each ``[..., k, k]`` matrix (float64)."""
    import torch

    return torch.linalg.matrix_norm(matrices.double(), ord=2)


def _check_transition_values(
    extras: dict,
    v: int,
    refuse,
    *,
    config,
    num_tokens=None,
    encoded: bool = False,
    decay=None,
    rounding: float = 0.0,
) -> None:
    """What a product of delta-rule steps can be. A step is ``α (I − β k kᵀ)`` (gated DeltaNet: α = exp(g) per head,
    β in [0, 2], |k| <= 1) or ``(I − β k kᵀ) Diag(α)`` (KDA: α per key channel), each of spectral norm <= its largest
    α <= 1, so per batch row and head the transition ``M`` (the product) is finite and:

    * ``‖M‖₂ <= 1`` for every state (a composition's too: soup / weighted average transitions);
    * for a state as encoded (``encoded``: it carries its token ids) with ``decay = (ΣΔ, A)``: gated DeltaNet
      (ΣΔ ``[B, H]``) ``‖M‖₂ <= exp(A·ΣΔ)`` per head, the product of its α; KDA (ΣΔ ``[B, H, k]``) ``|det M| <=
      exp(Σ_c A·ΣΔ_c)`` (each step's determinant is ``(1 − β|k|²) Π_c α_c``; a per-channel bound on ``‖M‖₂`` does
      not hold, as the rotations mix the channels).

    Tolerances: relative :data:`TRANSITION_RTOL` (the encode's float32 rounding), nothing below
    :data:`TRANSITION_FLOOR`, and for transitions read back from a lower-precision store ``rounding`` (its unit
    roundoff ``u``: each entry moved by at most ``u``, so ``‖M‖₂`` by at most ``u·‖M‖_F``). The norm test: heads whose
    Frobenius norm is within the bound pass; the others take one Cholesky factorisation of ``I − NᵀN`` (``N = M /
    bound``: it exists iff ``‖N‖₂ < 1``); a head it fails is measured exactly (SVD) before refusing. Its cost beside
    the load of a state: benchmarks/state_checks.py."""
    import torch

    transition = extras["transitions"]
    if not torch.isfinite(transition).all():
        refuse(f"layer {v} transition contains NaN or inf")
    if transition.numel() == 0:
        return
    M = transition.detach().float()
    k = M.shape[-1]
    limit = torch.ones(M.shape[:-2], dtype=torch.float64, device=M.device)
    what = "1"
    per_channel = None
    if encoded and decay is not None:
        delta_sum, A = (t.detach().double().to(M.device) for t in decay)
        if delta_sum.dim() == 2:  # gated DeltaNet: α per head
            limit = torch.exp(A * delta_sum)
            what = "exp(A·ΣΔ), its own decay,"
        elif delta_sum.dim() == 3:  # KDA: α per key channel
            per_channel = (A[:, None] * delta_sum).sum(-1)  # [B, H]: log of the product of every channel's decay
    limit = torch.clamp(limit * (1 + TRANSITION_RTOL), min=TRANSITION_FLOOR)
    frobenius = torch.linalg.matrix_norm(M).double()  # >= the spectral norm: where it is within the limit, done
    if rounding:
        limit = limit + rounding / (1 - rounding) * frobenius
    unsure = frobenius > limit
    if bool(unsure.any()):
        # N = M / limit has ‖N‖₂ < 1 iff I − NᵀN is positive definite (a Cholesky factorisation exists); in float32,
        # whose rounding of NᵀN (about k·6e-8) is far inside the margin TRANSITION_RTOL leaves a real transition
        heads = M[unsure]
        scaled = heads / limit[unsure].float()[:, None, None]
        eye = torch.eye(k, dtype=scaled.dtype, device=M.device)
        _, info = torch.linalg.cholesky_ex(eye - scaled.mT @ scaled)
        if bool((info != 0).any()):
            norms = torch.zeros_like(limit)
            norms[unsure] = _spectral_norm(heads)  # exact, before refusing
            over = norms > limit
            if bool(over.any()):
                index = tuple(int(i) for i in over.nonzero()[0])
                refuse(
                    f"layer {v} transition (row {index[0]}, head {index[1]}) has spectral norm "
                    f"{float(norms[index]):.4g} > {float(limit[index]):.4g}: a product of delta-rule steps is at most "
                    f"{what} (hand-made, or another context's, layer's or model's)"
                )
    if per_channel is not None and not rounding:
        log_det = torch.linalg.slogdet(M.double()).logabsdet
        allowed = torch.clamp(per_channel, min=_LOG_DET_FLOOR) + 1e-3
        if bool((log_det > allowed).any()):
            index = tuple(int(i) for i in (log_det > allowed).nonzero()[0])
            refuse(
                f"layer {v} transition (row {index[0]}, head {index[1]}) has log |det| {float(log_det[index]):.4g} > "
                f"{float(per_channel[index]):.4g}: a product of KDA steps has |det| at most its decays' product "
                "exp(Σ A·ΣΔ) (hand-made, or another context's, layer's or model's)"
            )


def _transitions(row_shape):
    return ExtraTensor(
        "transitions", "transition", "transition", row_shape, lambda d: _torch().float32, stored_like_state=True
    )


def _delta_rule_hybrid(
    name,
    *,
    folder,
    display_name,
    model_classes,
    mixer_class,
    rotary_dims,
    state_shapes=_gdn_state_shapes,
    decay_shapes=lambda c: ((c.linear_num_value_heads,), (c.linear_num_value_heads,)),
    transition_shape=lambda c: (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_key_head_dim),
    mixer_paths=(("linear_attn",),),
    A_log_path=("A_log",),
    attention_shape=_kv_shape,
):
    return Architecture(
        name=name,
        per_element_decay=False,
        num_state_layers=lambda c: sum(kind == "ssm" for kind in _listed_kinds("layer_types")(c)),
        state_shapes=state_shapes,
        decay_shapes=decay_shapes,
        A_log_of=None,  # set below (it reads the layout), as for every hybrid
        cache_module="hybrid_cache",
        cache_class_name="ComposableDeltaRuleCache",
        extras=(_transitions(transition_shape),),
        check_extra_values=_check_transition_values,
        layer_kinds=_listed_kinds("layer_types"),
        mixer_paths=mixer_paths,
        A_log_path=A_log_path,
        attention_shape=attention_shape,
        rotary_dims=rotary_dims,
        display_name=display_name,
        model_module=compat.modeling_module(folder),
        model_classes=model_classes,
        mixer_class=mixer_class,
        mixer_forward=_GDN_FORWARD,
        composition_note=_DELTA_NOTE,
    )


def _partial_rope(c):
    return int(_head_dim(c) * _rope_fraction(c))


# model_type: (transformers' models/ folder, display name, bare model class, causal LM class, stock GDN mixer class)
_GDN_MODELS = {
    "qwen3_next": ("qwen3_next", "Qwen3-Next", "Qwen3NextModel", "Qwen3NextForCausalLM", "Qwen3NextGatedDeltaNet"),
    "qwen3_5_text": ("qwen3_5", "Qwen3.5", "Qwen3_5TextModel", "Qwen3_5ForCausalLM", "Qwen3_5GatedDeltaNet"),
    "qwen3_5_moe_text": (
        "qwen3_5_moe",
        "Qwen3.5-MoE",
        "Qwen3_5MoeTextModel",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeGatedDeltaNet",
    ),
    "olmo_hybrid": (
        "olmo_hybrid",
        "Olmo-Hybrid",
        "OlmoHybridModel",
        "OlmoHybridForCausalLM",
        "OlmoHybridGatedDeltaNet",
    ),
}
QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, OLMO_HYBRID = (
    _delta_rule_hybrid(
        name,
        folder=folder,
        display_name=display,
        model_classes=(bare, causal),
        mixer_class=mixer,
        rotary_dims=_partial_rope,
    )
    for name, (folder, display, bare, causal, mixer) in _GDN_MODELS.items()
)
# Kimi Linear: Kimi delta attention (KDA) layers, whose step (I − β_t k_t k_tᵀ) Diag(exp g_t) decays each key channel
# (g_t = A · softplus(f_t + dt_bias), A = −exp(A_log) per head): ΣΔ [H, k_dim], A [H]; q, k and v have the same heads
# (no GQA), conv over [q | k | v]. Its attention is MLA without positional encoding (NoPE): the cache holds the
# compressed latent [B, 1, L, kv_lora_rank] as the keys and the shared rotary key part [B, 1, L, qk_rope_head_dim]
# (never rotated) as the values; they compose as cached, like any NoPE keys.
KIMI_LINEAR = _delta_rule_hybrid(
    "kimi_linear",
    folder="kimi_linear",
    display_name="Kimi Linear",
    model_classes=("KimiLinearModel", "KimiLinearForCausalLM"),
    mixer_class="KimiLinearDeltaAttention",
    rotary_dims=lambda c: 0,
    state_shapes=lambda c: (
        (c.linear_num_heads, c.linear_head_dim, c.linear_head_dim),
        (3 * c.linear_num_heads * c.linear_head_dim, c.linear_conv_kernel_dim),
    ),
    decay_shapes=lambda c: ((c.linear_num_heads, c.linear_head_dim), (c.linear_num_heads,)),
    transition_shape=lambda c: (c.linear_num_heads, c.linear_head_dim, c.linear_head_dim),
    mixer_paths=(("self_attn",),),
    A_log_path=("forget_gate", "A_log"),
    attention_shape=lambda c: (1, c.kv_lora_rank, c.qk_rope_head_dim),
)
DELTA_RULE_HYBRIDS = tuple(
    dataclasses.replace(a, A_log_of=_hybrid_A_log_of(a))
    for a in (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, OLMO_HYBRID, KIMI_LINEAR)
)
for _a in DELTA_RULE_HYBRIDS:
    object.__setattr__(_a, "A_log_of", _hybrid_A_log_of(_a))


def has_transitions(layout: Architecture) -> bool:
    """Whether the states of ``layout`` compose as affine maps with matrix transitions (delta-rule layers)."""
    return any(extra.attribute == "transitions" for extra in layout.extras)


# the architecture table: model_type -> its row. Read it, never copy it: rows registered later (:func:`register`)
# are known everywhere that reads it
ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (MAMBA, MAMBA2, FALCON_MAMBA, *HYBRIDS, *DELTA_RULE_HYBRIDS, SERPENT_MAMBA, COFFEE)
}


def _row_problems(row) -> list[str]:
    """What is wrong with a row that :func:`register` is given (empty: nothing)."""
    if not isinstance(row, Architecture):
        return [f"a row is an Architecture, got {type(row).__name__}"]
    problems = []
    if not (isinstance(row.name, str) and row.name.isidentifier()):
        problems.append(f"name must be a model_type (an identifier, e.g. 'mamba2'), got {row.name!r}")
    if not (isinstance(row.display_name, str) and row.display_name.strip()):
        problems.append(f"display_name must be a non-empty string (what the docs call it), got {row.display_name!r}")
    if not (isinstance(row.model_module, str) and all(part.isidentifier() for part in row.model_module.split("."))):
        problems.append(f"model_module must be a dotted module name, got {row.model_module!r}")
    if not (
        isinstance(row.model_classes, tuple)
        and row.model_classes
        and all(isinstance(name, str) and name.isidentifier() for name in row.model_classes)
    ):
        problems.append(f"model_classes must be a non-empty tuple of class names, got {row.model_classes!r}")
    if (row.mixer_class is None) != (row.mixer_forward is None):
        problems.append(
            "mixer_class and mixer_forward come together (the stock mixer and the forward that replaces it) or not at "
            f"all (the mixers run on the cache themselves), got {row.mixer_class!r} and {row.mixer_forward!r}"
        )
    elif row.mixer_forward is not None:
        module, colon, function = str(row.mixer_forward).partition(":")
        if not (isinstance(row.mixer_class, str) and row.mixer_class.isidentifier()):
            problems.append(f"mixer_class must be a class name, got {row.mixer_class!r}")
        if not (isinstance(row.mixer_forward, str) and colon and function.isidentifier() and module):
            problems.append(f"mixer_forward must be 'module:function', got {row.mixer_forward!r}")
    if not callable(row.num_state_layers) or not callable(row.state_shapes) or not callable(row.decay_shapes):
        problems.append("num_state_layers, state_shapes and decay_shapes must be functions of the config")
    return problems


def register(row: Architecture) -> Architecture:
    """Add ``row`` to the architecture table (:data:`ARCHITECTURES`), checked: a name not taken, a display name,
    the module and classes of the models, the mixer class and its forward together. Its classes' stock
    ``forward`` / ``generate`` refuse ``past_states`` until enabled (if ``row.guarded``) from then on; ``enable``,
    ``encode``, state files, stores, the error messages and :func:`support_table` know it. Returns ``row``."""
    problems = _row_problems(row)
    if problems:
        raise ValueError("not an architecture row: " + "; ".join(problems))
    if row.name in ARCHITECTURES:
        raise ValueError(f"architecture {row.name!r} is already registered ({ARCHITECTURES[row.name].label()})")
    ARCHITECTURES[row.name] = row
    if row.guarded:
        from .. import _guard

        _guard.install({row.model_module: row.model_classes})
    return row


def unregister(name: str) -> Architecture:
    """Remove architecture ``name`` from the table (the guard of its classes, if any, stays: they keep refusing
    ``past_states``). Returns the row."""
    if not isinstance(name, str) or name not in ARCHITECTURES:
        raise ValueError(f"no architecture {name!r} is registered; hf_statecompose knows {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES.pop(name)


def guarded_classes() -> dict[str, tuple[str, ...]]:
    """module -> the classes in it whose stock ``forward`` / ``generate`` must refuse ``past_states`` (the guard's
    table: ``hf_statecompose/_guard.py``)."""
    out: dict[str, tuple[str, ...]] = {}
    for row in ARCHITECTURES.values():
        if row.guarded:
            out[row.model_module] = tuple(dict.fromkeys(out.get(row.model_module, ()) + row.model_classes))
    return out


def supported_types_text() -> str:
    """The supported model types, for one-line errors (the display names make it too long: 15 rows, 460 characters):
    ``'mamba', 'mamba2', ...``."""
    return ", ".join(repr(name) for name in ARCHITECTURES)


def supported_text() -> str:
    """The supported architectures, for error messages: ``Mamba ('mamba'), Mamba-2 ('mamba2'), ...``."""
    return ", ".join(f"{row.display_name or row.name} ({row.name!r})" for row in ARCHITECTURES.values())


def supported_classes_text() -> str:
    """The model classes of every architecture, for error messages: ``MambaModel / MambaForCausalLM, ...``."""
    return ", ".join(" / ".join(row.model_classes) for row in ARCHITECTURES.values())


SUPPORT_TABLE_HEADER = (
    "| model (`model_type`) | `past_states` in `forward` / `generate` | one state + query = context + query "
    "| composition | state files, stores |\n|---|---|---|---|---|"
)


def support_table() -> str:
    """The docs' support table (README.md, docs/index.md), one line per kind of support, from the rows:
    architectures that compose alike share a line, in the table's order. ``tests/test_architecture_table.py``
    checks that the docs carry this table."""
    lines: dict[tuple, list[Architecture]] = {}
    for row in ARCHITECTURES.values():
        lines.setdefault((row.composition_note, row.is_hybrid), []).append(row)
    body = [
        f"| {', '.join(row.label() for row in rows)} | yes | exact | {note} | {'yes, with keys' if hybrid else 'yes'} |"
        for (note, hybrid), rows in lines.items()
    ]
    return "\n".join([SUPPORT_TABLE_HEADER, *body])


def check_extra_tensors(
    layout: Architecture,
    extras: dict,
    v: int,
    *,
    config,
    model_dtype: torch.dtype,
    batch: int,
    device,
    refuse: Callable[[str], NoReturn],
    num_tokens: torch.Tensor | None = None,
    encoded: bool = False,
    decay: tuple | None = None,
    rounding: float = 0.0,
) -> None:
    """The extra tensors of state layer ``v`` (``{attribute: tensor}``) as ``layout`` describes them: present,
    dtypes (from ``model_dtype``), shapes (``[batch, *row_shape(config)]``), device and values (the invariants of
    a real encoding, :func:`_check_resampling_values` for SeRpEnt). ``num_tokens`` (``[batch]`` int64, optional)
    lets the values be checked against the token counts, ``encoded`` says that the state is as encoded (it
    carries its token ids), ``decay`` is the layer's ``(ΣΔ, A)`` (what bounds a delta-rule transition) and
    ``rounding`` the unit roundoff of the dtype the extras were stored in (0: not rounded). ``refuse(problem)`` raises. Shared by the state validation and the store's entry
    checks."""
    import torch

    for extra in layout.extras:
        tensor = extras.get(extra.attribute)
        if not isinstance(tensor, torch.Tensor):
            refuse(
                f"layer {v} {extra.label} is missing ({type(tensor).__name__}): the state carries no "
                f"{layout.name} resampling state"
            )
        dtype, shape = extra.dtype(model_dtype), (batch, *extra.row_shape(config))
        if tensor.dtype != dtype:
            refuse(f"layer {v} {extra.label} is {tensor.dtype}, expected {dtype}")
        if tuple(tensor.shape) != shape:
            refuse(
                f"layer {v} {extra.label} has shape {tuple(tensor.shape)}, expected {shape} "
                f"(batch {batch}, the rest from the {layout.name} config)"
            )
        if device is not None and tensor.device != device:
            refuse(f"layer {v} {extra.label} is on {tensor.device}, the states on {device}")
    if layout.check_extra_values is not None:
        counts = (
            num_tokens
            if isinstance(num_tokens, torch.Tensor)
            and num_tokens.dtype == torch.int64
            and tuple(num_tokens.shape) == (batch,)
            else None
        )
        with torch.no_grad():
            layout.check_extra_values(
                extras,
                v,
                refuse,
                config=config,
                num_tokens=counts.to(extras[layout.extras[0].attribute].device) if counts is not None else None,
                encoded=encoded and counts is not None,
                decay=decay,
                rounding=rounding,
            )


def architecture(name: str | None) -> Architecture:
    """The row of architecture ``name`` (a ``model_type``: ``"mamba"``, ``"mamba2"``, ...; :data:`ARCHITECTURES`)."""
    layout = ARCHITECTURES.get(name) if isinstance(name, str) else None
    if layout is None:
        raise ValueError(f"unknown architecture {name!r}; hf_statecompose knows {', '.join(map(repr, ARCHITECTURES))}")
    return layout


def architecture_of_config(config) -> Architecture:
    return architecture(getattr(config, "model_type", None))
