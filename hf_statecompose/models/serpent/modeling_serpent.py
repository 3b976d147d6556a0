"""SeRpEnt-Mamba: "SeRpEnt: Selective Resampling for Expressive State Space Models" (arXiv 2501.11729),
§4.2–4.3 and App. B.2, as a transformers model on this package's Mamba ops and cache.

Architecture (eqs. 12–15). Per layer: RMSNorm, then the SeRpEnt block, plus the residual; no linear
layer between blocks (§4.3). The block runs one branch per compression rate κ_b; branch b, on the
normed layer input x (``[B, L, H]``):

* time steps (eq. 13): Δ_l = σ(θ_Δ(x_l))·Δ̄(1−κ_b) + κ_b·Δ̄ with a learnable Δ̄ per branch;
* times t_l = Σ_{i≤l} Δ_i, grid t̄_j = j·Δ̄;
* resampling (eq. 12b): x̄_j = θ_Γ(⊕_{k∈N_K(t̄_j)} [x_k, ε(t̄_j − t_k)]), ε(d)_i = exp(−(d − μ_i)²) with G
  learnable means μ;
* a Mamba-1 selective SSM over x̄ (eq. 15a): transformers' ``MambaMixer`` weights, run by this package's
  scan and conv ops from the cached state;
* reverse resampling (eq. 14b): y_l = ȳ of a grid point (below); the branch outputs are concatenated
  and the skip connection added (eq. 15b).

The choices the paper leaves open, and ours:

* **Dimensionless time.** With u = t/Δ̄, δ_l = Δ_l/Δ̄ = σ(θ_Δ(x_l))(1−κ)+κ ∈ [κ, 1] and the grid is
  the integers: u_l = Σ_{i≤l} δ_i, grid point j at u = j. For κ = 1 δ is exactly 1 (that branch has no
  θ_Δ): it is a Mamba over the tokens. Padding has δ = 0. Δ̄ = exp(log Δ̄) (initialised to 1) enters
  only the distances d = t̄_j − t_k = Δ̄·(j − u_k).
* **Exact, order-independent decisions.** Each token advances an int64 clock by
  q_l = round(δ_l·2^20) (``CLOCK_BITS``); u_l's grid index is g_l = U_l >> 20 = ⌊u_l⌋. Since δ ≤ 1 a token
  creates at most one grid point (when g_l > g_{l−1}); grid points 1, 2, 3, … are created once each, so
  the compressed length is L̄ = g_L ∈ [⌊κL⌋, L]. Integer arithmetic makes the decisions identical
  whether a sequence is run whole, in chunks or token by token.
* **Causal neighbours** (the paper's N_K(t̄_j) is the K nearest in both directions, which a causal LM
  cannot use): the K latest *real* tokens k with t_k ≤ t̄_j. Grid point j is created by token l; its
  neighbours are tokens ≤ l−1, plus l itself when it lies exactly on the grid (U_l = j·2^20, always the
  case for κ = 1). They are found across chunk boundaries (the cache keeps the last K real inputs with
  their clock values) and skipping left padding. Missing neighbours (start of a sequence) contribute
  zeros for both x_k and ε. The concatenation ⊕ is in a fixed order, latest first.
* **Distances with exact values and a gradient.** d = Δ̄·[(j·2^20 − U_k)·2^-20 − (c_k − c_k.detach())]
  with c = cumsum(δ) over the chunk: the value comes from the integer clock (identical in every chunking),
  the gradient is that of Δ̄·(j − u_k), so θ_Δ learns through ε and Δ̄, μ get their gradients too.
  θ_Δ gets no gradient through the discrete grid decisions (piecewise constant).
* **Causal reverse resampling:** eq. 14b copies the *nearest* grid point, which may lie in the future;
  we copy the latest grid point at or before u_l (grid g_l = ⌊u_l⌋), zeros before the first one.
* **Widths.** Every branch reads all H features; branch b writes h_b = H/B features (the concatenation
  of eq. 15b gives H back) and its SSM has i_b = I/B channels (App. B.2: 510 = 3·170), time-step rank
  ⌈h_b/16⌉ unless set.
* **Skip.** Eq. 15b's "+ x_l" is the residual stream (pre-norm block: output = x + ⊕_b y^b); the
  BatchNorm after the skip that App. B.1 uses on LRA is not used (App. B.2's LM setup has RMSNorms).
* **Init.** Branch SSMs as transformers' Mamba (S4D-real A, D = 1, Δ bias, kaiming conv / out_proj);
  θ_Γ, θ_Δ: torch's default Linear init; μ ~ U(0, K) (the distances to the K neighbours lie in about
  [0, K]·Δ̄); Δ̄ = 1.

Layout of the branch SSM input. The new grid points of a chunk are packed to the left: element i of row
b is that row's i-th new grid point, rows with fewer points padded on the right, the tensor as long as
the chunk (not max L̄). Every element therefore sits at a position that does not depend on later tokens
or on the other rows, and every matmul keeps its shape: perturbing tokens after position p changes no
logit at positions ≤ p *bit for bit*, and a row in a ragged batch equals the row run alone. (Right
padding is inert in the scan through its mask; the conv is causal, so the padding after the real
elements does not reach them, and the conv window is taken after each row's last real element.) The
cost is that a branch SSM runs over as many steps as the chunk has tokens.

State. Each (layer, branch) is exactly a Mamba-1 layer's state (SSM, conv window, ΣΔ, A) in a
:class:`~hf_statecompose.state.serpent_cache.ComposableSeRpEntCache`, plus the resampling extras (clock,
last K inputs with their times, last ȳ). A forward without a cache uses a fresh throwaway one: the full
forward and the incremental one are one code path.

This file is also the modeling file ``save_pretrained`` copies for ``trust_remote_code``: it imports this
package absolutely (``hf_statecompose.…``) and only its config relatively.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import ModelOutput

from hf_statecompose import compat
from hf_statecompose.models.causal_lm import StateCacheGenerationMixin, refuse_past_states
from hf_statecompose.models.mamba import selective_ssm
from hf_statecompose.ops import backends
from hf_statecompose.state.architectures import architecture
from hf_statecompose.state.serpent_cache import CLOCK_BITS, CLOCK_ONE, ComposableSeRpEntCache

from .configuration_serpent import SeRpEntMambaConfig


def _mamba_mixer_class():
    # transformers' Mamba modules are imported on use: this module is imported by a post-import hook of
    # transformers' auto classes, which can run while transformers is half way through importing them
    return architecture("mamba").stock_mixer_class()


def branch_ssm_config(config: SeRpEntMambaConfig):
    """The ``MambaConfig`` of every branch SSM: width h_b, i_b channels, one layer index per (layer, branch)."""
    from transformers import MambaConfig

    ssm_config = MambaConfig(
        vocab_size=1,
        hidden_size=config.branch_hidden_size,
        state_size=config.state_size,
        num_hidden_layers=config.num_hidden_layers * config.num_branches,
        conv_kernel=config.conv_kernel,
        use_bias=config.use_bias,
        use_conv_bias=config.use_conv_bias,
        hidden_act=config.hidden_act,
        initializer_range=config.initializer_range,
        time_step_rank=config.branch_time_step_rank,
        time_step_scale=config.time_step_scale,
        time_step_min=config.time_step_min,
        time_step_max=config.time_step_max,
        time_step_init_scheme=config.time_step_init_scheme,
        time_step_floor=config.time_step_floor,
        rescale_prenorm_residual=config.rescale_prenorm_residual,
    )
    ssm_config.intermediate_size = config.branch_intermediate_size  # I/B, not necessarily expand * h_b
    return ssm_config


# ---------------------------------------------------------------------------------------------- SSM path
def branch_ssm_forward(mixer, hidden_states: torch.Tensor, cache, count: torch.Tensor, backend: str = "auto"):
    """A Mamba-1 mixer over left-packed elements: ``hidden_states`` ``[B, T, h]`` whose element i of row b is
    real for ``i < count[b]`` (right padding). Continues virtual layer ``mixer.layer_idx`` of ``cache``
    (SSM state, conv window, ΣΔ) and returns ``[B, T, h]`` (padding positions hold garbage)."""
    layer_idx = mixer.layer_idx
    dtype = hidden_states.dtype
    _batch, length, _ = hidden_states.shape
    layer = cache.layers[layer_idx]
    positions = torch.arange(length, device=hidden_states.device)
    mask = (positions[None] < count[:, None]).to(dtype)  # [B, T]
    hidden_states = hidden_states * mask[:, :, None]

    projected = mixer.in_proj(hidden_states).transpose(1, 2)  # [B, 2D, T]
    x, gate = projected.chunk(2, dim=1)  # [B, D, T] each
    window = layer.conv_state  # [B, D, W]
    # the conv is causal: the right padding cannot reach the real elements, so no mask (the ops' mask means
    # left padding); the window to keep is the W inputs that end at each row's last real element
    x, _ = backends.causal_conv1d(
        x,
        mixer.conv1d.weight.squeeze(1),
        mixer.conv1d.bias if mixer.use_conv_bias else None,
        conv_state=window,
        mask=None,
        activation=mixer.activation,
        backend=backend,
    )
    inputs = torch.cat([window.to(projected.dtype), projected[:, : projected.shape[1] // 2]], dim=-1)  # [B, D, W + T]
    kernel = window.shape[-1]
    ends = (count[:, None] + torch.arange(kernel, device=count.device))[:, None, :]  # [B, 1, W]
    new_window = inputs.gather(2, ends.expand(-1, inputs.shape[1], -1))
    x = x * mask[:, None, :].to(x.dtype)

    y, ssm_state, delta_sum, A = selective_ssm(mixer, x, gate, layer.ssm_state, mask, backend)
    cache.advance_layer(layer_idx, ssm_state=ssm_state, conv_state=new_window, delta_sum=delta_sum, A=A)
    return mixer.out_proj(y.transpose(1, 2).to(dtype))


# ---------------------------------------------------------------------------------------------- block
class SeRpEntRMSNorm(nn.Module):
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


class SeRpEntBranch(nn.Module):
    """Branch b of a SeRpEnt block: time steps (θ_Δ, eq. 13), resampling (θ_Γ, μ, Δ̄; eq. 12b), the branch
    SSM (eq. 15a) and the reverse resampling (eq. 14b)."""

    def __init__(self, config: SeRpEntMambaConfig, ssm_config, layer_idx: int, branch: int):
        super().__init__()
        hidden, gaussians, window = config.hidden_size, config.num_gaussians, config.resample_window
        self.compression = config.branch_compressions[branch]  # κ_b
        self.window = window  # K
        self.branch_hidden_size = config.branch_hidden_size  # h_b
        # θ_Δ: none for κ = 1, whose δ is exactly 1
        self.delta_proj = nn.Linear(hidden, 1) if self.compression < 1.0 else None
        self.resample_proj = nn.Linear(window * (hidden + gaussians), self.branch_hidden_size)  # θ_Γ
        self.gaussian_means = nn.Parameter(torch.empty(gaussians))  # μ
        self.log_delta_bar = nn.Parameter(torch.zeros(()))  # log Δ̄
        self.ssm = _mamba_mixer_class()(ssm_config, layer_idx=layer_idx * config.num_branches + branch)

    def time_steps(self, hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """δ = Δ/Δ̄ per token ``[B, T]`` (float32, float64 for a float64 model): in [κ, 1] for real tokens,
        0 for padding."""
        compute = torch.promote_types(hidden.dtype, torch.float32)
        if self.delta_proj is None:
            return real.to(compute)
        gate = torch.sigmoid(self.delta_proj(hidden).squeeze(-1).to(compute))
        return (gate * (1.0 - self.compression) + self.compression) * real

    def forward(self, hidden: torch.Tensor, cache: ComposableSeRpEntCache, real: torch.Tensor, backend: str):
        """hidden ``[B, T, H]`` (normed), real ``[B, T]`` bool (False: left padding) -> y^b ``[B, T, h_b]``."""
        batch, length, width = hidden.shape
        K, device, out_width = self.window, hidden.device, self.branch_hidden_size
        ssm = self.ssm
        v = ssm.layer_idx
        cache.ensure_layer(
            v,
            batch=batch,
            hidden_size=width,
            branch_hidden=out_width,
            ssm_shape=(ssm.intermediate_size, ssm.ssm_state_size),
            conv_shape=(ssm.intermediate_size, ssm.conv_kernel_size),
            A=-torch.exp(ssm.A_log.float()),
            dtype=hidden.dtype,
            device=device,
        )
        clock0 = cache.clocks[v]  # [B] int64
        grid0 = clock0 >> CLOCK_BITS  # latest grid point before this chunk

        # 1. time: the int64 clock U (exact) and the grid index g = floor(u) of every token
        delta = self.time_steps(hidden, real)  # [B, T]
        steps = torch.round(delta.detach().double() * CLOCK_ONE).long().clamp_(max=CLOCK_ONE)
        clock = clock0[:, None] + steps.cumsum(1)  # [B, T]
        grid = clock >> CLOCK_BITS
        created = grid > torch.cat([grid0[:, None], grid[:, :-1]], dim=1)  # token l creates grid point g_l
        count = created.sum(1)  # [B] new grid points

        # 2. the candidates: the cached last K real inputs, then this chunk, real entries packed to the right
        cumulative = delta.cumsum(1)
        carrier = cumulative - cumulative.detach()  # value 0, gradient of u_k
        hist_x = torch.cat([cache.window_inputs[v], hidden.to(delta.dtype)], dim=1)  # [B, K + T, H]
        hist_t = torch.cat([cache.window_times[v], clock], dim=1)  # [B, K + T]
        hist_valid = torch.cat([cache.window_valid[v], real], dim=1)
        hist_c = torch.cat([carrier.new_zeros(batch, K), carrier], dim=1)
        order = torch.argsort(hist_valid.to(torch.int32), dim=1, stable=True)  # padding first, real in order
        packed_x = hist_x.gather(1, order[:, :, None].expand(-1, -1, width))
        packed_t, packed_valid, packed_c = (t.gather(1, order) for t in (hist_t, hist_valid, hist_c))
        total = K + length
        # packed position of chunk token l: K + T - (real entries from l on)
        packed_pos = total - hist_valid.flip(1).cumsum(1).flip(1)[:, K:]  # [B, T]

        # 3. this chunk's new grid points, packed to the left (element i: the row's i-th new point)
        creators = torch.argsort((~created).to(torch.int32), dim=1, stable=True)  # [B, T] token of element i
        element_real = torch.arange(length, device=device)[None] < count[:, None]  # [B, T]
        point_clock = grid.gather(1, creators) << CLOCK_BITS  # j · 2^20
        on_grid = clock.gather(1, creators) == point_clock
        latest = packed_pos.gather(1, creators) - (~on_grid).long()  # latest neighbour: t_k <= t̄_j
        neighbours = (latest[:, :, None] - torch.arange(K, device=device)).clamp_(0, total - 1)  # [B, T, K]
        flat = neighbours.reshape(batch, -1)
        nb_x = packed_x.gather(1, flat[:, :, None].expand(-1, -1, width)).view(batch, length, K, width)
        nb_t, nb_valid, nb_c = (t.gather(1, flat).view(batch, length, K) for t in (packed_t, packed_valid, packed_c))
        nb_valid = nb_valid & element_real[:, :, None]

        # 4. resampling (eq. 12b): d = Δ̄ (j − u_k), values from the integer clock, gradients through u_k and Δ̄
        gap = ((point_clock[:, :, None] - nb_t).double() / CLOCK_ONE).to(delta.dtype)
        distance = self.log_delta_bar.exp() * (gap - nb_c)  # [B, T, K]
        basis = torch.exp(-((distance[..., None] - self.gaussian_means) ** 2))  # ε: [B, T, K, G]
        features = torch.cat([nb_x, basis], dim=-1) * nb_valid[..., None]  # missing neighbours: zeros
        weight = self.resample_proj.weight
        resampled = self.resample_proj(features.flatten(2).to(weight.dtype))  # x̄: [B, T, h_b]
        resampled = resampled * element_real[:, :, None].to(resampled.dtype)

        # 5. the branch SSM over the new elements. A row without new grid points (count 0) runs as all right
        # padding: Δ = 0 leaves its SSM state and ΣΔ bit for bit, its conv window is the old one, and no token
        # reads its outputs (step 6 picks only the cached ȳ for it). No branch on the data: the same graph for
        # every input, so torch.compile / torch.export trace it
        last = cache.last_outputs[v]  # [B, h_b]: ȳ of the latest grid point before this chunk
        outputs = branch_ssm_forward(ssm, resampled, cache, count, backend=backend)
        table = torch.cat([last[:, None].to(outputs.dtype), outputs], dim=1)  # [B, 1 + T, h_b]

        # 6. reverse resampling (eq. 14b, causal): token l copies ȳ of grid point g_l = floor(u_l)
        pick = (grid - grid0[:, None]).clamp_(min=0)  # 0: the cached one; i >= 1: element i - 1 of this chunk
        y = table.gather(1, pick[:, :, None].expand(-1, -1, out_width)) * real[:, :, None].to(table.dtype)

        cache.set_resampling(
            v,
            clock=clock[:, -1],
            inputs=packed_x[:, length:],
            times=packed_t[:, length:],
            valid=packed_valid[:, length:],
            last_output=table.gather(1, count[:, None, None].expand(-1, 1, out_width))[:, 0],
        )
        return y


class SeRpEntMixer(nn.Module):
    """The SeRpEnt block of one layer: every branch on the same input, outputs concatenated (eq. 15b
    without the skip, which the layer adds as its residual)."""

    # it always runs on this package's cache: hf_statecompose.enable leaves it as it is (no mixer swap)
    _hsc_runs_on_cache = True

    def __init__(self, config: SeRpEntMambaConfig, ssm_config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.branches = nn.ModuleList(
            SeRpEntBranch(config, ssm_config, layer_idx, branch) for branch in range(config.num_branches)
        )

    def forward(self, hidden_states: torch.Tensor, cache: ComposableSeRpEntCache, real: torch.Tensor):
        backend = getattr(self, "_hsc_backend", "auto")
        return torch.cat([branch(hidden_states, cache, real, backend) for branch in self.branches], dim=-1)


class SeRpEntMambaBlock(nn.Module):
    """RMSNorm → SeRpEnt block, plus the residual."""

    def __init__(self, config: SeRpEntMambaConfig, ssm_config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = SeRpEntRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer = SeRpEntMixer(config, ssm_config, layer_idx)

    def forward(self, hidden_states, cache: ComposableSeRpEntCache, real: torch.Tensor):
        residual = hidden_states
        hidden_states = self.norm(hidden_states.to(dtype=self.norm.weight.dtype))
        if self.residual_in_fp32:
            residual = residual.to(torch.float32)
        return residual + self.mixer(hidden_states, cache, real)


# ---------------------------------------------------------------------------------------------- models
@compat.cache_output
class SeRpEntMambaOutput(ModelOutput):
    """Output of :class:`SeRpEntMambaModel`: the final hidden states (after the last norm), the cache
    (when ``use_cache``) and, on request, ``num_hidden_layers + 1`` hidden states as transformers' ``MambaModel``
    gives them: each layer's output, then the final hidden state (after the last norm)."""

    last_hidden_state: torch.Tensor | None = None
    cache: ComposableSeRpEntCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@compat.cache_output
