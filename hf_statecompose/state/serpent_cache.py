"""``ComposableSeRpEntCache``: the state of a SeRpEnt-Mamba model (``model_type = "serpent_mamba"``).

A SeRpEnt layer runs one Mamba-1 SSM per branch on that branch's resampled sequence. This cache holds
``num_hidden_layers * num_branches`` *virtual layers*, ``v = layer * num_branches + branch``, each exactly
the state of a Mamba-1 layer (what :class:`ComposableMambaCache` documents, with Mamba-1 semantics):

* ``ssm_states[v]`` ``[B, i_b, N]`` (float32), ``conv_states[v]`` ``[B, i_b, conv_kernel]`` (model dtype),
* ``delta_sums[v]`` ``[B, i_b]`` (ΣΔ over the branch's *resampled* elements) and ``A[v]`` ``[i_b, N]``,
  so ``log_decay(v) = ΣΔ[:, :, None] * A[None]``,

plus, per virtual layer, what the resampling needs to continue exactly where the last chunk stopped:

* ``clocks[v]`` ``[B]`` int64: the running dimensionless time ``u = t / Δ̄`` as a fixed-point integer
  (``CLOCK_ONE`` per unit); the latest grid point created is ``clock >> CLOCK_BITS``;
* ``window_inputs[v]`` ``[B, K, H]`` (float32; float64 for a float64 model), ``window_times[v]`` ``[B, K]`` int64 and
  ``window_valid[v]`` ``[B, K]`` bool: the last K real inputs of the layer (after its norm), oldest
  first, with their clock values (missing ones, at the start of a sequence, are marked invalid);
* ``last_outputs[v]`` ``[B, h_b]``: the branch SSM's output at the latest grid point, which tokens read
  until the next grid point is created (zeros before the first one).

Everything else (token counts, context token ids, fingerprint, batch operations, persistence hooks) is
inherited; the batch operations are extended so that the resampling extras follow their rows (beam
search reorders them, ``num_return_sequences`` repeats them). State files store the extras as
``resample.clock.{v}``, ``resample.inputs.{v}``, ``resample.times.{v}``, ``resample.valid.{v}`` and
``resample.last_output.{v}`` (their dtypes, shapes and value checks: :data:`.architectures.SERPENT_MAMBA`).

**Composition.** The branch SSM states compose as Mamba-1 states (per element, with each branch's decay
``exp(ΣΔ · A)``: they are Mamba SSMs over the resampled inputs). The resampling state of a composition
(clock, hence the grid phase; the neighbour window with its times; the last ȳ) is the one of the **last**
state in the list, the context nearest the query in concatenation order, for every model-free method
(:meth:`finish_composition`); for one state it is that state's, so one state + query stays exact. The
clock's absolute value plays no role (the model reads only its phase, ``clock mod 2^20``, and its
differences to the window's times), so the last state's window keeps its exact distances; what is
approximate is the phase (after a real concatenation it depends on the earlier contexts' total time) and
that the window and last ȳ saw only the last context (at layers > 0 the inputs of a concatenation also
depend on the earlier contexts). On the trained miniature LM (``benchmarks/serpent_composition.py``) this
choice makes 80-90% of CASO's small gap to ``concat`` (KL 0.0004 nats); the branch SSM composition the
rest. ``concat`` re-encodes the tokens and is exact; ``piconcat_r`` takes the resampling state of its
list-order concatenation (the rotation that ends with the last state, i.e. what ``concat`` gives).
"""

from __future__ import annotations

import torch

from .architectures import SERPENT_CLOCK_BITS, SERPENT_MAMBA
from .cache import ComposableMambaCache
from .fingerprint import architecture_of, base_model_of, new_state_fingerprint
from .layers import SeRpEntSSMLayer, layer_attribute

# fixed-point resolution of the resampling clock: each token advances it by round(δ · 2^20), δ in [κ, 1]
CLOCK_BITS = SERPENT_CLOCK_BITS
CLOCK_ONE = 1 << CLOCK_BITS

_EXTRAS = tuple(extra.attribute for extra in SERPENT_MAMBA.extras)  # clocks, window_inputs, ...


