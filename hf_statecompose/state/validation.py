"""Checks that turn bad input into a clear error naming the problem and the fix."""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from collections.abc import Callable, Sequence

import torch

from .architectures import ARCHITECTURES, MAMBA, architecture, architecture_of_config, check_extra_tensors


def _describe(cache) -> str:
    info = cache.model_info
    return (
        f"{info.get('model_type', cache.architecture)} model with {info.get('num_hidden_layers', cache.num_layers)} "
        f"layers, hidden {info.get('hidden_size', '?')} (fingerprint {cache.fingerprint[:12]})"
    )


def _is_state_class(cls: type) -> bool:
    """Whether ``cls`` is ``ComposableMambaCache`` or a subclass, compared by name through the architectures'
    registry: validation sits below the cache modules (they import it, never the other way round)."""
    return any(MAMBA.is_cache_class(base) for base in cls.__mro__)


def check_is_state(state, where: str = "past_states"):
    if not _is_state_class(type(state)):
        raise TypeError(
            f"{where} must hold ComposableMambaCache objects (from ComposableMambaCache.encode or .load), "
            f"got {type(state).__name__}"
        )
    if not state.layers or not state.is_filled():
        raise ValueError(f"{where} holds a ComposableMambaCache with no state; encode a context into it first")


_CORRUPTED = "contains NaN or inf; the state is corrupted, re-encode the context"


def _finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor, True when the sum of ``tensor`` is finite (which proves every element finite; False
    may also mean a sum that overflowed: :func:`all_finite` then decides)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    total = (
        tensor.sum(dtype=torch.float32) if tensor.element_size() < 4 and tensor.is_floating_point() else tensor.sum()
    )
    return torch.isfinite(total)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, in one reduction: a NaN or inf anywhere makes the sum NaN or inf, so a
    finite sum proves it (about 100x faster than ``isfinite(t).all()`` on a CPU); only a non-finite sum (a bad
    element, or finite values whose sum overflows) takes the exact elementwise test."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    with torch.no_grad():
        return bool(_finite_flag(tensor)) or bool(torch.isfinite(tensor).all())


def _check_layer_values(state, where: str, values_checked: tuple[str, ...] = ()) -> None:
    """Every layer's values, as :func:`check_state` lists them, with one host sync for the whole state (a
    flag per check, stacked and read once); only on a failure are the checks run one by one, in order, to name
    the first problem. Per layer: SSM state, conv window and ΣΔ finite, ΣΔ >= 0, A finite and <= 0.
    ``values_checked``: the layer tensors (``"ssm_state"``, ``"conv_state"``, ``"delta_sum"``, ``"A"``) whose values
    the state's maker proved (see :func:`check_state`): they are not read again."""
    with torch.no_grad():
        checks = []  # (flag: a 0-d bool tensor, True = passed; exact(): whether it passed; problem(): the error)
        for i, layer in enumerate(state.state_layers):
            delta_sum, A = layer.delta_sum, layer.A
            for name, attribute in (("SSM state", "ssm_state"), ("conv window", "conv_state"), ("ΣΔ", "delta_sum")):
                if attribute in values_checked:
                    continue
                tensor = getattr(layer, attribute)
                checks.append(
                    (
                        _finite_flag(tensor),
                        functools.partial(all_finite, tensor),
                        functools.partial(_raise, f"{where}: layer {i} {name} {_CORRUPTED}"),
                    )
                )
            if "delta_sum" not in values_checked:
                checks.append(
                    (
                        (delta_sum >= 0).all(),
                        functools.partial(lambda d: bool((d >= 0).all()), delta_sum),
                        functools.partial(
                            lambda i, d: _refuse(
                                where,
                                (
                                    f"layer {i} ΣΔ has negative entries (min {float(d.min()):.3g}): the context's "
                                    "decay exp(A·ΣΔ) would exceed 1"
                                ),
                            ),
                            i,
                            delta_sum,
                        ),
                    )
                )
            if "A" in values_checked:
                continue
            checks.append(
                (
                    _finite_flag(A) & (A <= 0).all(),
                    functools.partial(lambda a: all_finite(a) and bool((a <= 0).all()), A),
                    functools.partial(
                        lambda i, a: _refuse(
                            where,
                            (
                                f"layer {i} A must be finite and <= 0 (it is -exp(A_log): -0.0 where A_log is -inf, "
                                f"a decay of 1), got max {float(a.max()):.3g}"
                            ),
                        ),
                        i,
                        A,
                    ),
                )
            )
        if not checks or bool(torch.stack([flag.to(checks[0][0].device) for flag, _, _ in checks]).all()):
            return
        for _, exact, problem in checks:
            if not exact():
                problem()


def _raise(message: str):
    raise ValueError(message)


def check_finite(state, where: str = "state"):
    for i in range(state.num_layers):
        for name, tensor in (
            ("SSM state", state.ssm_states[i]),
            ("conv window", state.conv_states[i]),
            ("ΣΔ", state.delta_sums[i]),
        ):
            if not all_finite(tensor):
                raise ValueError(f"{where}: layer {i} {name} {_CORRUPTED}")


def check_compatible(states, *, same_batch: bool = True, where: str = "past_states"):
    """All states come from one model and agree in layers, shapes, dtypes, devices (and batch)."""
    if isinstance(states, (str, bytes)) or not hasattr(states, "__len__"):
        raise TypeError(f"{where} must be a list of ComposableMambaCache, got {type(states).__name__}")
    if len(states) == 0:
        raise ValueError(f"{where} is empty: pass at least one state to compose")
    for k, state in enumerate(states):
        check_is_state(state, f"{where}[{k}]")
    first = states[0]
    for k, state in enumerate(states[1:], start=1):
        if state.architecture != first.architecture:
            raise ValueError(
                f"{where}[{k}] was encoded by a different model (a {state.architecture!r} model: {_describe(state)}) "
                f"than {where}[0] (a {first.architecture!r} model: {_describe(first)}); encode every context with "
                "the same model"
            )
        if state.num_layers != first.num_layers:
            raise ValueError(f"{where}[{k}] has {state.num_layers} layers, {where}[0] has {first.num_layers}")
        if same_batch and state.batch_size != first.batch_size:
            raise ValueError(
                f"{where}[{k}] has batch size {state.batch_size}, {where}[0] has {first.batch_size}; "
                "states composed together must have the same batch (or pass one list per row)"
            )
        if state.model_dtype != first.model_dtype:
            raise ValueError(
                f"{where}[{k}] was encoded in {state.model_dtype}, {where}[0] in {first.model_dtype}; "
                "encode all contexts with the model in one dtype"
            )
        if state.fingerprint != first.fingerprint:
            raise ValueError(
                f"{where}[{k}] was encoded by a different model ({_describe(state)}) than {where}[0] "
                f"({_describe(first)}); encode every context with the same model"
            )
        _check_keys_compatible(state, first, f"{where}[{k}]", f"{where}[0]")
        for i in range(first.num_layers):
            for name, a, b in (
                ("SSM state", state.ssm_states[i], first.ssm_states[i]),
                ("conv window", state.conv_states[i], first.conv_states[i]),
            ):
                if a.shape[1:] != b.shape[1:]:
                    raise ValueError(
                        f"{where}[{k}] layer {i} {name} has shape {tuple(a.shape)}, {where}[0] has {tuple(b.shape)}"
                    )
                if a.dtype != b.dtype:
                    raise ValueError(f"{where}[{k}] layer {i} {name} is {a.dtype}, {where}[0] is {b.dtype}")
                if a.device != b.device:
                    raise ValueError(
                        f"{where}[{k}] is on {a.device}, {where}[0] on {b.device}; move them with .to(device)"
                    )


