"""COFFEE models: "Context-Selective State Space Models: Feedback is All You Need" (arXiv 2510.14027) as
transformers models on this package's COFFEE mixer (:class:`hf_statecompose.models.coffee.mixer.CoffeeMixer`)
and cache.

Two heads of :class:`CoffeeForCausalLM` (``config.head``):

* ``"lm"``, a language model. Per block: RMSNorm → ``in_proj`` (hidden → 2·intermediate: x and z) → the
  COFFEE mixer over the ``intermediate_size`` features of x → ``y ⊙ SiLU(z)`` → ``out_proj`` (intermediate →
  hidden) → + residual; a final RMSNorm and an LM head tied to the embedding. Why this and no more: the
  mixer is per-feature SISO (feature i's output depends only on feature i's inputs, eq. (7): no channel
  mixing at all), so a projection in and one out are the minimum a language model needs to mix features
  across channels; the SiLU gate on a second projection is Mamba's (the multiplicative path that lets a
  block switch its output per token). No causal conv: in Mamba the conv gives Δ, B and C some local context,
  here the gate Δ is a function of the state itself (eq. (5)), which already carries the context, and the
  layer's state is then exactly the SSM state (what states and composition need).
* ``"core"``, the paper's core module (App. F), the model of its experiments: one layer, no norm, no
  projections, no residual. Embedding (|M| × D, rows initialised orthonormal by the QR of a uniform [0, 1)
  D × |M| matrix, App. H.2) → mixer over the D embedding features → per position, the Euclidean distance
  d_m to every embedding vector e_m → softmin → logit: ``logits_m = log(p_m / (1 - p_m))``, computed stably
  as ``-d_m - logsumexp_{j≠m}(-d_j)``. Parameters: exactly ``3 D n + |M| D`` (512 for |M| = 8, D = 16, n = 8).

:class:`CoffeeForImageClassification` is the MNIST model of App. I.2: four mixers of D = ``image_size``
features read the image by rows, by columns, and both reversed; the last output of each, stacked
(``4·image_size``), goes through Linear → GELU → Linear (3385 parameters for n = 2, 25 × 25 images).

Left padding: ``attention_mask`` becomes the mixer's ``mask``: a padding step has gate 0, so it neither feeds
nor decays the state, and every row of a left-padded batch equals that row alone. The prompt runs with the
mixer's ``method="auto"`` (its choice between the parallel Newton / DEER solve and the loop), every later
token as one sequential step (``L = 1``) from the cache.

State. Per layer, the mixer's state ``[B, E, n]`` (E = ``intermediate_size`` for ``"lm"``, ``hidden_size``
for ``"core"``) lives in a :class:`~hf_statecompose.state.cache.ComposableMambaCache` flattened as a
Mamba-1 state (layout: :data:`hf_statecompose.state.architectures.COFFEE`): ``ssm_states[l]`` ``[B, E·n, 1]``
float32, an empty conv window ``[B, E·n, 0]`` (COFFEE has no conv), ``delta_sums[l]`` ``[B, E·n]`` =
``-Σ_k log(1 + λΔ(k))`` accumulated over the tokens, and ``A[l]`` = -1 (``[E·n, 1]``, from the zero buffer
``decay_A_log`` of the layer's mixer), so that ``log_decay(l) = ΣΔ·A`` is each element's log of the product
of its step multipliers: the per-context decay that CASO / PICASO weigh states with. With ``gate="input"``
the model is linear time-varying in its state and CASO of two states is the state of the concatenation;
with the state feedback gate it is an approximation (the second context's gates depend on the state it
started from).

This file is also the modeling file ``save_pretrained`` copies for ``trust_remote_code``: it imports this
package absolutely (``hf_statecompose.…``) and only its config relatively.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import ImageClassifierOutput
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput

from hf_statecompose import compat
from hf_statecompose.models.causal_lm import StateCacheGenerationMixin, refuse_past_states
from hf_statecompose.models.coffee.mixer import CoffeeMixer
from hf_statecompose.state.cache import ComposableMambaCache

from .configuration_coffee import CoffeeConfig

_BASELINES = {"s6": "S6Mixer", "s6_linearized": "LinearizedS6Mixer"}


def build_mixer(config: CoffeeConfig, width: int) -> nn.Module:
    """The sequence mixer of ``config.mixer_type`` over ``width`` features (the baselines are imported on use)."""
    if config.mixer_type == "coffee":
        return CoffeeMixer(width, config.state_size, output_filter=config.output_filter, gate=config.gate)
    module = importlib.import_module("hf_statecompose.models.coffee.baselines")
    mixer = getattr(module, _BASELINES[config.mixer_type])(width, config.state_size)
    for part in mixer.modules():  # initialised by the baseline itself (App. H.2), not by transformers' defaults
        part._hsc_own_init = True
    return mixer


# ---------------------------------------------------------------------------------------------- blocks
class CoffeeRMSNorm(nn.Module):
    """RMSNorm (as MambaRMSNorm / T5LayerNorm; computed in float32, or float64 for float64 inputs)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class CoffeeSequenceMixer(nn.Module):
    """One layer's mixer path: (``"lm"``: ``in_proj`` →) the SSM (``ssm``) (``"lm"``: → ⊙ SiLU(z) → ``out_proj``),
    continuing layer ``layer_idx`` of the cache. ``decay_A_log`` is a zero buffer ``[E·n, 1]``: the states'
    ``A = -exp(decay_A_log) = -1`` (see the module docstring)."""

    decay_A_log: torch.Tensor  # a buffer (registered in __init__)

    # it always runs on this package's cache: hf_statecompose.enable leaves it as it is (no mixer swap)
    _hsc_runs_on_cache = True

    def __init__(self, config: CoffeeConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.projected = config.head == "lm"
        self.mixer_type = config.mixer_type
        width = config.mixer_size
        self.width, self.state_size = width, config.state_size
        if self.projected:
            self.in_proj = nn.Linear(config.hidden_size, 2 * width, bias=False)
            self.out_proj = nn.Linear(width, config.hidden_size, bias=False)
        self.ssm = build_mixer(config, width)
        self.register_buffer("decay_A_log", torch.zeros(width * config.state_size, 1), persistent=False)

    def forward(self, hidden_states: torch.Tensor, cache: ComposableMambaCache | None, mask: torch.Tensor | None):
        """hidden ``[B, L, H]``, mask ``[B, L]`` (1 real, 0 left padding) or None -> ``[B, L, H]``; advances the cache."""
        batch, length = hidden_states.shape[:2]
        if self.projected:
            x, z = self.in_proj(hidden_states).chunk(2, dim=-1)
        else:
            x, z = hidden_states, None
        E, n = self.width, self.state_size
        layer = None if cache is None else cache.layers[self.layer_idx]
        initial = None
        if layer is not None and layer.filled:
            initial = layer.ssm_state.view(batch, E, n)
        log_decay = None
        if self.mixer_type == "coffee":
            # the prompt as the mixer chooses ("auto": Newton / DEER or the loop), a single token as one step of the loop
            method = "sequential" if length == 1 else "auto"
            if cache is not None and self.ssm.gate != "linear_state":
                y, final, log_decay = self.ssm(
                    x, initial_state=initial, method=method, mask=mask, return_log_decay=True
                )
            else:
                y, final = self.ssm(x, initial_state=initial, return_final_state=True, method=method, mask=mask)
        else:  # the baselines: their own mask (a padding step has Δ = 0), no log-decay
            y, final = self.ssm(x, initial_state=initial, return_final_state=True, mask=mask)
        if cache is not None:
            delta_sum = (-log_decay).reshape(batch, E * n) if log_decay is not None else final.new_zeros(batch, E * n)
            cache.advance_layer(
                self.layer_idx,
                ssm_state=final.reshape(batch, E * n, 1),
                conv_state=final.new_zeros((batch, E * n, 0), dtype=hidden_states.dtype),
                delta_sum=delta_sum,
                A=-torch.exp(self.decay_A_log.float()),
            )
        if self.projected:
            y = self.out_proj(y * nn.functional.silu(z))
        return y


class CoffeeBlock(nn.Module):
    """``"lm"``: RMSNorm → mixer path, plus the residual. ``"core"``: the mixer alone (App. F)."""

    def __init__(self, config: CoffeeConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.residual = config.head == "lm"
        self.norm = CoffeeRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon) if self.residual else None
        self.mixer = CoffeeSequenceMixer(config, layer_idx)

    def forward(self, hidden_states, cache, mask):
        if not self.residual:
            return self.mixer(hidden_states, cache, mask)
        return hidden_states + self.mixer(self.norm(hidden_states), cache, mask)


# ---------------------------------------------------------------------------------------------- outputs
@compat.cache_output
class CoffeeOutput(ModelOutput):
    """Output of :class:`CoffeeModel`: the final hidden states (``"lm"``: after the last norm; ``"core"``: the
    mixer's outputs), the cache (when ``use_cache``) and, on request, ``num_hidden_layers + 1`` hidden states
    as transformers' ``MambaModel`` gives them: each layer's output, then the final hidden state."""

    last_hidden_state: torch.Tensor | None = None
    cache: ComposableMambaCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@compat.cache_output
class CoffeeCausalLMOutput(ModelOutput):
    """Output of :class:`CoffeeForCausalLM`: shifted next-token loss (with ``labels``), logits, cache and
    hidden states."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: ComposableMambaCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


def distance_logits(outputs: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
    """The core module's logits (App. F, steps 5–7): ``logit(softmin(d))`` with ``d_m = |y - e_m|``, i.e.
    ``s_m - logsumexp_{j≠m} s_j`` with ``s = -d``, computed without forming p (exact where ``p_m`` rounds to 1).

    The sum over ``j ≠ m`` is taken relative to the largest remaining score, so it is at least 1 and never a
    difference of nearly equal numbers: for m not the argmax, ``Σ_j e^{s_j - a} - e^{s_m - a}`` keeps the
    argmax's term 1 (a = max s); for the argmax, the sum over the others relative to the second largest b."""
    scores = -torch.linalg.vector_norm(outputs[..., None, :] - embeddings, dim=-1)  # [..., M]
    top = scores.topk(2, dim=-1)
    a, b = top.values[..., :1], top.values[..., 1:2]
    is_top = nn.functional.one_hot(top.indices[..., 0], scores.shape[-1]).bool()
    exp_a = torch.exp(scores - a)
    others = (exp_a.sum(-1, keepdim=True) - exp_a).masked_fill(is_top, 1.0)  # Σ_{j≠m} e^{s_j - a}
    top_others = torch.exp(scores - b).masked_fill(is_top, 0.0).sum(-1, keepdim=True)  # Σ_{j≠argmax} e^{s_j - b}
    lse = torch.where(is_top, b + torch.log(top_others), a + torch.log(others))
    return scores - lse


# ---------------------------------------------------------------------------------------------- models
class CoffeePreTrainedModel(PreTrainedModel):
    config: CoffeeConfig
    config_class = CoffeeConfig
    base_model_prefix = "backbone"
    main_input_name = "input_ids"
    _no_split_modules = ["CoffeeBlock"]  # noqa: RUF012 - transformers' PreTrainedModel attribute: declared there without ClassVar, set per instance too
    supports_gradient_checkpointing = False
    _is_stateful = True

    @torch.no_grad()
    def _init_weights(self, module):
        if getattr(module, "_hsc_own_init", False):
            return  # a baseline mixer's parts keep the baseline's own initialisation
        if isinstance(module, nn.Embedding) and self.config.head == "core":  # App. H.2
            init.copy_(module.weight, orthonormal_embeddings(*module.weight.shape).to(module.weight.dtype))
            return
        super()._init_weights(module)
        if isinstance(module, CoffeeMixer):  # App. H.2 (see CoffeeMixer.reset_parameters)
            init.constant_(module.A, module.A_INIT)
            init.normal_(module.C)
            init.normal_(module.w_D)
            if module.w_gamma is not None:
                init.normal_(module.w_gamma)
        elif isinstance(module, CoffeeSequenceMixer):
            init.zeros_(module.decay_A_log)
        elif isinstance(module, CoffeeForImageClassification):
            for linear in (module.classifier_in, module.classifier_out):  # torch's default Linear init
                init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
                bound = 1.0 / math.sqrt(linear.in_features)
                init.uniform_(linear.bias, -bound, bound)


def orthonormal_embeddings(vocab_size: int, width: int) -> torch.Tensor:
    """App. H.2: Q^T of the QR of a uniform [0, 1) ``width × vocab_size`` matrix, ``[vocab_size, width]`` with
    orthonormal rows. With more symbols than dimensions rows cannot all be orthogonal: then the columns are
    (the Q of a uniform ``vocab_size × width`` matrix)."""
    if vocab_size <= width:
        q, _ = torch.linalg.qr(torch.rand(width, vocab_size, dtype=torch.float64))
        return q.T.float()
    q, _ = torch.linalg.qr(torch.rand(vocab_size, width, dtype=torch.float64))
    return q.float()


class CoffeeModel(CoffeePreTrainedModel):
    def __init__(self, config: CoffeeConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CoffeeBlock(config, i) for i in range(config.num_hidden_layers))  # type: ignore[arg-type]  # set in __post_init__
        self.norm_f = CoffeeRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon) if config.head == "lm" else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, new_embeddings):
        self.embeddings = new_embeddings

    def _hsc_states_unsupported(self) -> str | None:
        """Why this model's states cannot be composed (None when they can): the decays need the COFFEE mixer
        with a gate in (0, 1)."""
        if self.config.mixer_type != "coffee":
            return (
                f"states and composition need mixer_type='coffee' (this model's mixer is the "
                f"{self.config.mixer_type!r} baseline, which records no per-context decay)"
            )
        if self.config.gate == "linear_state":
            return (
                "states and composition need gate='state' or 'input': with gate='linear_state' the step "
                "multiplier 1 + λΔ can be negative, so a context has no decay to weigh its state with"
            )
        return None

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: ComposableMambaCache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple | CoffeeOutput:
        r"""
        cache (`ComposableMambaCache`, *optional*):
            The state after earlier tokens: the forward continues from it (and updates it in place).
        use_cache (`bool`, *optional*):
            Return the cache (a new one when ``cache`` is None; ``cache_params``, its name before transformers 5.24, is accepted too).
        attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*):
            1 for real tokens, 0 for left padding (padding neither feeds nor decays the state). With a cache,
            only its last ``sequence_length`` columns are read.
        """
        refuse_past_states(self, kwargs)
        cache = compat.resolve_cache(cache, kwargs)  # `cache_params`, the name before transformers 5.24, works too
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        use_cache = use_cache if use_cache is not None else (self.config.use_cache if not self.training else False)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embeddings(input_ids)
        if cache is not None and not isinstance(cache, ComposableMambaCache):
            raise TypeError(
                f"cache must be a ComposableMambaCache (the state of a COFFEE model), got "
                f"{type(cache).__name__}; pass None to start from an empty state"
            )
        if cache is None and use_cache:
            cache = ComposableMambaCache.empty_for(self)

        batch, length = inputs_embeds.shape[:2]
        mask = None
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = attention_mask[:, -length:].to(device=inputs_embeds.device)
            # an all-ones mask runs as no mask (the mixer's unmasked path); a traced graph keeps it (no branch
            # on the data, so torch.compile / torch.export see one graph)
            keep = compat.is_tracing(inputs_embeds) or not bool((mask != 0).all())
            mask = (mask != 0).to(inputs_embeds.dtype) if keep else None

        # hidden_states as transformers' MambaModel returns them: each layer's output, then the final hidden
        # state (num_hidden_layers + 1 tensors, the last one is last_hidden_state; the embeddings are not in it)
        hidden_states = inputs_embeds
        layer_outputs: list[torch.Tensor] = []
        for block in self.layers:
            hidden_states = block(hidden_states, cache, mask)
            if output_hidden_states:
                layer_outputs.append(hidden_states)
        if cache is not None:
            count = mask.sum(-1) if mask is not None else torch.full((batch,), length, device=inputs_embeds.device)
            cache.add_tokens(count)
        if self.norm_f is not None:
            hidden_states = self.norm_f(hidden_states)
        if output_hidden_states:  # "core" has no final norm: its final hidden state is the last layer's output
            layer_outputs.append(hidden_states)
        all_hidden_states = tuple(layer_outputs) if output_hidden_states else None

        returned_cache = cache if use_cache else None
        if not return_dict:
            return tuple(v for v in (hidden_states, returned_cache, all_hidden_states) if v is not None)
        return CoffeeOutput(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, **compat.cache_kwargs(returned_cache)
        )


