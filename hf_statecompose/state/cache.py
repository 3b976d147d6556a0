"""``ComposableMambaCache``: a transformers Mamba/Mamba-2 cache that also knows its context's decay.

It *is* a ``DynamicCache`` (what transformers passes as ``cache``, ``cache_params`` before 5.24), so it can be
handed to any Mamba / Mamba-2 / FalconMamba forward or ``generate``. Its layers are
:class:`~.layers.ComposableSSMLayer` objects (transformers' ``LinearAttentionLayer`` through the adapter), each
owning every tensor of its state, so that transformers' batch operations on layers keep them together. Per
layer it holds:

* the SSM state ``ssm_states[l]``: Mamba-1 ``[B, D, N]``, Mamba-2 ``[B, H, P, N]`` (float32);
* the conv window ``conv_states[l]``: ``[B, C, K]`` (the model's dtype);
* the context's accumulated decay, stored compactly as ``ΣΔ`` (Mamba-1 ``[B, D]``, Mamba-2 ``[B, H]``)
  plus the layer's ``A`` (Mamba-1 ``[D, N]``, Mamba-2 ``[H]``); ``log_decay(l) = A ⊙ ΣΔ`` broadcasts to
  the SSM state;

plus the number of tokens per row, the context token ids (for the concatenation baselines), the model's
dtype and its fingerprint. States travel as safetensors + JSON metadata (:mod:`.serialization`).

COFFEE models (architecture ``"coffee"``, :mod:`hf_statecompose.models.coffee`) use this class as it is,
their ``[B, E, n]`` layer state flattened into a Mamba-1 layout with one channel per state element:
``ssm_states[l]`` ``[B, E·n, 1]``, an empty conv window ``[B, E·n, 0]`` (no conv), ``ΣΔ`` ``[B, E·n]`` =
``-Σ_k log(1 + λΔ(k))`` and ``A`` = -1 ``[E·n, 1]``, so ``log_decay(l)`` is each element's log of the product
of its step multipliers over the context (:data:`.architectures.COFFEE`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import compat
from .architectures import architecture
from .fingerprint import architecture_of, base_model_of, new_state_fingerprint
from .layers import ComposableSSMLayer, layer_attribute


class ComposableMambaCache(compat.DynamicCache):
    """A Mamba / Mamba-2 cache that carries what composition needs. Build it with :meth:`encode`.

    Its layers (``cache.layers``) are :class:`~hf_statecompose.state.layers.ComposableSSMLayer` objects, each
    owning its SSM state, conv window, ΣΔ and ``A``; the per-layer views below read them."""

    # the function that runs a model over context tokens (hf_statecompose.models.encode): installed by the
    # layer that runs models, so that this data layer never imports it
    _encoder: Callable[..., Any] | None = None
    # the class of this cache's layers (one per state layer of the architecture)
    _layer_class = ComposableSSMLayer

    # generate() auto-compiles the decode step for "compileable" non-DynamicCache caches on GPU; our
    # layers are swapped, not updated in place, so never claim that
    @property
    def is_compileable(self) -> bool:
        return False

    def __init__(
        self,
        config,
        *,
        architecture: str,
        fingerprint: str,
        model_dtype: torch.dtype,
        model_info=None,
        num_layers: int | None = None,
    ):
        from .architectures import architecture as layout_of

        if num_layers is None:
            num_layers = layout_of(architecture).num_state_layers(config)
        compat.Cache.__init__(self, layers=[self._layer_class() for _ in range(num_layers)])
        self.config = config
        self.architecture = architecture
        self.fingerprint = fingerprint
        self.model_dtype = model_dtype
        self.model_info = dict(model_info or {})
        self.num_tokens: torch.Tensor | None = None  # [B] int64
        self.token_ids: torch.Tensor | None = None  # [B, T] int64, left-padded with -1

    # the tokens each row has seen ([B] int64, or None): a property, so that the layers' own token counters
    # (transformers >= 5.25 asks a linear layer how many tokens it has seen) follow every change of it
    @property
    def num_tokens(self) -> torch.Tensor | None:
        return self.__dict__.get("_num_tokens")

    @num_tokens.setter
    def num_tokens(self, value: torch.Tensor | None) -> None:
        self.__dict__["_num_tokens"] = value
        count = value.max() if value is not None and value.numel() else torch.zeros((), dtype=torch.long)
        for layer in self.layers:
            if isinstance(layer, compat.SSMLayerBase):
                layer.set_seen_tokens(count)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The tokens this cache has seen, where transformers asks (a model that is given no ``position_ids`` starts
        the next tokens' positions there): an attention layer's keys (for a layer without keys, the first attention
        layer's, as transformers 5.24 answers for a hybrid); a cache without attention layers, the most tokens of
        any row. transformers 5.25 asks layer 0, which a hybrid's recurrent layer never answered for before."""
        layers = self.layers
        if layer_idx >= len(layers) or self.__dict__.get("_query_follows"):
            return 0
        attention = compat.AttentionLayerBase
        layer = layers[layer_idx]
        if not isinstance(layer, attention):
            layer = next((other for other in layers if isinstance(other, attention)), None)
        if layer is not None:
            return int(layer.get_seq_length())
        return int(self.num_tokens.max()) if self.num_tokens is not None and self.num_tokens.numel() else 0

    def query_follows(self) -> None:
        """The next forward's tokens (a prompt given to ``generate``) follow this state's tokens and are not among
        them: until that forward, :meth:`get_seq_length` answers 0. transformers 5.25 takes a cache that has seen
        tokens to mean that the prompt starts with them (``input_ids``, or ``inputs_embeds``: the whole sequence) and
        cuts them off it; a state here is the context *before* the query. The first forward on the cache (its first
        state layer counts the tokens, :meth:`add_tokens`) ends it."""
        self.__dict__["_query_follows"] = True

    def check_next_output(self) -> None:
        """Have the next forward on this cache (from the enabled model) refuse an output that is not finite: what a
        state whose finite values overflow the forward gives (a state filled with 3e38: NaN logits). Set on every
        state composed for ``past_states`` and handed to ``generate`` as its cache; that forward clears it."""
        self.__dict__["_check_next_output"] = True

    def take_output_check(self) -> bool:
        """Whether the forward now running must check its output (:meth:`check_next_output`); clears the request."""
        return bool(self.__dict__.pop("_check_next_output", False))

    # transformers' assisted decoding and its rollback (`crop`): the state path keeps no history of states to roll
    # back to (generate() refuses assisted decoding first: compat.refuse_assisted_generation)
    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, max_length: int) -> None:
        raise ValueError(
            f"a {type(self).__name__} cannot be cropped: its recurrent states (SSM states, conv windows, ΣΔ) cannot be "
            "rolled back to an earlier token (assisted generation is not supported from composed states)"
        )

    ssm_states = layer_attribute(
        "ssm_state", "Per layer: the SSM state (Mamba-1 ``[B, D, N]``, Mamba-2 ``[B, H, P, N]``)."
    )
    conv_states = layer_attribute("conv_state", "Per layer: the conv window ``[B, C, K]`` (the model's dtype).")
    delta_sums = layer_attribute("delta_sum", "Per layer: the context's ΣΔ (Mamba-1 ``[B, D]``, Mamba-2 ``[B, H]``).")
    A = layer_attribute("A", "Per layer: the layer's ``A`` (Mamba-1 ``[D, N]``, Mamba-2 ``[H]``), float32.")

    # ------------------------------------------------------------------ construction
    @classmethod
    def empty_for(cls, model) -> ComposableMambaCache:
        """A cache with no state yet, for ``model``: the model's forward fills it. Called on this class, it
        gives the cache class of the model's architecture (a :class:`ComposableSeRpEntCache` for a SeRpEnt
        model, with the same public contract)."""
        name = architecture_of(model)
        layout = architecture(name)
        if not layout.is_cache_class(cls):
            target = layout.cache_class()
            if not issubclass(target, cls):
                raise TypeError(f"{cls.__name__} cannot hold the states of a {name!r} model; use {target.__name__}")
            return target.empty_for(model)
        parameter = next(base_model_of(model).parameters())
        info = cls._model_info(model)
        return cls(
            model.config,
            architecture=name,
            fingerprint=new_state_fingerprint(model),
            model_dtype=parameter.dtype,
            model_info=info,
        )

    @classmethod
    def _model_info(cls, model) -> dict:
        config = model.config
        return {
            "model_type": config.model_type,
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "state_size": config.state_size,
        }

    @classmethod
    def encode(
        cls,
        model,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        backend: str | None = None,
        enable_grad: bool = False,
    ):
        """Encode contexts into a state: one prefill of the backbone, no logits.

        ``input_ids`` is ``[B, T]`` (or ``[T]``); a batch of contexts of different lengths must be left
        padded, with ``attention_mask`` marking real tokens. Padding neither decays nor feeds the state,
        so every row equals encoding that context alone. A tokenizer's output (``BatchEncoding`` or a dict)
        may be passed as ``input_ids``: its ``input_ids`` and ``attention_mask`` are taken. Without a mask,
        ids that look padded (the config's pad token) are refused rather than encoded as context. ``backend`` (``"auto"``, ``"torch"``,
        ``"triton"``) overrides the model's kernels for this call only. ``enable_grad=True`` keeps the
        autograd graph from the model's weights to the state (backpropagation through the context
        encodings, ``hf_statecompose.training``); by default encoding runs under ``torch.no_grad()``.
        """
        if cls._encoder is None:
            raise RuntimeError("import hf_statecompose (its models layer installs the encoder) before encoding")
        return cls._encoder(model, input_ids, attention_mask=attention_mask, backend=backend, enable_grad=enable_grad)

    # ------------------------------------------------------------------ public contract
    @property
    def state_layers(self) -> list:
        """The SSM state layers (state layer ``v`` is ``state_layers[v]``): every layer of a Mamba / Mamba-2 /
        SeRpEnt / COFFEE cache; a hybrid's cache (:class:`~.hybrid_cache.ComposableHybridCache`) holds one layer
        per model layer and lists its SSM layers here."""
        return self.layers

    def layer_tensors(self) -> tuple[list, list, list]:
        """(SSM states, conv windows, ΣΔ), one list entry per layer, in one pass (no per-layer views)."""
        layers = self.state_layers
        return [l.ssm_state for l in layers], [l.conv_state for l in layers], [l.delta_sum for l in layers]

    @property
    def num_layers(self) -> int:
        """The number of SSM state layers."""
        return len(self.state_layers)

    @property
    def batch_size(self) -> int:
        layers = self.state_layers
        state = layers[0].ssm_state if layers else None
        return -1 if state is None else state.shape[0]

    @property
    def device(self) -> torch.device:
        return self.state_layers[0].ssm_state.device

    def is_filled(self) -> bool:
        return all(layer.filled for layer in self.state_layers)

    def log_decay(self, layer_idx: int) -> torch.Tensor:
        """log of the context's accumulated decay for a layer, broadcastable to ``ssm_states[layer_idx]``.

        Mamba-1: ``ΣΔ[b, d] · A[d, n]`` as ``[B, D, N]``; Mamba-2: ``ΣΔ[b, h] · A[h]`` as ``[B, H, 1, 1]``;
        Kimi delta attention: ``ΣΔ[b, h, k] · A[h]`` as ``[B, H, K, 1]``.
        """
        layer = self.state_layers[layer_idx]
        delta_sum, A = layer.delta_sum, layer.A
        if delta_sum is None:
            raise ValueError(f"layer {layer_idx} of this cache holds no state yet; encode a context first")
        if architecture(self.architecture).per_element_decay:
            return delta_sum[:, :, None] * A[None]
        if delta_sum.dim() == 3:  # Kimi delta attention: ΣΔ[b, h, k] · A[h], one per key channel (a row of S)
            return (delta_sum * A[None, :, None])[..., None]
        return (delta_sum * A[None])[:, :, None, None]

    # ------------------------------------------------------------------ writes (used by the mixers)
    def set_layer(self, layer_idx: int, *, ssm_state, conv_state, delta_sum, A):
        """Replace state layer ``layer_idx``'s state (tensors are swapped, not copied in place, so autograd sees them)."""
        _fill_ssm(self.state_layers[layer_idx], ssm_state, conv_state, delta_sum, A)

    def advance_layer(self, layer_idx: int, *, ssm_state, conv_state, delta_sum, A):
        """After a forward over more tokens: the new state, and ΣΔ of those tokens added to the total.
        ``layer_idx`` is the *model's* layer index (what a mixer knows): ``cache.layers[layer_idx]``."""
        delta_sum = delta_sum.float()
        layer = self.layers[layer_idx]
        if layer.filled:
            delta_sum = layer.delta_sum + delta_sum
        _fill_ssm(layer, ssm_state.float(), conv_state, delta_sum, A if torch.is_grad_enabled() else A.detach())

    def add_tokens(self, count: torch.Tensor):
        """Account for ``count[b]`` more tokens per row; the stored token ids no longer describe the state."""
        count = count.to(torch.long)
        self.__dict__.pop("_query_follows", None)
        self.num_tokens = count if self.num_tokens is None else self.num_tokens + count
        self.token_ids = None

    # ------------------------------------------------------------------ batch operations
    # Which new states own their tensors: clone() (and copy.deepcopy), select() / [] and repeat_interleave()
    # (as torch's index_select and repeat_interleave), stack() (as torch.cat) and compositions of n >= 2
    # states give states that share no tensor with their inputs, ``A`` and every extra included, so an
    # in-place edit of one never reaches the other. detach() and to() (to the same device and dtype) share
    # memory, as torch's detach / to do; a composition of one state is that state (it shares its tensors).
    def _map_rows(self, fn, fixed=None) -> ComposableMambaCache:
        """A new cache whose every per-row tensor (of every layer, and the token counts / ids) is ``fn`` of this
        one's and whose ``A`` (no batch dimension) is ``fixed`` of this one's, a copy by default."""
        fixed = (lambda t: t.clone()) if fixed is None else fixed
        out = self.empty_like()
        for source, target in zip(self.layers, out.layers):
            if getattr(source, "has_keys", False):
                target.fill_keys(fn(source.keys), fn(source.values), fn(source.positions))
            if not getattr(source, "filled", False):
                continue
            target.fill(fn(source.ssm_state), fn(source.conv_state))
            for name in source._row_tensors:
                value = getattr(source, name)
                if name != "positions":
                    setattr(target, name, fn(value) if value is not None else None)
            target.A = fixed(source.A) if source.A is not None else None
        out.num_tokens = fn(self.num_tokens) if self.num_tokens is not None else None
        out.token_ids = fn(self.token_ids) if self.token_ids is not None else None
        return out

    def empty_like(self) -> ComposableMambaCache:
        """A new cache of the same model and class (architecture, config, fingerprint, model dtype) with empty
        layers: what a builder of states (the composer, the training helpers) fills with :meth:`set_layer`,
        or gets filled in one call from :meth:`filled_like`."""
        return type(self)(
            self.config,
            architecture=self.architecture,
            fingerprint=self.fingerprint,
            model_dtype=self.model_dtype,
            model_info=self.model_info,
            num_layers=len(self.layers) if self.state_layers is self.layers else None,
        )

    # kept for callers of the former private name (tests, scripts); new code calls empty_like
    _empty_like = empty_like

    def filled_like(self, ssm_states, conv_states, delta_sums, A=None) -> ComposableMambaCache:
        """A new cache of this one's model (:meth:`empty_like`) whose state layer ``i`` holds ``ssm_states[i]``,
        ``conv_states[i]`` and ``delta_sums[i]`` (one entry per state layer, the tensors taken as they are, not
        copied) and ``A[i]``; ``A`` defaults to a copy of this cache's (the model's, the same for every state of
        it). Token counts, ids and an architecture's extras are not set: see :meth:`finish_composition`."""
        count = self.num_layers
        ssm_states, conv_states, delta_sums = list(ssm_states), list(conv_states), list(delta_sums)
        A = [a.clone() for a in self.A] if A is None else list(A)
        if not len(ssm_states) == len(conv_states) == len(delta_sums) == len(A) == count:
            raise ValueError(
                f"filled_like takes one SSM state, conv window, ΣΔ and A per state layer ({count}), got "
                f"{len(ssm_states)}, {len(conv_states)}, {len(delta_sums)} and {len(A)}"
            )
        out = self.empty_like()
        for layer, ssm_state, conv_state, delta_sum, a in zip(out.state_layers, ssm_states, conv_states, delta_sums, A):
            _fill_ssm(layer, ssm_state, conv_state, delta_sum, a)
        return out

    def shallow_copy(self) -> ComposableMambaCache:
        """A new cache object holding this one's very tensors (``A`` and every extra included, nothing copied):
        what a composition of one state gives, a new object that shares its tensors as ``Tensor.view`` does."""
        return self._map_rows(lambda t: t, fixed=lambda t: t)

    def clone(self) -> ComposableMambaCache:
        """A copy owning every tensor (``A`` and the architecture's extras included)."""
        return self._map_rows(lambda t: t.clone())

    def detach(self) -> ComposableMambaCache:
        """The same tensors without autograd history (they share memory with this cache's, as ``Tensor.detach``)."""
        return self._map_rows(lambda t: t.detach(), fixed=lambda t: t.detach())

    def to(self, device=None, dtype=None) -> ComposableMambaCache:
        """Move to ``device``; ``dtype`` converts the conv windows and records it as the model dtype
        (SSM states, ΣΔ and A stay float32). Tensors already there are shared, as ``Tensor.to`` shares them."""
        move = (lambda t: t.to(device)) if device is not None else (lambda t: t)
        out = self._map_rows(move, fixed=move)
        if dtype is not None:
            for layer in out.layers:
                if getattr(layer, "filled", False):
                    layer.fill(layer.ssm_state, layer.conv_state.to(dtype))
                if getattr(layer, "has_keys", False):
                    layer.fill_keys(layer.keys.to(dtype), layer.values.to(dtype), layer.positions)
            out.model_dtype = dtype
        return out

    _ROWS_ACCEPTED = "rows must be an int, a list of ints, a slice or a LongTensor (an integer tensor)"

    def _row_index(self, rows) -> torch.Tensor:
        """``rows`` as a 1-D int64 index; anything but integers is refused (``torch.as_tensor`` would truncate
        0.5 to row 0, and a bool would read as a row number or a mask)."""
        if isinstance(rows, slice):
            return torch.arange(self.batch_size)[rows]
        if isinstance(rows, numbers.Integral) and not isinstance(rows, bool):
            return torch.tensor([int(rows)])
        if torch.is_tensor(rows):
            if rows.dtype == torch.bool or rows.dtype.is_floating_point or rows.dtype.is_complex:
                raise TypeError(f"{self._ROWS_ACCEPTED}, got a tensor of {rows.dtype}")
            if rows.dim() > 1:
                raise TypeError(f"{self._ROWS_ACCEPTED}, got a tensor of shape {tuple(rows.shape)} (1-D expected)")
            return rows.reshape(-1).to(torch.long)
        if isinstance(rows, (list, tuple)):
            for k, row in enumerate(rows):
                integer = (isinstance(row, numbers.Integral) and not isinstance(row, bool)) or (
                    torch.is_tensor(row)
                    and row.dim() == 0
                    and not row.dtype.is_floating_point
                    and not row.dtype.is_complex
                    and row.dtype != torch.bool
                )
                if not integer:
                    raise TypeError(f"{self._ROWS_ACCEPTED}, got {row!r} ({type(row).__name__}) at position {k}")
            return torch.tensor([int(row) for row in rows], dtype=torch.long)
        raise TypeError(f"{self._ROWS_ACCEPTED}, got {rows!r} ({type(rows).__name__})")

    def select(self, rows) -> ComposableMambaCache:
        """Rows ``rows`` (int, list of ints, slice or LongTensor) as a new cache owning its tensors."""
        index = self._row_index(rows)
        if index.numel() and (index.min() < -self.batch_size or index.max() >= self.batch_size):
            raise IndexError(f"row index out of range for a cache of batch size {self.batch_size}")
        return self._map_rows(lambda t: t.index_select(0, index.to(t.device) % self.batch_size))

    def __getitem__(self, rows):
        return self.select(rows)

    def repeat_interleave(self, repeats: int) -> ComposableMambaCache:
        """Each row ``repeats`` times in a row (as ``torch.repeat_interleave(dim=0)``), for beam search."""
        if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral):
            raise TypeError(f"repeats must be an int >= 1, got {type(repeats).__name__} {repeats!r:.40}")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        return self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    @classmethod
    def stack(cls, caches: Sequence[ComposableMambaCache]) -> ComposableMambaCache:
        """Concatenate caches of the same model along the batch (called on this class, the caches' own
        class does it, so that a subclass's extra tensors follow their rows)."""
        from .validation import check_compatible

        check_compatible(caches, same_batch=False, where="caches")
        first = caches[0]
        if cls is ComposableMambaCache and type(first) is not cls:
            return type(first).stack(caches)
        out = first.empty_like()
        for i, target in enumerate(out.layers):
            layers = [c.layers[i] for c in caches]
            if getattr(layers[0], "has_keys", False):
                target.fill_keys(*_stack_keys(layers))
            if not isinstance(target, compat.SSMLayerBase):
                continue
            target.fill(torch.cat([l.ssm_state for l in layers]), torch.cat([l.conv_state for l in layers]))
            for name in target._row_tensors:
                if name == "positions":
                    continue
                values = [getattr(l, name) for l in layers]
                setattr(target, name, None if any(v is None for v in values) else torch.cat(values))
            target.A = layers[0].A.clone()
        num_tokens = [c.num_tokens for c in caches if c.num_tokens is not None]
        if len(num_tokens) == len(caches):
            out.num_tokens = torch.cat(num_tokens)
        token_ids = [c.token_ids for c in caches if c.token_ids is not None]
        if len(token_ids) == len(caches):
            width = max(t.shape[1] for t in token_ids)
            out.token_ids = torch.cat(
                [torch.nn.functional.pad(t, (width - t.shape[1], 0), value=-1) for t in token_ids]
            )
        return out

    def finish_composition(self, states: Sequence[ComposableMambaCache]) -> None:
        """Called by the composer on a state it composed from ``states`` (list order, non-empty) after
        setting every layer's SSM state, conv window and ΣΔ: the token counts (the sum over the states, when
        every state has them), and what else the architecture's states carry, which a subclass fills in by
        overriding this hook and calling it (SeRpEnt: the resampling state, from the last state)."""
        counts = [s.num_tokens for s in states if s.num_tokens is not None]
        if counts and len(counts) == len(states):
            self.num_tokens = counts[0] if len(counts) == 1 else torch.stack(counts).sum(0)

    def context_tokens(self, row: int) -> torch.Tensor:
        """The token ids this row's state was encoded from (no padding)."""
        if self.token_ids is None:
            raise ValueError(
                "this state does not carry its context tokens (it was composed or continued); "
                "the 'concat' and 'piconcat_r' methods need states made by ComposableMambaCache.encode"
            )
        ids = self.token_ids[row]
        return ids[ids >= 0]

    # in-place batch ops that generate() calls (beam search reorders, some modes expand or select): transformers'
    # Cache dispatches them to the layers, which own every per-layer tensor; the cache adds its per-row extras
    def reorder_cache(self, beam_idx: torch.Tensor):
        super().reorder_cache(beam_idx)
        self._map_cache_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._map_cache_rows(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._map_cache_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def reset(self):
        super().reset()
        self.num_tokens = None
        self.token_ids = None

    def _map_cache_rows(self, fn) -> None:
        if self.num_tokens is not None:
            self.num_tokens = fn(self.num_tokens)
        if self.token_ids is not None:
            self.token_ids = fn(self.token_ids)

    # ------------------------------------------------------------------ persistence
    def save(self, path, keys_dtype=None) -> None:
        """Write this state to ``path`` as safetensors + JSON metadata, atomically. ``keys_dtype``
        (``torch.bfloat16`` / ``torch.float16``, hybrid states only) stores the attention keys and values in that
        dtype (loading gives them back in the model dtype); ``None``: in the model dtype."""
        from .serialization import save_state

        save_state(self, path, keys_dtype=keys_dtype)

    @classmethod
    def load(cls, path, model=None, device=None) -> ComposableMambaCache:
        """Read a state written by :meth:`save`. With ``model``, checks it was encoded by that model."""
        from .serialization import load_state

        return load_state(path, model=model, device=device)

    _repr_name = "ComposableMambaCache"

    def _repr_layers(self) -> str:
        """The layers part of the repr (a hybrid's cache also names its attention layers and keys)."""
        return f"layers={self.num_layers}"

    def __repr__(self):
        filled = self.is_filled() if self.state_layers else False
        return (
            f"{self._repr_name}(architecture={self.architecture!r}, {self._repr_layers()}, "
            f"batch={self.batch_size if filled else 0}, tokens={self.num_tokens.tolist() if self.num_tokens is not None else None}, "
            f"fingerprint={self.fingerprint[:12]}…)"
        )


def _fill_ssm(layer, ssm_state, conv_state, delta_sum, A) -> None:
    layer.fill(ssm_state, conv_state)
    layer.delta_sum = delta_sum
    layer.A = A


def _stack_keys(layers) -> tuple:
    """The keys, values and positions of attention layers (one per cache) along the batch, each left padded (keys
    and values with zeros, positions with -1) to the longest."""
    length = max(l.keys.shape[-2] for l in layers)

    def pad(t, value, dim):
        missing = length - t.shape[dim]
        if not missing:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t.new_full(shape, value), t], dim=dim)

    return (
        torch.cat([pad(l.keys, 0, -2) for l in layers]),
        torch.cat([pad(l.values, 0, -2) for l in layers]),
        torch.cat([pad(l.positions, -1, -1) for l in layers]),
    )