class ComposableSeRpEntCache(ComposableMambaCache):
    """The cache of a SeRpEnt-Mamba model: one Mamba-1 state per (layer, branch) plus the resampling extras,
    each (layer, branch) a :class:`~hf_statecompose.state.layers.SeRpEntSSMLayer` owning all of its tensors."""

    _layer_class = SeRpEntSSMLayer

    def __init__(
        self,
        config,
        *,
        architecture: str = "serpent_mamba",
        fingerprint: str = "",
        model_dtype: torch.dtype = torch.float32,
        model_info=None,
        **kwargs,
    ):
        super().__init__(
            config,
            architecture=architecture,
            fingerprint=fingerprint,
            model_dtype=model_dtype,
            model_info=model_info,
            **kwargs,
        )
        self.num_branches = len(config.branch_compressions)
        self.resample_window = config.resample_window

    # per virtual layer, read and assigned through the layers (cache.clocks[v], cache.window_inputs[v] = x, ...)
    clocks = layer_attribute("clocks", "Per virtual layer: the resampling clock ``[B]`` int64.")
    window_inputs = layer_attribute("window_inputs", "Per virtual layer: the last K inputs ``[B, K, H]``.")
    window_times = layer_attribute("window_times", "Per virtual layer: their clock values ``[B, K]`` int64.")
    window_valid = layer_attribute("window_valid", "Per virtual layer: which of them are real ``[B, K]`` bool.")
    last_outputs = layer_attribute("last_outputs", "Per virtual layer: the branch output at the latest grid point.")

    @classmethod
    def empty_for(cls, model) -> ComposableSeRpEntCache:
        """A cache with no state yet, for a SeRpEnt ``model``: the model's forward fills it."""
        architecture = architecture_of(model)
        if architecture != "serpent_mamba":
            raise TypeError(f"ComposableSeRpEntCache is the state of SeRpEnt models, got a {architecture!r} model")
        return cls._for_config(
            model.config, next(base_model_of(model).parameters()).dtype, new_state_fingerprint(model)
        )

    @classmethod
    def _for_config(cls, config, dtype: torch.dtype, fingerprint: str = "") -> ComposableSeRpEntCache:
        info = {
            "model_type": config.model_type,
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "state_size": config.state_size,
            "branch_compressions": list(config.branch_compressions),
            "resample_window": config.resample_window,
        }
        return cls(config, architecture="serpent_mamba", fingerprint=fingerprint, model_dtype=dtype, model_info=info)

    # ------------------------------------------------------------------ layout
    def virtual_layer(self, layer_idx: int, branch: int) -> int:
        return layer_idx * self.num_branches + branch

    # log_decay(v): Mamba-1 semantics for every virtual layer (ΣΔ[b, d] · A[d, n] as [B, i_b, N]), inherited:
    # the architecture's description says its decay is per element

    def finish_composition(self, states) -> None:
        """The token counts as every state's (:meth:`ComposableMambaCache.finish_composition`); the resampling state
        of a composition is the last state's (see the module docstring): copies, so that the composed state shares
        no tensor with an input but for n = 1 (which composes to itself)."""
        super().finish_composition(states)
        last = states[-1]
        copy = (lambda t: t) if len(states) == 1 else (lambda t: t.clone())
        for name in _EXTRAS:
            setattr(self, name, [copy(t) if t is not None else None for t in getattr(last, name)])

    def to(self, device=None, dtype=None) -> ComposableSeRpEntCache:
        """As :meth:`ComposableMambaCache.to`; ``dtype`` also converts the last outputs (model dtype) and the
        window inputs (float32, float64 for a float64 model), as a model in that dtype keeps them."""
        out = super().to(device, dtype)
        if dtype is not None:
            out.last_outputs = [t.to(dtype) if t is not None else None for t in out.last_outputs]
            inputs_dtype = torch.promote_types(dtype, torch.float32)
            out.window_inputs = [t.to(inputs_dtype) if t is not None else None for t in out.window_inputs]
        return out

    def ensure_layer(
        self,
        layer_idx: int,
        *,
        batch: int,
        hidden_size: int,
        branch_hidden: int,
        ssm_shape: tuple,
        conv_shape: tuple,
        A: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Give virtual layer ``layer_idx`` its empty state if it has none: what a first forward starts from
        (zero SSM state and conv window, clock 0, no inputs seen, zero last output)."""
        if self.layers[layer_idx].filled:
            return
        self.set_layer(
            layer_idx,
            ssm_state=torch.zeros((batch, *ssm_shape), dtype=torch.float32, device=device),
            conv_state=torch.zeros((batch, *conv_shape), dtype=dtype, device=device),
            delta_sum=torch.zeros((batch, ssm_shape[0]), dtype=torch.float32, device=device),
            A=A if torch.is_grad_enabled() else A.detach(),
        )
        K = self.resample_window
        self.set_resampling(
            layer_idx,
            clock=torch.zeros(batch, dtype=torch.long, device=device),
            inputs=torch.zeros((batch, K, hidden_size), dtype=torch.promote_types(dtype, torch.float32), device=device),
            times=torch.zeros((batch, K), dtype=torch.long, device=device),
            valid=torch.zeros((batch, K), dtype=torch.bool, device=device),
            last_output=torch.zeros((batch, branch_hidden), dtype=dtype, device=device),
        )

    def set_resampling(self, layer_idx: int, *, clock, inputs, times, valid, last_output) -> None:
        self.clocks[layer_idx] = clock
        self.window_inputs[layer_idx] = inputs
        self.window_times[layer_idx] = times
        self.window_valid[layer_idx] = valid
        self.last_outputs[layer_idx] = last_output

    # batch operations (select, stack, repeat, beams' reorder, ...) are inherited: the resampling tensors live on
    # the layers as per-row tensors, so every one of them follows its rows

    def __repr__(self):
        filled = self.is_filled() if self.layers else False
        tokens = self.num_tokens.tolist() if self.num_tokens is not None else None
        return (
            f"ComposableSeRpEntCache(layers={self.config.num_hidden_layers}x{self.num_branches} branches, "
            f"batch={self.batch_size if filled else 0}, tokens={tokens}, fingerprint={self.fingerprint[:12]}…)"
        )