class CoffeeForCausalLM(CoffeePreTrainedModel, StateCacheGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}  # noqa: RUF012 - transformers' PreTrainedModel attribute: declared there without ClassVar, set per instance too

    def __init__(self, config: CoffeeConfig):
        super().__init__(config)
        self.backbone = CoffeeModel(config)
        if config.head == "lm":
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:  # the core module's logits come from the distances to the embeddings: no head weights
            self.lm_head = None
            self._tied_weights_keys = {}
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def set_input_embeddings(self, new_embeddings):
        return self.backbone.set_input_embeddings(new_embeddings)

    def get_output_embeddings(self):
        return self.lm_head

    def _hsc_logits(self, hidden_states):
        if self.lm_head is not None:
            return super()._hsc_logits(hidden_states)
        return distance_logits(hidden_states, self.backbone.embeddings.weight).float()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: ComposableMambaCache | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> tuple | CoffeeCausalLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Next-token labels, shifted inside (``labels = input_ids`` works); -100 is ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*):
            Compute the logits of the last ``logits_to_keep`` positions only (0: all), or of the given indices.
        """
        return self._causal_lm_forward(
            CoffeeCausalLMOutput,
            input_ids,
            attention_mask,
            inputs_embeds,
            cache,
            labels,
            output_hidden_states,
            return_dict,
            use_cache,
            logits_to_keep,
            kwargs,
        )


class CoffeeForImageClassification(CoffeePreTrainedModel):
    """App. I.2: four mixers of D = ``image_size`` features over the image by rows (top to bottom), by columns
    (left to right), by rows reversed and by columns reversed; the last output of each, stacked, through
    Linear(4·image_size, classifier_hidden_size) → GELU → Linear(classifier_hidden_size, num_labels)."""

    main_input_name = "pixel_values"
    base_model_prefix = "coffee"

    def __init__(self, config: CoffeeConfig):
        super().__init__(config)
        size = config.image_size
        self.mixers = nn.ModuleList(build_mixer(config, size) for _ in range(4))
        self.classifier_in = nn.Linear(4 * size, config.classifier_hidden_size)
        self.classifier_out = nn.Linear(config.classifier_hidden_size, config.num_labels)  # type: ignore[arg-type]  # set in __post_init__
        self.post_init()

    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> tuple | ImageClassifierOutput:
        r"""
        pixel_values (`torch.Tensor` of shape `(batch_size, image_size, image_size)` or `(batch_size, 1, image_size, image_size)`):
            The images (one channel).
        labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Class indices in ``[0, num_labels)``; gives the cross-entropy ``loss``.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        size = self.config.image_size
        if pixel_values is None:
            raise ValueError(
                "pixel_values is required: [batch, image_size, image_size] or [batch, 1, image_size, image_size]"
            )
        if pixel_values.dim() == 4 and pixel_values.shape[1] == 1:
            pixel_values = pixel_values[:, 0]
        if pixel_values.dim() != 3 or tuple(pixel_values.shape[1:]) != (size, size):
            raise ValueError(
                f"pixel_values must be [batch, {size}, {size}] or [batch, 1, {size}, {size}] (image_size={size}), "
                f"got {tuple(pixel_values.shape)}"
            )
        images = pixel_values.to(self.classifier_in.weight.dtype)
        rows, columns = images, images.transpose(1, 2)  # sequence step k: row k / column k
        readings = (rows, columns, rows.flip(1), columns.flip(1))
        last = [mixer(sequence)[:, -1] for mixer, sequence in zip(self.mixers, readings)]
        logits = self.classifier_out(nn.functional.gelu(self.classifier_in(torch.cat(last, dim=-1))))
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits.float(), labels.to(logits.device).view(-1))
        if not return_dict:
            return (loss, logits) if loss is not None else (logits,)
        return ImageClassifierOutput(loss=loss, logits=logits)


def _register_auto_models() -> None:
    from transformers.models.auto.modeling_auto import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForImageClassification,
    )

    AutoModel.register(CoffeeConfig, CoffeeModel, exist_ok=True)
    AutoModelForCausalLM.register(CoffeeConfig, CoffeeForCausalLM, exist_ok=True)
    AutoModelForImageClassification.register(CoffeeConfig, CoffeeForImageClassification, exist_ok=True)


# save_pretrained writes auto_map and copies this file and the config file (trust_remote_code loading)
CoffeeModel.register_for_auto_class("AutoModel")
CoffeeForCausalLM.register_for_auto_class("AutoModelForCausalLM")
CoffeeForImageClassification.register_for_auto_class("AutoModelForImageClassification")
# the Auto classes know the package's own classes (not those of a copy loaded as remote code)
if __name__ == "hf_statecompose.models.coffee.modeling_coffee":
    _register_auto_models()

__all__ = [
    "CoffeeCausalLMOutput",
    "CoffeeForCausalLM",
    "CoffeeForImageClassification",
    "CoffeeModel",
    "CoffeeOutput",
    "CoffeePreTrainedModel",
    "distance_logits",
]