class SeRpEntMambaCausalLMOutput(ModelOutput):
    """Output of :class:`SeRpEntMambaForCausalLM`: shifted next-token loss (with ``labels``), logits, cache
    and hidden states."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: ComposableSeRpEntCache | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class SeRpEntMambaPreTrainedModel(PreTrainedModel):
    config: SeRpEntMambaConfig
    config_class = SeRpEntMambaConfig
    base_model_prefix = "backbone"
    _no_split_modules = ["SeRpEntMambaBlock"]  # noqa: RUF012 - transformers' PreTrainedModel attribute: declared there without ClassVar, set per instance too
    supports_gradient_checkpointing = False
    _is_stateful = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, SeRpEntBranch):
            # θ_Γ and θ_Δ keep torch's default Linear init (kaiming-uniform weights, uniform bias)
            for linear in (module.resample_proj, module.delta_proj):
                if linear is None:
                    continue
                init.kaiming_uniform_(linear.weight, a=math.sqrt(5))
                bound = 1.0 / math.sqrt(linear.in_features)
                init.uniform_(linear.bias, -bound, bound)
            init.uniform_(module.gaussian_means, 0.0, float(module.window))
            init.zeros_(module.log_delta_bar)
        elif isinstance(module, _mamba_mixer_class()):
            # transformers' Mamba init (MambaPreTrainedModel._init_weights) for each branch SSM
            module.init_mamba_weights()
            init.kaiming_uniform_(module.conv1d.weight, a=math.sqrt(5))
            if module.conv1d.bias is not None:
                init.zeros_(module.conv1d.bias)
            init.kaiming_uniform_(module.out_proj.weight, a=math.sqrt(5))
            if self.config.rescale_prenorm_residual:
                module.out_proj.weight /= math.sqrt(self.config.num_hidden_layers)


class SeRpEntMambaModel(SeRpEntMambaPreTrainedModel):
    def __init__(self, config: SeRpEntMambaConfig):
        super().__init__(config)
        ssm_config = branch_ssm_config(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(SeRpEntMambaBlock(config, ssm_config, i) for i in range(config.num_hidden_layers))
        self.norm_f = SeRpEntRMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, new_embeddings):
        self.embeddings = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: ComposableSeRpEntCache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple | SeRpEntMambaOutput:
        r"""
        cache (`ComposableSeRpEntCache`, *optional*):
            The state after earlier tokens: the forward continues from it (and updates it in place).
        use_cache (`bool`, *optional*):
            Return the cache (a new one when ``cache`` is None; ``cache_params``, its name before transformers 5.24, is accepted too).
        attention_mask (`torch.Tensor` of shape `(batch_size, sequence_length)`, *optional*):
            1 for real tokens, 0 for left padding (padding is skipped: it neither advances the time nor
            becomes a neighbour). With a cache, only its last ``sequence_length`` columns are read.
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
        if cache is not None and not isinstance(cache, ComposableSeRpEntCache):
            raise TypeError(
                f"cache must be a ComposableSeRpEntCache (the state of a SeRpEnt model), got "
                f"{type(cache).__name__}; pass None to start from an empty state"
            )
        if cache is None:
            if use_cache:
                cache = ComposableSeRpEntCache.empty_for(self)
            else:  # a throwaway state: one code path for the full and the incremental forward
                cache = ComposableSeRpEntCache._for_config(self.config, self.embeddings.weight.dtype)

        batch, length = inputs_embeds.shape[:2]
        if attention_mask is not None and attention_mask.dim() == 2:
            real = attention_mask[:, -length:].to(device=inputs_embeds.device) != 0
        else:
            real = torch.ones((batch, length), dtype=torch.bool, device=inputs_embeds.device)

        # as transformers' MambaModel: each layer's output, then the final hidden state (after the last norm):
        # num_hidden_layers + 1 tensors
        hidden_states = inputs_embeds
        layer_outputs: list[torch.Tensor] = []
        for block in self.layers:
            hidden_states = block(hidden_states, cache, real)
            if output_hidden_states:
                layer_outputs.append(hidden_states)
        cache.add_tokens(real.sum(-1))
        hidden_states = self.norm_f(hidden_states)
        if output_hidden_states:
            layer_outputs.append(hidden_states)
        all_hidden_states = tuple(layer_outputs) if output_hidden_states else None

        returned_cache = cache if use_cache else None
        if not return_dict:
            return tuple(v for v in (hidden_states, returned_cache, all_hidden_states) if v is not None)
        return SeRpEntMambaOutput(
            last_hidden_state=hidden_states, hidden_states=all_hidden_states, **compat.cache_kwargs(returned_cache)
        )