def _check_keys_compatible(state, first, where: str, first_where: str) -> None:
    """Two hybrid states' attention layers agree in heads, head dim, dtype and device (the lengths may differ)."""
    for i, (a, b) in enumerate(zip(getattr(state, "attention_layers", ()), getattr(first, "attention_layers", ()))):
        if not (a.has_keys and b.has_keys):
            continue
        if a.keys.shape[1] != b.keys.shape[1] or a.keys.shape[3] != b.keys.shape[3]:
            raise ValueError(
                f"{where} attention layer {i} keys have shape {tuple(a.keys.shape)}, {first_where} "
                f"{tuple(b.keys.shape)} (heads and head dim must agree)"
            )
        if a.keys.dtype != b.keys.dtype:
            raise ValueError(f"{where} attention layer {i} keys are {a.keys.dtype}, {first_where} {b.keys.dtype}")
        if a.keys.device != b.keys.device:
            raise ValueError(
                f"{where} is on {a.keys.device}, {first_where} on {b.keys.device}; move them with .to(device)"
            )


def check_attention_layers(state, where: str = "state", *, batch: int | None = None, device=None) -> None:
    """A hybrid state's attention layers (:mod:`.hybrid_cache`): in every one, keys and values in the recorded
    model dtype (or bfloat16 / float16 when stored so), of shape ``[B, kv heads, L, head dim]`` from the config
    with one ``L`` for all layers, finite; ``positions`` int64 ``[B, L]``, the same in every layer, -1 exactly at
    the padding slots, which come first in a row (left padding), the others positions an encode, composition or
    continuation makes (:func:`check_key_positions`: ``0 .. m`` without a gap); on the states' device; and as many
    real keys per row as the state's tokens (:func:`check_keys_against_tokens`: for an encoded state, at exactly the
    positions its encode gave them)."""
    layout = architecture(state.architecture)
    batch = state.batch_size if batch is None else batch
    device = state.device if device is None else device
    heads, key_dim, value_dim = layout.attention_dims(state.config)
    first_positions, length = None, None
    for i, layer in zip(state.attention_layer_indices, state.attention_layers):
        if not getattr(layer, "has_keys", False):
            _refuse(where, f"layer {i} (attention) holds no keys and values")
        keys, values, positions = layer.keys, layer.values, layer.positions
        for name, tensor, head_dim in (("keys", keys, key_dim), ("values", values, value_dim)):
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
                _refuse(
                    where,
                    f"layer {i} (attention) {name} must be a [B, heads, L, head dim] tensor, got "
                    f"{tuple(getattr(tensor, 'shape', ())) or type(tensor).__name__}",
                )
            if tensor.dtype not in (state.model_dtype, torch.bfloat16, torch.float16):
                _refuse(
                    where,
                    f"layer {i} (attention) {name} are {tensor.dtype}, expected {state.model_dtype} (the model dtype)",
                )
            length = tensor.shape[2] if length is None else length
            if tuple(tensor.shape) != (batch, heads, length, head_dim):
                _refuse(
                    where,
                    f"layer {i} (attention) {name} have shape {tuple(tensor.shape)}, expected "
                    f"{(batch, heads, length, head_dim)} (batch {batch}, {heads} key/value heads of {head_dim} "
                    f"from the {state.architecture} config, the same length in every attention layer)",
                )
            if tensor.device != device:
                _refuse(where, f"layer {i} (attention) {name} are on {tensor.device}, the states on {device}")
            if not all_finite(tensor):
                _raise(f"{where}: layer {i} (attention) {name} {_CORRUPTED}")
        if keys.dtype != values.dtype:
            _refuse(where, f"layer {i} (attention) keys are {keys.dtype}, values {values.dtype}")
        if (
            not isinstance(positions, torch.Tensor)
            or positions.dtype != torch.int64
            or tuple(positions.shape) != (batch, length)
        ):
            _refuse(
                where,
                f"layer {i} (attention) positions must be an int64 tensor of shape {(batch, length)}, got "
                f"{getattr(positions, 'dtype', type(positions).__name__)} {tuple(getattr(positions, 'shape', ()))}",
            )
        if positions.device != device:
            _refuse(where, f"layer {i} (attention) positions are on {positions.device}, the states on {device}")
        if first_positions is None:
            first_positions = positions
            check_key_positions(positions, where, layer=i)
        elif not torch.equal(positions, first_positions):
            _refuse(
                where,
                f"layer {i} (attention) positions differ from layer {state.attention_layer_indices[0]}'s: every "
                "attention layer caches the same tokens",
            )
    if first_positions is not None:
        check_keys_against_tokens(state, first_positions, where)


_INT64_MAX = torch.iinfo(torch.int64).max

KEY_POSITIONS_INVARIANT = (
    "per row, -1 (padding) only before the first key and the keys' positions, as a set, exactly 0, 1, ..., m with "
    "m + 1 <= the number of keys (every context is encoded from position 0; concatenation places the next context "
    "right after, attention='shared' and continuation repeat or extend them without a gap)"
)


