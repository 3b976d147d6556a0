"""The initial-state-aware paths of two hybrid models' SSM mixers (issue 22, "mixers"): Jamba's
``JambaMambaMixer`` (Mamba-1 with RMS norms *with weights* on Δ, B and C: :func:`mamba_mixer_forward`) and
FalconH1's ``FalconH1Mixer`` (Mamba-2 with µP multipliers, ``mamba_d_ssm`` inner size and an optional gated norm:
:func:`falcon_h1_mixer_forward`).

Each path is run on the mixer module of a tiny random model (float64 and float32, every parameter perturbed so that norm
weights, biases and multipliers all matter) and checked against the stock mixer's own forward: from an empty
state it is the stock forward; a prefix then a suffix (one or several tokens, or token by token) continuing
from our state is the whole sequence; a left-padded row is that row alone; ΣΔ is the sum of the stock
mixer's Δ over the real tokens; the gradients are the stock forward's; and the state layer has the shapes the
architecture table lists. Last, in the whole model (its mixers patched to our paths, the decoder layers passing the
mask and cache as they do on 5.23 and 5.24): prefix, suffix and single steps give the whole sequence's logits, and a
left-padded row gives that row's logits alone."""

import dataclasses
import inspect
import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hf_statecompose.models.falcon_h1 import falcon_h1_mixer_forward
from hf_statecompose.models.mamba import mamba_mixer_forward
from hf_statecompose.state.cache import ComposableMambaCache

from helpers import relative_error

SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
}
# two groups; the stock chunk size 4 makes the stock scan cross chunks
FALCON_H1 = {
    "num_hidden_layers": 2,
    "mamba_n_heads": 4,
    "mamba_d_head": 12,
    "mamba_d_ssm": 48,
    "mamba_d_state": 8,
    "mamba_n_groups": 2,
    "mamba_chunk_size": 4,
    "head_dim": 8,
}
CONFIGS = {
    # layers 0 and 2 are Mamba layers (attention at 1 and 3)
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 4,
        "mamba_proj_bias": True,
        "use_mamba_kernels": True,
    },
    # µP multipliers all different from 1; no norm (y · silu(gate)); then the gated norm, gate first / norm first
    "falcon_h1": {
        **FALCON_H1,
        "mamba_proj_bias": True,
        "ssm_in_multiplier": 0.7,
        "ssm_multipliers": [1.3, 0.6, 0.8, 1.2, 0.9],
    },
    "falcon_h1-norm": {
        **FALCON_H1,
        "mamba_rms_norm": True,
        "mamba_norm_before_gate": False,
        "ssm_in_multiplier": 1.4,
        "ssm_multipliers": [0.9, 1.1, 0.7, 1.3, 0.8],
        "time_step_limit": (0.05, 1.5),
    },
    "falcon_h1-norm-first": {**FALCON_H1, "mamba_rms_norm": True, "mamba_norm_before_gate": True},
}
PATHS = {"jamba": mamba_mixer_forward, "falcon_h1": falcon_h1_mixer_forward}
LAYER = {"jamba": 2, "falcon_h1": 1}  # a mixer that is not the first layer's: its layer_idx indexes the cache
HIDDEN = 32
# float64 models run the vectorized kernels, float32 ones the native CPU kernels used for inference. Even in float64
# the cache keeps SSM states, ΣΔ and A in float32 (and A = -exp(A_log.float()) as the stock mixers compute it):
# agreement is to float32 rounding
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}


def _model_type(name):
    return name.split("-")[0]


