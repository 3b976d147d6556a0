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
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class ExtraTensor:
    """A per-state-layer tensor beyond the SSM state, conv window and ΣΔ: ``getattr(cache, attribute)[v]``,
    ``[B, *row_shape(config)]`` of ``dtype(model_dtype)``, stored in files as ``f"{file_key}.{v}"``."""

    attribute: str
    file_key: str
    label: str
    row_shape: Callable[[object], tuple]
    dtype: Callable[[torch.dtype], torch.dtype]


@dataclass(frozen=True)
class Architecture:
    name: str
    per_element_decay: bool  # ΣΔ [B, D] with A [D, N] (Mamba-1 semantics) vs ΣΔ [B, H] with A [H]
    num_state_layers: Callable[[object], int]
    state_shapes: Callable[[object], tuple]  # per-row (SSM state, conv window)
    decay_shapes: Callable[[object], tuple]  # (per-row ΣΔ, A)
    A_log_of: Callable[[torch.nn.Module, int], torch.Tensor | None]  # (backbone, state layer) -> A_log or None
    cache_module: str  # module (in this package) and class of the cache that holds these states
    cache_class_name: str
    extras: tuple[ExtraTensor, ...] = field(default=())
    # value checks of the extras of one state layer, after their dtypes and shapes were checked:
    # ({attribute: tensor of that layer}, layer, refuse(problem)) -> None; refuse raises
    check_extra_values: Callable | None = None

    def cache_class(self) -> type:
        return getattr(importlib.import_module(f"{__package__}.{self.cache_module}"), self.cache_class_name)

    def is_cache_class(self, cls: type) -> bool:
        """Whether ``cls`` is :meth:`cache_class`, compared by name: no import, so that a forward traced by
        ``torch.compile(fullgraph=True)`` (which cannot trace ``importlib``) stays one graph."""
        return cls.__module__ == f"{__package__}.{self.cache_module}" and cls.__qualname__ == self.cache_class_name


def _mixer_A_log(backbone, v):
    return getattr(getattr(backbone.layers[v], "mixer", None), "A_log", None)


# ---------------------------------------------------------------------------------------------- Mamba, Mamba-2
MAMBA = Architecture(
    name="mamba",
    per_element_decay=True,
    num_state_layers=lambda c: c.num_hidden_layers,
    state_shapes=lambda c: ((c.intermediate_size, c.state_size), (c.intermediate_size, c.conv_kernel)),
    decay_shapes=lambda c: ((c.intermediate_size,), (c.intermediate_size, c.state_size)),
    A_log_of=_mixer_A_log,
    cache_module="cache",
    cache_class_name="ComposableMambaCache",
)

# FalconMamba (transformers' falcon_mamba, e.g. falcon-mamba-7b): Mamba-1 with weightless RMS norms on Δ, B and C
# inside the mixer; its states are Mamba-1 states in every respect
FALCON_MAMBA = dataclasses.replace(MAMBA, name="falcon_mamba")


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


def _check_resampling_values(extras: dict, v: int, refuse) -> None:
    """clock >= 0; every window time in [0, clock]; the valid mask right aligned (missing neighbours, at the
    start of a sequence, first: the model packs the real inputs to the right, oldest first) with non-decreasing
    times over the valid entries; window inputs and last output finite."""
    clock, times, valid = extras["clocks"], extras["window_times"], extras["window_valid"]
    if (clock < 0).any():
        refuse(f"layer {v} resampling clock is negative ({clock.min().item()})")
    if (times < 0).any() or (times > clock[:, None]).any():
        refuse(f"layer {v} resampling window times must lie in [0, clock] (a neighbour cannot come after the clock)")
    if valid.shape[1] > 1:
        if (valid[:, :-1] & ~valid[:, 1:]).any():
            refuse(f"layer {v} resampling window valid mask is not right aligned (a missing neighbour after a real one)")
        if ((times[:, 1:] < times[:, :-1]) & valid[:, :-1]).any():
            refuse(f"layer {v} resampling window times decrease over the real neighbours")
    for label, tensor in (("window inputs", extras["window_inputs"]), ("last output", extras["last_outputs"])):
        if not torch.isfinite(tensor).all():
            refuse(f"layer {v} resampling {label} contain NaN or inf")


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
        ExtraTensor("clocks", "resample.clock", "resampling clock", lambda c: (), lambda d: torch.int64),
        ExtraTensor("window_inputs", "resample.inputs", "resampling window inputs",
                    lambda c: (c.resample_window, c.hidden_size), lambda d: torch.promote_types(d, torch.float32)),
        ExtraTensor("window_times", "resample.times", "resampling window times",
                    lambda c: (c.resample_window,), lambda d: torch.int64),
        ExtraTensor("window_valid", "resample.valid", "resampling window valid mask",
                    lambda c: (c.resample_window,), lambda d: torch.bool),
        ExtraTensor("last_outputs", "resample.last_output", "resampling last output",
                    lambda c: (c.hidden_size // _branches(c),), lambda d: d),
    ),
    check_extra_values=_check_resampling_values,
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
)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (MAMBA, MAMBA2, FALCON_MAMBA, SERPENT_MAMBA, COFFEE)}


def check_extra_tensors(layout: Architecture, extras: dict, v: int, *, config, model_dtype: torch.dtype, batch: int,
                        device, refuse) -> None:
    """The extra tensors of state layer ``v`` (``{attribute: tensor}``) as ``layout`` describes them: present,
    dtypes (from ``model_dtype``), shapes (``[batch, *row_shape(config)]``), device and values.
    ``refuse(problem)`` raises. Shared by the state validation and the store's entry checks."""
    for extra in layout.extras:
        tensor = extras.get(extra.attribute)
        if not isinstance(tensor, torch.Tensor):
            refuse(f"layer {v} {extra.label} is missing ({type(tensor).__name__}): the state carries no "
                   f"{layout.name} resampling state")
        dtype, shape = extra.dtype(model_dtype), (batch, *extra.row_shape(config))
        if tensor.dtype != dtype:
            refuse(f"layer {v} {extra.label} is {tensor.dtype}, expected {dtype}")
        if tuple(tensor.shape) != shape:
            refuse(f"layer {v} {extra.label} has shape {tuple(tensor.shape)}, expected {shape} "
                   f"(batch {batch}, the rest from the {layout.name} config)")
        if device is not None and tensor.device != device:
            refuse(f"layer {v} {extra.label} is on {tensor.device}, the states on {device}")
    if layout.check_extra_values is not None:
        with torch.no_grad():
            layout.check_extra_values(extras, v, refuse)


def architecture(name: str) -> Architecture:
    """The description of architecture ``name`` (``"mamba"``, ``"mamba2"``, ``"falcon_mamba"``, ``"serpent_mamba"``,
    ``"coffee"``)."""
    try:
        return ARCHITECTURES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown architecture {name!r}; hf_statecompose knows {', '.join(map(repr, ARCHITECTURES))}"
        ) from None


def architecture_of_config(config) -> Architecture:
    return architecture(getattr(config, "model_type", None))