def check_key_positions(positions: torch.Tensor, where: str = "positions", *, layer: int | None = None, refuse=None):
    """The positions of a hybrid state's keys ``[B, L]`` (int64, shape and device checked by the caller) are ones an
    encode, a composition or a continuation can make (:data:`KEY_POSITIONS_INVARIANT`):

    * encode: per row ``-1`` for each left-padding slot, then ``0, 1, ..., n - 1``;
    * composition (:mod:`hf_statecompose.composition.attention`): ``"concat"`` moves each state by the total span
      (last position + 1) of the states before it, so the row stays ``0 .. m`` without a gap; ``"shared"`` keeps
      each state at its own ``0 .. n_k - 1``: positions repeat, their set is ``0 .. max n_k - 1``; the padding of
      every state is gathered at the row's left;
    * continuation (generate / forward from a state: the attention layers' ``update`` in :mod:`hf_statecompose.compat`
      and the generation's record of the query's positions): the new keys take ``m + 1, m + 2, ...`` (a left-padded
      query leaves -1 slots between keys: refused, such a cache is not a state).

    So per row: values ``>= -1``; no ``-1`` after a key; sorted, the keys' positions start at 0 and step by 0 or 1.
    This bounds the last position by the number of keys (``m + 1 <= L``): no gap, no offset beyond the context, and
    the query's first position ``m + 1`` cannot overflow int64. One host sync when the positions pass (two for
    repeated positions, ``"shared"``: they take the sort).
    ``refuse(problem)`` raises (default: the "altered or not written by hf_statecompose" error naming ``where``)."""
    refuse = functools.partial(_refuse, where) if refuse is None else refuse
    name = "key positions" if layer is None else f"layer {layer} (attention) positions"
    if positions.dim() != 2 or positions.numel() == 0:
        return
    with torch.no_grad():
        # fast path, what encode, concat and continuation make: per row -1 ... -1, 0, 1, 2, ... in slot order (each slot
        # the previous one + 1, or -1 after -1, the slot before the first taken as -1); a chain from 0 by steps of 1
        # cannot reach int64's end, so the wrap-around of ``positions - previous`` never passes a bad value
        previous = torch.nn.functional.pad(positions[:, :-1], (1, 0), value=-1)
        if bool(((positions - previous == 1) | ((positions == -1) & (previous == -1))).all()):
            return
        real = positions >= 0
        ordered = positions.sort(dim=-1).values
        # the step from the previous position (the first from -1): 0 (a repeat, shared placement), 1 (the next), or
        # -1 -> 0 (the first key); anything else is a gap, an offset, a value below -1 or an int64 wrap-around
        steps = torch.diff(ordered, dim=-1, prepend=ordered.new_full((ordered.shape[0], 1), -1))
        flags = torch.stack(
            [(positions < -1).any(), (real[:, :-1] & ~real[:, 1:]).any(), ((steps < 0) | (steps > 1)).any()]
        )
        if not bool(flags.any()):
            return
        below, right, jump = (bool(f) for f in flags)
    if below:
        refuse(f"{name} hold values below -1 (-1 marks padding)")
    if right:
        raise ValueError(
            f"{where}: {name} are not left padded (a padding slot after a real key): a cache "
            "continued from a left-padded query holds that padding between its keys and cannot be a state; "
            "encode the contexts (hsc.encode) and compose those, or continue with unpadded queries"
        )
    if jump:
        bad = (steps < 0) | (steps > 1)
        row = int(bad.any(-1).nonzero()[0, 0])
        column = int(bad[row].nonzero()[0, 0])
        before, value = (int(ordered[row, column - 1]) if column else -1), int(ordered[row, column])
        what = (
            f"row {row}'s first key position is {value}, not 0"
            if before < 0
            else f"row {row}'s key positions jump from {before} to {value} (no key at {before + 1})"
        )
        top = int(ordered[row, -1])
        overflow = " (its last + 1, a query's start, overflows int64)" if top == _INT64_MAX else ""
        refuse(
            f"{name} are not what an encode or composition makes: {what}{overflow}; a query would start at the "
            "wrong position"
        )


KEY_COUNTS_INVARIANT = (
    "per row, as many keys (positions >= 0) as the state's tokens (num_tokens) in every attention layer: an encode, "
    "a composition with attention='concat' or 'shared' (the union of the states' keys, their counts summed) and a "
    "continuation (one key per token it adds) keep every token's key; only attention='none' leaves the keys out "
    "(no key slot at all, and a continuation of it holds the added tokens' keys only: fewer keys than tokens)"
)


def check_keys_against_tokens(state, positions: torch.Tensor, where: str = "state") -> None:
    """A hybrid state's keys agree with its own token count (:data:`KEY_COUNTS_INVARIANT`); ``positions`` ``[B, L]``
    are its attention layers' (checked by :func:`check_attention_layers`, the same in every layer).

    * a state that carries its ``token_ids`` (an encoded state, or a stack / selection of encoded states): per row
      exactly ``num_tokens[row]`` keys, at the positions its encode gave them: ``-1`` for each left-padding slot,
      then ``0, 1, ..., n - 1`` (``n = num_tokens[row]``);
    * a composed or continued state (no ``token_ids``): at most ``num_tokens[row]`` keys per row (the same number
      unless the composition left the keys out, ``attention='none'``), in positions :func:`check_key_positions`
      accepts;
    * a state with no key slot (``L = 0``: ``attention='none'``) or no token count: nothing to compare.

    One host sync when the state passes."""
    num_tokens, token_ids = state.num_tokens, state.token_ids
    batch, length = positions.shape
    encoded = isinstance(token_ids, torch.Tensor) and token_ids.dim() == 2 and token_ids.shape[0] == batch
    if isinstance(num_tokens, torch.Tensor) and tuple(num_tokens.shape) == (batch,):
        counts = num_tokens.to(positions.device)
    elif encoded:
        counts = (token_ids >= 0).sum(-1).to(positions.device)
    else:
        return
    if length == 0:
        return
    with torch.no_grad():
        keys = (positions >= 0).sum(-1)
        if encoded:
            slots = torch.arange(length, device=positions.device)
            expected = (slots - (length - counts)[:, None]).clamp(min=-1)
            wrong_count, wrong_place = keys != counts, (positions != expected).any(-1)
        else:
            wrong_count, wrong_place = keys > counts, torch.zeros_like(keys, dtype=torch.bool)
        flags = torch.stack([wrong_count.any(), wrong_place.any()])
        if not bool(flags.any()):
            return
    if bool(flags[0]):
        row = int(wrong_count.nonzero()[0, 0])
        k, n = int(keys[row]), int(counts[row])
        _refuse(
            where,
            f"row {row}'s attention layers hold {k} keys (positions >= 0) but the state has {n} tokens (num_tokens)"
            + (
                ": an encoded state (it carries token_ids) holds one key per token in every attention layer"
                if encoded
                else ": more keys than tokens (a composition or continuation holds at most one key per token)"
            ),
        )
    row = int(wrong_place.nonzero()[0, 0])
    n = int(counts[row])
    got = positions[row, length - n :].tolist() if n else []
    shown = ", ".join(map(str, got[:6])) + (", ..." if len(got) > 6 else "")
    _refuse(
        where,
        f"row {row}'s key positions are not those of an encoding of its {n} tokens (the state carries token_ids): "
        f"expected -1 for each of its {length - n} padding slots, then 0, 1, ..., {n - 1}, got {shown}",
    )