@dataclasses.dataclass
class Case:
    """One architecture's stock mixer (layer LAYER of a tiny random model), our path for it and the tolerance."""

    model_type: str
    config: object
    mixer: torch.nn.Module
    path: object
    dtype: torch.dtype
    tol: float

    def cache(self):
        """An empty cache with one layer per model layer (the mixer's layer_idx indexes it)."""
        architecture = "mamba" if self.model_type == "jamba" else "mamba2"
        return ComposableMambaCache(
            self.config,
            architecture=architecture,
            fingerprint="x",
            model_dtype=self.dtype,
            num_layers=self.config.num_hidden_layers,
        )

    def hidden(self, batch, length, seed=1):
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(batch, length, HIDDEN, generator=generator, dtype=torch.float64).to(self.dtype)


@pytest.fixture(
    scope="module",
    params=[(name, dtype) for name in CONFIGS for dtype in TOLERANCE],
    ids=lambda param: f"{param[0]}-{str(param[1]).removeprefix('torch.')}",
)
def case(request):
    """A tiny random model of each config, in float64 and float32, with every mixer parameter perturbed."""
    name, dtype = request.param
    model_type = _model_type(name)
    config = AutoConfig.for_model(model_type, **SMALL, **CONFIGS[name])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    mixer = model.model.layers[LAYER[model_type]].mamba
    with torch.no_grad():
        for parameter in mixer.parameters():  # norm weights (ones), D, dt_bias, biases: all take part
            parameter.add_(0.2 * torch.randn_like(parameter))
    return Case(model_type, config, mixer, PATHS[model_type], dtype, TOLERANCE[dtype])


def _stock_delta(model_type, mixer, hidden_states):
    """Δ as the stock mixer computes it in its own forward ([B, T, D] Mamba-1, [B, T, H] Mamba-2)."""
    seen = {}
    if model_type == "jamba":  # softplus(dt_proj(dt_layernorm(time_step))), read from the norm's output
        module = mixer.dt_layernorm
    else:  # clamp(softplus(dt + dt_bias)), dt from the µP-scaled projection
        module = mixer.in_proj
    handle = module.register_forward_hook(lambda m, args, out: seen.__setitem__("out", out))
    try:
        mixer(hidden_states)
    finally:
        handle.remove()
    if model_type == "jamba":
        return torch.nn.functional.softplus(mixer.dt_proj(seen["out"]))
    dt = (seen["out"] * mixer.mup_vector)[..., -mixer.num_heads :]
    delta = torch.nn.functional.softplus(dt + mixer.dt_bias)
    if mixer.time_step_limit is not None:
        delta = delta.clamp(*mixer.time_step_limit)
    return delta


@torch.no_grad()
def test_from_an_empty_state_it_is_the_stock_mixer(case):
    mixer, path, tol = case.mixer, case.path, case.tol
    hidden = case.hidden(2, 11)
    expected = mixer(hidden)
    ours = path(mixer, hidden, case.cache(), None)
    assert relative_error(ours, expected) < tol


@pytest.mark.parametrize("split", [1, 5, 10])
@torch.no_grad()
def test_prefix_then_suffix_is_the_whole_sequence(case, split):
    mixer, path, tol = case.mixer, case.path, case.tol
    hidden = case.hidden(2, 11)
    whole = path(mixer, hidden, case.cache(), None)
    assert relative_error(mixer(hidden[:, split:]), whole[:, split:]) > 1e-3  # the prefix matters
    cache = case.cache()
    first = path(mixer, hidden[:, :split], cache, None)
    rest = path(mixer, hidden[:, split:], cache, None)
    assert relative_error(torch.cat([first, rest], 1), whole) < tol
    # and the state after both is the state after the whole sequence
    reference = case.cache()
    path(mixer, hidden, reference, None)
    layer, expected = cache.layers[mixer.layer_idx], reference.layers[mixer.layer_idx]
    for name in ("ssm_state", "conv_state", "delta_sum"):
        assert relative_error(getattr(layer, name), getattr(expected, name)) < tol, name


@torch.no_grad()
def test_token_by_token_is_the_whole_sequence(case):
    mixer, path, tol = case.mixer, case.path, case.tol
    hidden = case.hidden(2, 9)
    whole = mixer(hidden)
    cache = case.cache()
    steps = [path(mixer, hidden[:, t : t + 1], cache, None) for t in range(hidden.shape[1])]
    assert relative_error(torch.cat(steps, 1), whole) < tol