class SeRpEntMambaForCausalLM(SeRpEntMambaPreTrainedModel, StateCacheGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "backbone.embeddings.weight"}  # noqa: RUF012 - transformers' PreTrainedModel attribute: declared there without ClassVar, set per instance too

    def __init__(self, config: SeRpEntMambaConfig):
        super().__init__(config)
        self.backbone = SeRpEntMambaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.get_input_embeddings()

    def set_input_embeddings(self, new_embeddings):
        return self.backbone.set_input_embeddings(new_embeddings)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        cache: ComposableSeRpEntCache | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> tuple | SeRpEntMambaCausalLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Next-token labels, shifted inside (``labels = input_ids`` works); -100 is ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*):
            Compute the logits of the last ``logits_to_keep`` positions only (0: all), or of the given indices.
        """
        return self._causal_lm_forward(
            SeRpEntMambaCausalLMOutput,
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


def _register_auto_models() -> None:
    from transformers.models.auto.modeling_auto import AutoModel, AutoModelForCausalLM

    AutoModel.register(SeRpEntMambaConfig, SeRpEntMambaModel, exist_ok=True)
    AutoModelForCausalLM.register(SeRpEntMambaConfig, SeRpEntMambaForCausalLM, exist_ok=True)


# save_pretrained writes auto_map and copies this file and the config file (trust_remote_code loading)
SeRpEntMambaModel.register_for_auto_class("AutoModel")
SeRpEntMambaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
# the Auto classes know the package's own classes (not those of a copy loaded as remote code)
if __name__ == "hf_statecompose.models.serpent.modeling_serpent":
    _register_auto_models()

__all__ = [
    "SeRpEntMambaCausalLMOutput",
    "SeRpEntMambaForCausalLM",
    "SeRpEntMambaModel",
    "SeRpEntMambaOutput",
    "SeRpEntMambaPreTrainedModel",
    "branch_ssm_forward",
]