def expected_state_shapes(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-row shapes of (SSM state, conv window) for one state layer of a model with this config (a layer
    of Mamba / Mamba-2, a (layer, branch) of SeRpEnt-Mamba; see :mod:`.architectures`)."""
    return architecture_of_config(config).state_shapes(config)


def expected_decay_shapes(config) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-row shape of ΣΔ and the shape of ``A`` for one state layer of a model with this config:
    Mamba-1 and SeRpEnt-Mamba ``(D,)`` and ``(D, N)``, Mamba-2 ``(H,)`` and ``(H,)``."""
    return architecture_of_config(config).decay_shapes(config)


def expected_num_layers(config) -> int:
    """The number of state layers of a model with this config (SeRpEnt: layers x branches)."""
    return architecture_of_config(config).num_state_layers(config)


# A stored A must equal the model's -exp(A_log) computed in float32. Encoded and checked on the same
# device they are bit-identical; across devices exp() may differ by a few ulp, so allow 1e-5 relative
# (about 80 ulp): any real difference (another layer's A, a scaled A) is far larger.
A_RTOL = 1e-5

_STATE_FLOAT = torch.float32  # SSM states, ΣΔ and A are always float32; conv windows are in the model dtype


def _refuse(where: str, problem: str):
    raise ValueError(
        f"{where}: {problem}; the state was altered or not written by hf_statecompose for this model: "
        "re-encode the context"
    )


def check_state(
    state,
    model=None,
    *,
    where: str = "state",
    A_rtol: float = A_RTOL,
    values_checked: tuple[str, ...] = (),
    fits: str | None = None,
    rounding: float = 0.0,
) -> None:
    """Check every tensor of ``state`` against its own config and metadata, and with ``model`` against
    the model's ``A``; raise a ``ValueError`` naming the first problem.

    Without ``model`` (what a state file can be checked against by itself):

    * the architecture is one of :data:`.architectures.ARCHITECTURES` (``"mamba"``, ``"mamba2"``,
      ``"serpent_mamba"``, ``"coffee"``) and matches ``state.config.model_type``; one state per state layer of the
      config (SeRpEnt: layers x branches), every layer filled;
    * dtypes: SSM state, ΣΔ and ``A`` float32, conv window ``state.model_dtype``, ``num_tokens`` and
      ``token_ids`` int64; all tensors on one device;
    * shapes from the config (:func:`expected_state_shapes`, :func:`expected_decay_shapes`) with one
      batch size ``B >= 1`` for every layer: SSM ``[B, ...]``, conv ``[B, C, K]``, ΣΔ ``[B, D or H]``,
      ``A`` ``[D, N]`` or ``[H]``, ``num_tokens`` ``[B]``, ``token_ids`` ``[B, T]``;
    * values: SSM state and conv window finite; ΣΔ finite and ``>= 0`` (a decay ``exp(A·ΣΔ)`` above 1
      would amplify the context); ``A`` finite and ``<= 0`` (``-exp(A_log)``: ``-0.0``, a decay of exactly 1,
      where a model's ``A_log`` is ``-inf``); ``num_tokens >= 1`` (a context of no tokens is refused); ``token_ids`` in
      ``[-1, vocab_size)``, left padded with -1, and as many real ids per row as ``num_tokens``;
    * the architecture's extra tensors (SeRpEnt's resampling state): present in every layer, dtypes and
      shapes from the description, values checked by it (:func:`check_extras`).

    With ``model``, also: each layer's ``A`` equals ``-exp(A_log)`` of that layer's mixer, in float32,
    to relative ``A_rtol`` (default :data:`A_RTOL`). The fingerprint, dtype and device of the model are
    checked by :func:`check_against_model`. Stable signature: the store calls it on states it builds.

    A state that passes is remembered as checked (:func:`check_state_once`) until one of its tensors changes.

    For the maker of a state that has itself proved part of this (a store that verified the bytes it built the
    state from): ``values_checked`` names the layer tensors (``"ssm_state"``, ``"conv_state"``, ``"delta_sum"``)
    whose values it proved finite (ΣΔ also >= 0) for these very tensors (read from verified bytes, converted only
    to a dtype that holds every value of the stored one): those scans, the bulk of the work, are not repeated;
    ``fits`` is the fingerprint of the model whose ``-exp(A_log)`` it compared the source of this state's ``A``
    with (:func:`check_against_model` then does not compare again), and ``"A"`` in ``values_checked`` says that
    this ``A`` is a copy of that compared one (with ``model``, it is compared here). Every other check runs, and the verdict is
    remembered for these tensors as any other (an edit voids it). ``rounding``: the unit roundoff of the dtype a store
    kept the delta-rule transitions in (they may exceed their bound by that much, ``_check_transition_values``).
    """
    check_is_state(state, where)
    snapshot = _snapshot(state)
    config = state.config
    architecture = state.architecture
    if architecture not in ARCHITECTURES or getattr(config, "model_type", None) != architecture:
        _refuse(
            where,
            f"architecture {architecture!r} does not match its config's model_type "
            f"{getattr(config, 'model_type', None)!r} (expected one of {', '.join(map(repr, ARCHITECTURES))} for both)",
        )
    layout = ARCHITECTURES[architecture]
    if state.num_layers != layout.num_state_layers(config):
        _refuse(where, f"it holds {state.num_layers} layers, its config {layout.num_state_layers(config)}")
    if state.model_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        _refuse(where, f"model dtype {state.model_dtype} is not a floating point dtype")
    ssm_shape, conv_shape = layout.state_shapes(config)
    delta_shape, A_shape = layout.decay_shapes(config)
    batch = state.ssm_states[0].shape[0] if state.ssm_states[0].dim() else 0
    if batch < 1:
        _refuse(where, f"layer 0 SSM state has shape {tuple(state.ssm_states[0].shape)}: no batch dimension")
    device = state.ssm_states[0].device
    if not _layer_metadata_fits(
        state.state_layers,
        state.model_dtype,
        device,
        (
            (batch, *ssm_shape),
            (batch, *conv_shape),
            (batch, *delta_shape),
            tuple(A_shape),
        ),
    ):
        _refuse_layer_metadata(state, where, batch, device, ssm_shape, conv_shape, delta_shape, A_shape)
    _check_layer_values(state, where, values_checked)
    _check_token_counts(state, batch, device, where)
    check_extras(state, where, batch=batch, device=device, rounding=rounding)
    if layout.is_hybrid:
        check_attention_layers(state, where, batch=batch, device=device)
    _remember(state, snapshot)
    if model is not None:
        _check_A_against_model(state, model, where, A_rtol)
    verdict = _VERDICTS.get(state) if fits is not None and snapshot is not None else None
    if verdict is not None:
        verdict.fingerprints.add(fits)


_LAYER_TENSORS = operator.attrgetter("ssm_state", "conv_state", "delta_sum", "A")


def _layer_metadata_fits(layers, model_dtype, device, shapes) -> bool:
    """Whether every layer's SSM state, conv window, ΣΔ and A are tensors of the expected dtype, shape and
    device: the checks of :func:`_refuse_layer_metadata`, in one pass that names nothing (it runs on every
    state; only a state that fails takes the slow pass, which names the first problem)."""
    ssm_shape, conv_shape, delta_shape, A_shape = shapes
    f32, tensor_type = _STATE_FLOAT, torch.Tensor
    try:
        for layer in layers:
            ssm, conv, delta, A = _LAYER_TENSORS(layer)
            if not (
                isinstance(ssm, tensor_type)
                and isinstance(conv, tensor_type)
                and isinstance(delta, tensor_type)
                and isinstance(A, tensor_type)
                and ssm.dtype == f32
                and conv.dtype == model_dtype
                and delta.dtype == f32
                and A.dtype == f32
                and ssm.shape == ssm_shape
                and conv.shape == conv_shape
                and delta.shape == delta_shape
                and A.shape == A_shape
                and ssm.device == device
                and conv.device == device
                and delta.device == device
                and A.device == device
            ):
                return False
    except AttributeError:
        return False
    return True


def _refuse_layer_metadata(state, where, batch, device, ssm_shape, conv_shape, delta_shape, A_shape) -> None:
    """The slow pass of :func:`_layer_metadata_fits`: raise naming the first tensor that does not fit."""
    architecture = state.architecture
    for i in range(state.num_layers):
        for name, tensor, dtype, shape in (
            ("SSM state", state.ssm_states[i], _STATE_FLOAT, (batch, *ssm_shape)),
            ("conv window", state.conv_states[i], state.model_dtype, (batch, *conv_shape)),
            ("ΣΔ", state.delta_sums[i], _STATE_FLOAT, (batch, *delta_shape)),
            ("A", state.A[i], _STATE_FLOAT, A_shape),
        ):
            if not isinstance(tensor, torch.Tensor):
                _refuse(where, f"layer {i} {name} is {type(tensor).__name__}, not a tensor")
            if tensor.dtype != dtype:
                _refuse(
                    where,
                    f"layer {i} {name} is {tensor.dtype}, expected {dtype}"
                    + (" (the recorded model dtype)" if name == "conv window" else ""),
                )
            if tuple(tensor.shape) != shape:
                origin = "from the" if name == "A" else f"batch {batch} as in layer 0, the rest from the"
                _refuse(
                    where,
                    f"layer {i} {name} has shape {tuple(tensor.shape)}, expected {shape} ({origin} {architecture} config)",
                )
            if tensor.device != device:
                _refuse(where, f"layer {i} {name} is on {tensor.device}, layer 0 on {device}")
    raise AssertionError("the fast pass refused a state the slow pass accepts")  # pragma: no cover


def _decay_of(state, v: int):
    """Layer ``v``'s ``(ΣΔ, A)`` when both are tensors (what bounds a delta-rule transition), else None."""
    layer = state.state_layers[v]
    delta_sum, A = getattr(layer, "delta_sum", None), getattr(layer, "A", None)
    return (delta_sum, A) if isinstance(delta_sum, torch.Tensor) and isinstance(A, torch.Tensor) else None


def check_extras(state, where: str = "state", *, batch: int | None = None, device=None, rounding: float = 0.0) -> None:
    """The extra per-layer tensors of the state's architecture (SeRpEnt: clock, window inputs, times and
    valid mask, last output): present in every layer, their dtypes (from the recorded model dtype) and
    shapes (from the config, with the state's batch) as the architecture describes them, on the states'
    device, and their values as it checks them (the invariants of a real encoding, with the state's
    ``num_tokens`` and whether it still carries its ``token_ids``); and, across layers, the same number of
    valid window neighbours per row in every layer (every layer and branch sees the same real tokens).
    Nothing for Mamba / Mamba-2."""
    layout = architecture(state.architecture)
    if not layout.extras:
        return
    batch = state.batch_size if batch is None else batch
    device = state.device if device is None else device
    refuse = functools.partial(_refuse, where)
    layers = []
    for v in range(state.num_layers):
        extras = {}
        for extra in layout.extras:
            tensors = getattr(state, extra.attribute, None)
            extras[extra.attribute] = (
                tensors[v] if isinstance(tensors, Sequence) and len(tensors) == state.num_layers else None
            )
        check_extra_tensors(
            layout,
            extras,
            v,
            config=state.config,
            model_dtype=state.model_dtype,
            batch=batch,
            device=device,
            refuse=refuse,
            num_tokens=state.num_tokens,
            encoded=state.token_ids is not None,
            decay=_decay_of(state, v),
            rounding=rounding,
        )
        layers.append(extras)
    if layout.check_extras_across_layers is not None:
        with torch.no_grad():
            layout.check_extras_across_layers(layers, refuse)


def _check_token_counts(state, batch: int, device, where: str) -> None:
    num_tokens, token_ids = state.num_tokens, state.token_ids
    if num_tokens is not None:
        if (
            not isinstance(num_tokens, torch.Tensor)
            or num_tokens.dtype != torch.int64
            or tuple(num_tokens.shape) != (batch,)
        ):
            _refuse(
                where,
                f"num_tokens must be an int64 tensor of shape ({batch},), got "
                f"{getattr(num_tokens, 'dtype', type(num_tokens).__name__)} {tuple(getattr(num_tokens, 'shape', ()))}",
            )
        if num_tokens.device != device:
            _refuse(where, f"num_tokens is on {num_tokens.device}, the states on {device}")
        if (num_tokens < 1).any():
            if (num_tokens < 0).any():
                _refuse(where, f"num_tokens has negative counts {num_tokens.tolist()}")
            refuse_empty_contexts(num_tokens, where)
    if token_ids is None:
        return
    if (
        not isinstance(token_ids, torch.Tensor)
        or token_ids.dtype != torch.int64
        or token_ids.dim() != 2
        or token_ids.shape[0] != batch
    ):
        _refuse(
            where,
            f"token_ids must be an int64 tensor of shape ({batch}, T), got "
            f"{getattr(token_ids, 'dtype', type(token_ids).__name__)} {tuple(getattr(token_ids, 'shape', ()))}",
        )
    if token_ids.device != device:
        _refuse(where, f"token_ids is on {token_ids.device}, the states on {device}")
    vocab_size = getattr(state.config, "vocab_size", None)
    if (token_ids < -1).any() or (vocab_size is not None and (token_ids >= vocab_size).any()):
        _refuse(where, f"token_ids hold ids outside [-1, {vocab_size}) (-1 is padding)")
    real = token_ids >= 0
    if token_ids.shape[1] > 1 and (real[:, :-1] & ~real[:, 1:]).any():
        _refuse(where, "token_ids are not left padded (a -1 after a real id)")
    if num_tokens is not None and not torch.equal(real.sum(-1), num_tokens):
        _refuse(where, f"token_ids hold {real.sum(-1).tolist()} ids per row but num_tokens says {num_tokens.tolist()}")


EMPTY_CONTEXT = (
    "it has no state to compose or continue (composed last, its all-zero conv window would replace the previous "
    "state's): drop it, or give every context at least one token"
)


def refuse_empty_contexts(num_tokens: torch.Tensor, where: str = "state", what: str = "num_tokens 0") -> None:
    """Refuse a state (or the contexts of an encode: ``num_tokens`` the real tokens per row) with a row of no
    tokens: a context of no tokens is refused everywhere (encode, state files, store entries and writes,
    ``past_states``, compose inputs), never composed (:data:`EMPTY_CONTEXT`). One host sync."""
    empty = num_tokens == 0
    if bool(empty.any()):
        row = int(empty.reshape(-1).nonzero()[0, 0])
        raise ValueError(f"{where}: row {row} is a context of no tokens ({what}); {EMPTY_CONTEXT}")


def _check_A_against_model(state, model, where: str, A_rtol: float) -> None:
    from .fingerprint import architecture_of, base_model_of

    layout = architecture(architecture_of(model))
    backbone = base_model_of(model)
    num_layers = layout.num_state_layers(model.config)
    if num_layers != state.num_layers:
        raise ValueError(
            f"{where} has {state.num_layers} layers, the model {num_layers}; "
            "the state belongs to another model: re-encode the contexts with this model"
        )
    with torch.no_grad():
        expected = []
        for i in range(num_layers):
            A_log = layout.A_log_of(backbone, i)
            if A_log is None:
                raise TypeError(f"layer {i} of {type(model).__name__} has no mixer.A_log: not a Mamba / Mamba-2 model")
            stored = state.A[i]
            if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != tuple(A_log.shape):
                _refuse(
                    where,
                    f"layer {i} A has shape {tuple(getattr(stored, 'shape', ()))}, the model's {tuple(A_log.shape)}",
                )
            # the same formula as the mixers (models/mamba.py, models/mamba2.py)
            expected.append(-torch.exp(A_log.detach().float()).to(stored.device))
        # one device sync for all layers; `~(d <= tol)` so that NaN counts as off
        device = expected[0].device
        off = torch.stack(
            [
                (~((state.A[i].detach().float() - e).abs() <= A_rtol * e.abs())).any().to(device)
                for i, e in enumerate(expected)
            ]
        )
        if bool(off.any()):
            i = int(off.nonzero()[0, 0])
            stored, e = state.A[i].detach().float(), expected[i]
            worst = float(((stored - e).abs() / e.abs()).max())
            _refuse(
                where,
                f"layer {i} A is not this model's -exp(A_log) (relative difference up to {worst:.3g}, "
                f"allowed {A_rtol:g}): the file was altered, or the weights changed since it was encoded",
            )


# ---------------------------------------------------------------------------------------------- checked once
# What check_state (and, per model fingerprint, the comparison of A with the model) found about a state, remembered
# per state object, so that a state used many times (composed, generated from) is not checked again. The verdict holds
# for the very tensors that were checked, at their version counters, storage addresses, shapes, dtypes and devices
# (an in-place torch op through any view bumps the counter) AND at their contents, so that an edit no counter sees
# (through ``.data``, a NumPy view, ``set_``, another tensor on the same storage, DLPack) is found at the next use:
# * every tensor whose values the checks bound (transitions, ΣΔ, A, token counts and ids, key positions, SeRpEnt's
#   resampling state) in full: a copy when small (compared exactly), else a position-weighted sum of every element
#   (:func:`_content_digest`, one read; it misses only an edit below its float32 rounding, about 1e-6 of the terms);
# * the free-valued ones, whose only check is finiteness (SSM states, conv windows, keys, values: any finite value is
#   a state), by a sample of :data:`DIGEST_SAMPLES` evenly spaced elements (a fill, a scale, a slice or a layer
#   swapped shows; one element may not). A non-finite value written into one is refused at its next use all the
#   same: by the first forward's output check (generation.integration.check_output_finite) or a save's check.
# Weak references: the verdict keeps neither the state nor its tensors alive. Inference-mode tensors have no version
# counter, and nothing can be read while torch.compile traces: a state holding one, or checked there, is checked at
# every use.
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# a tensor of at most this many elements is kept as a copy and compared exactly (token ids, positions, ΣΔ, A, counts)
DIGEST_EXACT_NUMEL = 4096
_DIGEST_BLOCK = 4096  # a large tensor is read as rows of this many elements: weights per column, then per row
_DIGEST_WEIGHTS: dict = {}


def _digest_weights(n: int, device) -> torch.Tensor:
    """``n`` fixed float32 weights in [1, 2) on ``device`` (drawn once from a fixed seed and cached)."""
    key = (n, str(device))
    weights = _DIGEST_WEIGHTS.get(key)
    if weights is None:
        generator = torch.Generator().manual_seed(0x5EED + n)
        weights = torch.rand(n, generator=generator).add_(1.0).to(device)
        if len(_DIGEST_WEIGHTS) > 64:
            _DIGEST_WEIGHTS.clear()
        _DIGEST_WEIGHTS[key] = weights
    return weights


def _content_digest(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d float tensor that changes when any element of ``tensor`` changes (up to rounding, see above): each
    element weighted by its column in a row of :data:`_DIGEST_BLOCK` and each row by its index, so that moved
    values change it too. One read of the tensor (a matrix-vector product); NaN / inf make it non-finite."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.to(torch.float64 if not flat.is_floating_point() else torch.float32)
    n, block = flat.numel(), _DIGEST_BLOCK
    rows = n // block
    weights = _digest_weights(block, flat.device).to(flat.dtype)
    total = flat[rows * block :] @ weights[: n - rows * block]
    if rows:
        row_weights = _digest_weights(rows, flat.device).to(flat.dtype)
        total = total + (flat[: rows * block].view(rows, block) @ weights) @ row_weights
    return total


DIGEST_SAMPLES = 1024  # the elements of a free-valued tensor a verdict compares (evenly spaced, a fixed stride)


def _digests(tensors, free) -> tuple:
    """(the small bounded tensors, flattened and concatenated per dtype and device; the digests of the others: one
    weighted sum over the samples of all free-valued tensors of a device, one :func:`_content_digest` per large bounded
    tensor). Few torch calls per state: a remembered check runs at every use."""
    small: dict = {}
    samples: dict = {}
    large = []
    with torch.no_grad():
        for t, f in zip(tensors, free, strict=True):
            flat = t.reshape(-1)
            if f:
                samples.setdefault((flat.dtype, flat.device), []).append(flat[:: max(1, len(flat) // DIGEST_SAMPLES)])
            elif len(flat) <= DIGEST_EXACT_NUMEL:
                small.setdefault((flat.dtype, flat.device), []).append(flat)
            else:
                large.append(_content_digest(flat))
        for (_, device), parts in samples.items():
            sample = torch.cat(parts).double()
            large.append(sample @ _digest_weights(len(sample), device).double())
        return [torch.cat(parts) for parts in small.values()], large


def _contents(tensors, free) -> tuple:
    """(copies of the small bounded tensors, the other tensors' digests stacked in float64): what :class:`_Verdict`
    compares. Free-valued tensors (:data:`_FREE_VALUED`) are sampled, other tensors of more than
    :data:`DIGEST_EXACT_NUMEL` elements read in full (:func:`_content_digest`)."""
    small, large = _digests(tensors, free)
    digests = torch.stack([d.to(torch.float64).cpu() for d in large]) if large else None
    return tuple(t.clone() for t in small), digests


def _same_contents(tensors, free, small, digests) -> bool:
    now_small, large = _digests(tensors, free)
    if len(now_small) != len(small) or not all(map(torch.equal, now_small, small)):
        return False
    if digests is None:
        return not large
    now = torch.stack([d.to(torch.float64).cpu() for d in large])
    return bool(torch.equal(now, digests))  # (NaN never equals: a non-finite edit of a read element always fails)


def _tracing() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


class _Verdict:
    __slots__ = ("contents", "fingerprints", "header", "refs", "versions")

    def __init__(self, header, tensors, versions):
        self.header, self.versions, self.fingerprints = header, versions, set()
        self.refs = tuple(map(weakref.ref, tensors))
        self.contents = _contents(tensors, header[-1])

    def holds_for(self, header, tensors, versions) -> bool:
        # (not ``map(operator.call, refs)``: torch.compile's tracer calls the referent instead of the reference there)
        return (
            header == self.header
            and versions == self.versions
            and len(tensors) == len(self.refs)
            and all(ref() is t for ref, t in zip(self.refs, tensors, strict=True))
            and _same_contents(tensors, header[-1], *self.contents)
        )


# per layer class, the attributes a snapshot reads: the layer's tensors (what check_state reads), and which of them are
# free-valued (:data:`_FREE_VALUED`)
_TENSOR_NAMES: dict[type, tuple[str, ...]] = {}
_LAYER_GETTERS: dict[type, Callable] = {}
_LAYER_FREE: dict[type, tuple[bool, ...]] = {}
# the tensors whose values the checks only ask to be finite: any finite value is a state (SSM states, conv windows,
# attention keys and values). Their contents are compared by a sample (every (numel // DIGEST_SAMPLES)-th element, :func:`_digests`); every other tensor
# (transitions, ΣΔ, A, token counts and ids, positions, SeRpEnt's resampling state: values the checks bound) in full
_FREE_VALUED = frozenset({"ssm_state", "conv_state", "keys", "values"})


def _no_tensors(layer) -> tuple:
    return (None,)  # what the getters give, less their last item (the class)


_META = operator.attrgetter("_version", "shape", "dtype", "device")
_IS_NONE = functools.partial(operator.is_, None)


def _tensor_names(layer) -> tuple[str, ...]:
    names = _TENSOR_NAMES.get(type(layer))
    if names is None:
        names = ("ssm_state", "conv_state", "keys", "values")
        names += tuple(getattr(layer, "_row_tensors", ())) + tuple(getattr(layer, "_fixed_tensors", ()))
        names = _TENSOR_NAMES[type(layer)] = tuple(dict.fromkeys(names))
    return names


def _snapshot(state):
    """(header, tensors, versions) of everything check_state reads, or None when it cannot be remembered
    (a value that is not a tensor, which check_state refuses anyway, or an inference-mode tensor). ``tensors``
    are the set ones; ``versions`` their version counters, shapes, dtypes, devices and storage addresses, and
    which slots are unset."""
    slots, free = [], []
    for layer in state.layers:
        getter = _LAYER_GETTERS.get(type(layer))
        if getter is None:  # the attributes of the class's layers (set in their __init__), read in one C call
            names = tuple(name for name in _tensor_names(layer) if hasattr(layer, name))
            getter = _LAYER_GETTERS[type(layer)] = operator.attrgetter(*names, "__class__") if names else _no_tensors
            _LAYER_FREE[type(layer)] = tuple(name in _FREE_VALUED for name in names) if names else (False,)
        try:
            slots += getter(layer)[:-1]
            free += _LAYER_FREE[type(layer)]
        except AttributeError:  # a layer that lacks one: every name, one by one
            names = _tensor_names(layer)
            slots += [getattr(layer, name, None) for name in names]
            free += [name in _FREE_VALUED for name in names]
    slots += (state.num_tokens, state.token_ids)
    free += (False, False)
    if _tracing():  # nothing can be read while torch.compile traces: no verdict (checked at every use)
        return None
    unset = tuple(map(_IS_NONE, slots))
    kept = tuple(map(operator.not_, unset))
    tensors = list(itertools.compress(slots, kept))
    try:
        versions = (tuple(map(_META, tensors)), tuple(map(torch.Tensor.data_ptr, tensors)), unset)
    except (AttributeError, RuntimeError, TypeError):
        return None
    header = (
        state.architecture,
        state.model_dtype,
        state.fingerprint,
        id(state.config),
        len(state.layers),
        tuple(itertools.compress(free, kept)),  # which tensors are free-valued (their contents are sampled)
    )
    return header, tensors, versions


def _verdict(state, snapshot):
    if snapshot is None:
        return None
    verdict = _VERDICTS.get(state)
    return verdict if verdict is not None and verdict.holds_for(*snapshot) else None


def _remember(state, snapshot) -> None:
    """Record that ``state`` passed :func:`check_state` as ``snapshot`` shows it (what check_state_once trusts)."""
    if snapshot is None:
        _VERDICTS.pop(state, None)
    elif _verdict(state, snapshot) is None:
        _VERDICTS[state] = _Verdict(*snapshot)


def check_state_once(state, where: str = "state"):
    """:func:`check_state` (every check a state file gets), unless this very state object passed it and
    none of its tensors changed since (in place or reassigned): what composition and generation call on every
    state they get, so that a state reused across calls costs one check. Returns the remembered verdict (None
    when the state cannot be remembered)."""
    snapshot = _snapshot(state) if hasattr(state, "layers") else None
    verdict = _verdict(state, snapshot)
    if verdict is not None:
        return verdict
    check_state(state, where=where)  # remembers its verdict
    return _VERDICTS.get(state) if snapshot is not None else None


def _fits_verdict(state, fingerprint: str, parameter) -> bool:
    """Whether ``state`` holds a verdict, for its current tensors, that it fits the model of ``fingerprint`` (which
    names the architecture, config and weights: what the shapes and ``A`` were compared with) and is where that
    model's weights are (dtype and device, which the fingerprint does not pin to a device)."""
    if not hasattr(state, "layers"):
        return False
    verdict = _verdict(state, _snapshot(state))
    return (
        verdict is not None
        and fingerprint in verdict.fingerprints
        and state.model_dtype == parameter.dtype
        and state.device == parameter.device
    )


def check_against_model(state, model, fingerprint: str, where: str = "past_states", *, contents: bool = True):
    """The state was encoded by this very model, in its dtype, on its device, with its shapes, its contents
    pass every check a state file gets (:func:`check_state_once`, with ``contents``), and its ``A`` is the
    model's ``-exp(A_log)`` (to :data:`A_RTOL`). ``fingerprint`` is ``model_fingerprint(model)`` (passed in so
    that checking many states hashes the model once); the comparison of ``A`` is remembered per fingerprint
    (which covers the weights) as the contents' check is. ``contents=False`` is for a state the composer
    built from checked states (its extras are still checked, :func:`check_extras`)."""
    from .fingerprint import TRACED_FINGERPRINT, architecture_of

    parameter = next(model.parameters())
    if contents and state.fingerprint == fingerprint and _fits_verdict(state, fingerprint, parameter):
        return
    model_architecture = architecture_of(model)
    if state.architecture != model_architecture:
        raise ValueError(
            f"{where} is a state of a {state.architecture!r} model ({_describe(state)}), this model is "
            f"{model_architecture!r}: the state belongs to another model; states only fit the exact model "
            "that encoded them: re-encode the contexts with this model"
        )
    if state.model_dtype != parameter.dtype:
        raise ValueError(
            f"{where} was encoded with the model in {state.model_dtype}, the model is now {parameter.dtype}; "
            f"re-encode the contexts with the model in {parameter.dtype} (states are never converted between "
            "dtypes: the model's fingerprint covers its weights' dtype, and rounded states give other tokens)"
        )
    if state.device != parameter.device:
        raise ValueError(f"{where} is on {state.device}, the model on {parameter.device}; use state.to(device)")
    num_layers = expected_num_layers(model.config)
    if state.num_layers != num_layers:
        raise ValueError(
            f"{where} has {state.num_layers} layers, the model {num_layers}; "
            "the state belongs to another model: re-encode the contexts with this model"
        )
    ssm_shape, conv_shape = expected_state_shapes(model.config)
    for i in range(state.num_layers):
        for name, tensor, shape in (
            ("SSM state", state.ssm_states[i], ssm_shape),
            ("conv window", state.conv_states[i], conv_shape),
        ):
            if tuple(tensor.shape[1:]) != shape:
                raise ValueError(
                    f"{where} layer {i} {name} has per-row shape {tuple(tensor.shape[1:])}, this model expects {shape}; "
                    "the state belongs to another model: re-encode the contexts with this model"
                )
    if state.fingerprint == TRACED_FINGERPRINT:
        raise ValueError(
            f"{where} was made inside torch.compile / torch.export, where the weights cannot be read, so it names "
            "no model; encode the contexts eagerly (hsc.encode(model, ids)) to use them as past_states"
        )
    if state.fingerprint != fingerprint:
        raise ValueError(
            f"{where} was encoded by {_describe(state)}, but this model has fingerprint {fingerprint[:12]} "
            f"({model.config.model_type}, {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}); "
            "states only fit the exact model (architecture, config and weights) that encoded them: "
            "re-encode the contexts with this model"
        )
    if not contents:
        check_extras(state, where)
        _check_A_against_model(state, model, where, A_RTOL)
        return
    verdict = check_state_once(state, where)
    # the fingerprint names the model, A is read from the state: a state whose A was altered (a
    # crafted file that copied the fingerprint) would decay contexts wrongly without this
    if verdict is not None and fingerprint in verdict.fingerprints:
        return
    _check_A_against_model(state, model, where, A_RTOL)
    if verdict is not None:
        verdict.fingerprints.add(fingerprint)


def check_left_padded_mask(attention_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask of the shape of ``input_ids``, left padded, with a token in every row; as int64."""
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
        )
    # checked before the cast to int64, which would turn 0.5 into 0 (a token silently taken as padding)
    if ((attention_mask != 0) & (attention_mask != 1)).any():
        raise ValueError("attention_mask must contain only 0 (padding) and 1 (token)")
    mask = attention_mask.to(torch.long)
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError(
            "hf_statecompose needs left padding (Mamba caches continue from the last token): "
            "set tokenizer.padding_side = 'left'"
        )
    if (mask.sum(-1) == 0).any():
        raise ValueError("a row of attention_mask is all padding: every context needs at least one token")
    return mask


def _special_ids(value) -> set:
    """A config's token id entry (None, an int or a list of ints) as a set."""
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


def pad_runs(input_ids: torch.Tensor, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, how many ``pad_token_id`` tokens it starts with and how many it ends with (``[B]`` each)."""
    is_pad = (input_ids == int(pad_token_id)).to(torch.long)
    return is_pad.cumprod(1).sum(1), is_pad.flip(1).cumprod(1).sum(1)


def check_unmasked_context_padding(input_ids: torch.Tensor, config) -> None:
    """Contexts given without ``attention_mask`` must not look padded: padding read as context changes the
    state silently. With a pad token of its own (not also eos / bos), any pad token is taken for padding, as
    transformers' ``generate`` takes it; a pad token shared with eos / bos is padding when the rows start (or
    end) with different numbers of it. Nothing to check when the config has no pad token."""
    pad = getattr(config, "pad_token_id", None)
    if pad is None or input_ids.numel() == 0:
        return
    leading, trailing = pad_runs(input_ids, pad)
    shared = int(pad) in _special_ids(getattr(config, "eos_token_id", None)) | _special_ids(
        getattr(config, "bos_token_id", None)
    )
    fix = (
        "pass the tokenizer's attention_mask (hsc.encode(model, **tok(texts, padding=True, return_tensors='pt')) "
        "or attention_mask=...)"
    )
    if not shared:
        rows = (input_ids == int(pad)).any(1)
        if bool(rows.any()):
            row = int(rows.nonzero()[0, 0])
            raise ValueError(
                f"input_ids row {row} contains the pad token id {int(pad)} and no attention_mask was given: padding "
                f"would be encoded as context; {fix}; if {int(pad)} is a real token of these contexts, pass "
                "attention_mask=torch.ones_like(input_ids)"
            )
        return
    if int(leading.min()) != int(leading.max()):
        raise ValueError(
            f"input_ids look left padded (rows start with {int(leading.min())} to {int(leading.max())} of the pad "
            f"token id {int(pad)}) and no attention_mask was given: padding would be encoded as context; {fix}"
        )
    if int(trailing.min()) != int(trailing.max()):
        raise ValueError(
            f"input_ids look right padded (rows end with {int(trailing.min())} to {int(trailing.max())} of the pad "
            f"token id {int(pad)}) and no attention_mask was given: padding would be encoded as context; "
            f"hf_statecompose needs left padding (tokenizer.padding_side = 'left') and the mask: {fix}"
        )