@torch.no_grad()
def test_left_padding_is_inert(case):
    mixer, path, tol = case.mixer, case.path, case.tol
    lengths = [9, 4, 1]
    hidden = case.hidden(3, 9)  # padding positions hold random hidden states: the mask alone must silence them
    mask = torch.zeros(3, 9, dtype=case.dtype)
    for row, length in enumerate(lengths):
        mask[row, 9 - length :] = 1
    suffix = case.hidden(3, 3, seed=2)
    cache = case.cache()
    padded = path(mixer, hidden, cache, mask)
    continued = path(mixer, suffix, cache, None)
    for row, length in enumerate(lengths):
        alone_cache = case.cache()
        alone = path(mixer, hidden[row : row + 1, 9 - length :], alone_cache, None)
        alone_continued = path(mixer, suffix[row : row + 1], alone_cache, None)
        assert relative_error(padded[row : row + 1, 9 - length :], alone) < tol, row
        assert relative_error(continued[row : row + 1], alone_continued) < tol, row
        layer, expected = cache.layers[mixer.layer_idx], alone_cache.layers[mixer.layer_idx]
        for name in ("ssm_state", "conv_state", "delta_sum"):
            assert relative_error(getattr(layer, name)[row : row + 1], getattr(expected, name)) < tol, (row, name)


@torch.no_grad()
def test_delta_sum_is_the_stock_mixers_delta_over_real_tokens(case):
    mixer, path, tol = case.mixer, case.path, case.tol
    hidden = case.hidden(2, 10)
    mask = torch.ones(2, 10, dtype=case.dtype)
    mask[1, :4] = 0
    cache = case.cache()
    path(mixer, hidden, cache, mask)
    delta_sum = cache.layers[mixer.layer_idx].delta_sum
    whole = _stock_delta(case.model_type, mixer, hidden[:1]).sum(1)
    alone = _stock_delta(case.model_type, mixer, hidden[1:, 4:]).sum(1)
    assert relative_error(delta_sum, torch.cat([whole, alone])) < tol


@torch.no_grad()
def test_state_layer_shapes(case):
    mixer, path = case.mixer, case.path
    cache = case.cache()
    path(mixer, case.hidden(3, 5), cache, None)
    layer = cache.layers[mixer.layer_idx]
    assert [cache.layers[i].filled for i in range(case.config.num_hidden_layers)] == [
        i == mixer.layer_idx for i in range(case.config.num_hidden_layers)
    ]
    config = case.config
    if (
        case.model_type == "jamba"
    ):  # Mamba-1 layout: D = mamba_expand * hidden_size, N = mamba_d_state, K = mamba_d_conv
        inner = config.mamba_expand * config.hidden_size
        assert layer.ssm_state.shape == (3, inner, config.mamba_d_state)
        assert layer.conv_state.shape == (3, inner, config.mamba_d_conv)
        assert layer.delta_sum.shape == (3, inner)
        assert layer.A.shape == (inner, config.mamba_d_state)
    else:  # Mamba-2 layout: H = mamba_n_heads, P = mamba_d_head, conv channels = mamba_d_ssm + 2 G N
        heads = config.mamba_n_heads
        conv_dim = config.mamba_d_ssm + 2 * config.mamba_n_groups * config.mamba_d_state
        assert layer.ssm_state.shape == (3, heads, config.mamba_d_head, config.mamba_d_state)
        assert layer.conv_state.shape == (3, conv_dim, config.mamba_d_conv)
        assert layer.delta_sum.shape == (3, heads)
        assert layer.A.shape == (heads,)
    assert layer.ssm_state.dtype == layer.delta_sum.dtype == layer.A.dtype == torch.float32
    assert layer.conv_state.dtype == case.dtype


def test_gradients_are_the_stock_mixers(case):
    """Training through states (hf_statecompose.training) backpropagates through this path: its gradients with
    respect to every mixer parameter and the input are the stock forward's."""
    mixer, path = case.mixer, case.path
    hidden = case.hidden(2, 7).requires_grad_()
    weights = case.hidden(2, 7, seed=3)  # a loss that weighs every output differently
    parameters = [hidden, *mixer.parameters()]
    expected = torch.autograd.grad((mixer(hidden) * weights).sum(), parameters)
    ours = torch.autograd.grad((path(mixer, hidden, case.cache(), None) * weights).sum(), parameters, allow_unused=True)
    names = ["input", *(name for name, _ in mixer.named_parameters())]
    for name, gradient, reference in zip(names, ours, expected):
        assert gradient is not None, name
        assert relative_error(gradient, reference) < 10 * case.tol, name  # A, Δ in float32 as the stock mixers


def _model_with_our_mixers(name):
    """A tiny float32 model of ``name`` whose SSM mixers run our path on one ComposableMambaCache (attention keeps the
    model's own cache), each mixer given the 2D mask as the decoder layer gives it: as the lead's wiring will."""
    model_type = _model_type(name)
    config = AutoConfig.for_model(model_type, **SMALL, **CONFIGS[name])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    states = {}

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        length = hidden_states.shape[1]
        mask = None
        if attention_mask is not None and attention_mask.dim() == 2 and length > 1:
            mask = attention_mask[:, -length:].to(hidden_states.dtype)
        return PATHS[model_type](self, hidden_states, states["cache"], mask)

    mixers = [layer.mamba for layer in model.model.layers if hasattr(layer, "mamba")]
    with torch.no_grad():
        for mixer in mixers:
            for parameter in mixer.parameters():
                parameter.add_(0.2 * torch.randn_like(parameter))
    stock = model(torch.arange(3, 15)[None]).logits
    for mixer in mixers:
        mixer.forward = types.MethodType(forward, mixer)

    # hybrid models name their cache argument `cache` from transformers 5.24, `past_key_values` before
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(ids, mask=None, fresh=False):
        if fresh:
            architecture = "mamba" if model_type == "jamba" else "mamba2"
            states["cache"] = ComposableMambaCache(
                config,
                architecture=architecture,
                fingerprint="x",
                model_dtype=torch.float32,
                num_layers=config.num_hidden_layers,
            )
            states["kv"] = DynamicCache(config=config)
        positions = None if mask is None else (mask.cumsum(-1) - 1).clamp_min(0)[:, -ids.shape[1] :]
        return model(
            ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_name: states["kv"]}
        ).logits

    return stock, run


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_in_the_model_prefix_then_suffix_then_steps_is_the_whole_sequence(name):
    stock, run = _model_with_our_mixers(name)
    ids = torch.arange(3, 15)[None]
    assert relative_error(run(ids, fresh=True), stock) < 1e-4
    pieces = [run(ids[:, :5], fresh=True), run(ids[:, 5:9])] + [run(ids[:, t : t + 1]) for t in range(9, 12)]
    assert relative_error(torch.cat(pieces, 1), stock) < 1e-4


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_in_the_model_a_left_padded_row_is_that_row_alone(name):
    _, run = _model_with_our_mixers(name)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 64, (2, 8), generator=generator)
    suffix = torch.randint(3, 64, (2, 3), generator=generator)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    padded = run(ids, mask, fresh=True)
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
    continued = run(suffix, full_mask)
    for row, start in enumerate([0, 3]):
        alone = run(ids[row : row + 1, start:], fresh=True)
        alone_continued = run(suffix[row : row + 1])
        assert relative_error(padded[row, start:], alone[0]) < 1e-4, row
        assert relative_error(continued[row], alone_continued[0]) < 1e-4, row
