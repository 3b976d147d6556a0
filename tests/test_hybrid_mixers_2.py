"""The state-aware path of the Mamba-2 style mixers of the hybrid models Bamba, GraniteMoeHybrid, NemotronH and Zamba2.

Their stock mixers (``BambaMixer``, ``GraniteMoeHybridMambaLayer``, ``NemotronHMamba2Mixer``, ``Zamba2MambaMixer``) do
the maths of ``Mamba2Mixer`` (only their config field names and the time-step limit differ), so
:func:`hf_statecompose.models.mamba2.mamba2_mixer_forward` is their path. Per architecture, on the mixer of a tiny random
model: (a) the path from an empty state equals the stock mixer's forward; (b) a prefix then a continuation (several
tokens, or one at a time) equals the whole sequence, and the state equals the one transformers' own cache holds;
(c) left padding, with the mask the model hands its mixers, is inert; (d) ΣΔ is the sum of the stock mixer's Δ over
the real tokens; (e) the state tensors' shapes, as functions of the config fields.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from hf_statecompose import compat
from hf_statecompose.models.mamba2 import mamba2_mixer_forward
from hf_statecompose.state.cache import ComposableMambaCache

SMALL = dict(
    vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, pad_token_id=0
)
# tiny configs: 4 heads of 16, state 8, 2 groups (the gated norm is group-wise), conv kernel 4
CONFIGS = {
    "bamba": dict(
        num_hidden_layers=3,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
    ),
    "granitemoehybrid": dict(
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=2,
        mamba_chunk_size=16,
        num_local_experts=0,
        shared_intermediate_size=48,
        position_embedding_type=None,
        mamba_proj_bias=True,
    ),  # in_proj with a bias: padding reaches the conv as that bias
    "nemotron_h": dict(
        num_hidden_layers=4,
        hybrid_override_pattern="M*-M",
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        chunk_size=16,
    ),
    # use_conv_bias=False: Zamba2's conv keeps its bias whatever that flag says (and uses it)
    "zamba2": dict(
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        n_mamba_heads=4,
        mamba_d_state=8,
        mamba_ngroups=2,
        chunk_size=16,
        num_mem_blocks=1,
        attention_head_dim=16,
        use_conv_bias=False,
    ),
}
# the SSM layers' state shapes from the config fields: (heads H, head dim P, state N, groups G, conv kernel K, inner I)
SHAPE_FIELDS = {
    "bamba": lambda c: (
        c.mamba_n_heads,
        c.mamba_d_head,
        c.mamba_d_state,
        c.mamba_n_groups,
        c.mamba_d_conv,
        int(c.mamba_expand * c.hidden_size),
    ),
    "granitemoehybrid": lambda c: (
        c.mamba_n_heads,
        c.mamba_d_head,
        c.mamba_d_state,
        c.mamba_n_groups,
        c.mamba_d_conv,
        int(c.mamba_expand * c.hidden_size),
    ),
    "nemotron_h": lambda c: (
        c.mamba_num_heads,
        c.mamba_head_dim,
        c.ssm_state_size,
        c.n_groups,
        c.conv_kernel,
        c.mamba_num_heads * c.mamba_head_dim,
    ),
    "zamba2": lambda c: (
        c.n_mamba_heads,
        c.mamba_headdim,
        c.mamba_d_state,
        c.mamba_ngroups,
        c.mamba_d_conv,
        int(c.mamba_expand * c.hidden_size),
    ),
}
ARCHS = list(CONFIGS)


def ssm_mixers(model):
    """(model layer index, stock mixer) of every SSM layer, found as the lead's wiring finds them."""
    out = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "mamba_decoder"):  # Zamba2HybridLayer: shared attention block + its own Mamba layer
            layer = layer.mamba_decoder
        mixer = getattr(layer, "mamba", None)  # Bamba, GraniteMoeHybrid (None on attention layers), Zamba2
        if mixer is None and getattr(layer, "block_type", None) == "linear_attention":
            mixer = layer.mixer  # NemotronH
        if mixer is not None:
            out.append((i, mixer))
    return out


def _build(arch, dtype):
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **SMALL, **CONFIGS[arch])
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():
        for _, mixer in ssm_mixers(model):
            # move every parameter off its tidy init (A_log = log(1..H), D = 1, dt_bias = 1, norm weight 1, ...)
            for parameter in mixer.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.2)
            # one head whose Δ sits on the lower time-step limit (NemotronH / Zamba2: time_step_min) for most tokens
            mixer.dt_bias[0] = -8.0
    return config, model


@pytest.fixture(scope="module", params=ARCHS)
def built(request):
    arch = request.param
    return arch, {dtype: _build(arch, dtype) for dtype in (torch.float32, torch.float64)}


def new_cache(config, dtype):
    return ComposableMambaCache(
        config, architecture="mamba2", fingerprint="x", model_dtype=dtype, num_layers=config.num_hidden_layers
    )


def stock_delta(mixer, hidden_states):
    """Δ [B, T, H] as the stock mixer computes it: clamp(softplus(dt + dt_bias), *time_step_limit)."""
    dt = mixer.in_proj(hidden_states)[..., -mixer.num_heads :]
    dt = torch.nn.functional.softplus(dt + mixer.dt_bias)
    return torch.clamp(dt, *mixer.time_step_limit)


# float64 models: the cache keeps SSM states and ΣΔ in float32 and the gated norm runs in float32 (as the stock
# norm does), so our path against itself agrees to float32 rounding, not float64's
TIGHT = 1e-6


def close(actual, expected, tol):
    assert actual.shape == expected.shape
    err = float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
    assert err < tol, err


@torch.no_grad()
def test_empty_state_equals_stock_forward(built):
    _arch, models = built
    config, model = models[torch.float32]
    torch.manual_seed(1)
    hidden = torch.randn(2, 37, config.hidden_size)  # > 2 chunks of the stock scan
    for layer_idx, mixer in ssm_mixers(model):
        assert mixer.layer_idx == layer_idx
        cache = new_cache(config, torch.float32)
        close(mamba2_mixer_forward(mixer, hidden, cache, None), mixer(hidden), 2e-5)
        # and the state is the one transformers' own cache holds after the same forward
        stock_cache = DynamicCache(config=config)
        mixer(hidden, **compat.cache_kwargs(stock_cache))
        layer = cache.layers[layer_idx]
        close(layer.ssm_state, stock_cache.get_recurrent_state(layer_idx, state_idx=0), 2e-5)
        close(layer.conv_state, stock_cache.get_conv_state(layer_idx, state_idx=0), 1e-6)


@torch.no_grad()
def test_continuation_equals_whole_sequence(built):
    _arch, models = built
    config, model = models[torch.float64]
    torch.manual_seed(2)
    hidden = torch.randn(2, 29, config.hidden_size, dtype=torch.float64)
    for layer_idx, mixer in ssm_mixers(model):
        whole_cache = new_cache(config, torch.float64)
        whole = mamba2_mixer_forward(mixer, hidden, whole_cache, None)
        for cuts in ([11], [11, 12, 13, 14, 15], [2, 3, 20]):  # a multi-token suffix; single-token steps; both
            cache = new_cache(config, torch.float64)
            pieces = [
                mamba2_mixer_forward(mixer, part, cache, None) for part in torch.tensor_split(hidden, cuts, dim=1)
            ]
            close(torch.cat(pieces, dim=1), whole, TIGHT)
            for name in ("ssm_state", "conv_state", "delta_sum"):
                close(getattr(cache.layers[layer_idx], name), getattr(whole_cache.layers[layer_idx], name), TIGHT)
        # the check can fail: the suffix from an empty state is not the whole sequence's suffix
        fresh = mamba2_mixer_forward(mixer, hidden[:, 11:], new_cache(config, torch.float64), None)
        assert (fresh - whole[:, 11:]).abs().max() > 1e-3


def _first_mixer_inputs(model, input_ids, attention_mask):
    """(hidden states, attention mask) the model hands its first SSM mixer."""
    layer_idx, mixer = ssm_mixers(model)[0]
    seen = {}

    def hook(module, args, kwargs):
        seen["hidden"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["mask"] = kwargs.get("attention_mask")

    handle = mixer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        handle.remove()
    return layer_idx, mixer, seen["hidden"], seen["mask"]


@torch.no_grad()
def test_left_padding_is_inert(built):
    _arch, models = built
    config, model = models[torch.float64]
    torch.manual_seed(3)
    pads, length = [0, 6], 19
    ids = torch.randint(3, 64, (2, length))
    attention_mask = torch.ones(2, length, dtype=torch.long)
    for row, pad in enumerate(pads):
        ids[row, :pad], attention_mask[row, :pad] = 0, 0
    layer_idx, mixer, hidden, mask = _first_mixer_inputs(model, ids, attention_mask)
    assert mask is not None and mask.shape == (2, length)  # the trailing T positions of the 2D mask
    mask = mask.to(hidden.dtype)
    hidden = hidden.clone()
    hidden[1, : pads[1]] = torch.randn(pads[1], config.hidden_size, dtype=hidden.dtype)  # whatever padding holds
    suffix = torch.randn(2, 5, config.hidden_size, dtype=hidden.dtype)

    cache = new_cache(config, torch.float64)
    batch_out = mamba2_mixer_forward(mixer, hidden, cache, mask)
    batch_next = mamba2_mixer_forward(mixer, suffix, cache, None)
    batch_state = cache.layers[layer_idx]
    for row, pad in enumerate(pads):
        alone_cache = new_cache(config, torch.float64)
        alone = mamba2_mixer_forward(mixer, hidden[row : row + 1, pad:], alone_cache, None)
        alone_next = mamba2_mixer_forward(mixer, suffix[row : row + 1], alone_cache, None)
        close(batch_out[row : row + 1, pad:], alone, TIGHT)
        close(batch_next[row : row + 1], alone_next, TIGHT)
        for name in ("ssm_state", "conv_state", "delta_sum"):
            close(getattr(batch_state, name)[row : row + 1], getattr(alone_cache.layers[layer_idx], name), TIGHT)
    # the check can fail: without the mask the padding feeds the padded row's state
    unmasked = new_cache(config, torch.float64)
    mamba2_mixer_forward(mixer, hidden, unmasked, None)
    assert (unmasked.layers[layer_idx].ssm_state[1] - batch_state.ssm_state[1]).abs().max() > 1e-3


@torch.no_grad()
def test_delta_sum_is_the_stock_time_steps_over_real_tokens(built):
    _arch, models = built
    config, model = models[torch.float32]
    torch.manual_seed(4)
    hidden = torch.randn(2, 23, config.hidden_size)
    mask = torch.ones(2, 23)
    mask[1, :7] = 0
    for layer_idx, mixer in ssm_mixers(model):
        cache = new_cache(config, torch.float32)
        mamba2_mixer_forward(mixer, hidden, cache, mask)
        delta = stock_delta(mixer, hidden)  # [B, T, H]
        expected = (delta * mask[:, :, None]).sum(1)
        close(cache.layers[layer_idx].delta_sum, expected, 1e-5)
        # head 0 sits on the lower limit for most tokens: NemotronH / Zamba2 clamp it to time_step_min
        low = mixer.time_step_limit[0]
        if low > 0:
            assert bool((delta[..., 0] == low).float().mean() > 0.5)
        # the check can fail: counting the padded positions gives another ΣΔ
        assert (delta.sum(1) - cache.layers[layer_idx].delta_sum).abs().max() > 1e-3


@torch.no_grad()
def test_state_shapes_from_config(built):
    arch, models = built
    config, model = models[torch.float32]
    heads, head_dim, state, groups, kernel, inner = SHAPE_FIELDS[arch](config)
    conv_dim = inner + 2 * groups * state
    assert inner == heads * head_dim
    hidden = torch.randn(3, 5, config.hidden_size)
    cache = new_cache(config, torch.float32)
    mixers = ssm_mixers(model)
    assert len(mixers) >= 2
    for layer_idx, mixer in mixers:
        mamba2_mixer_forward(mixer, hidden, cache, None)
        layer = cache.layers[layer_idx]
        assert layer.ssm_state.shape == (3, heads, head_dim, state) and layer.ssm_state.dtype == torch.float32
        assert layer.conv_state.shape == (3, conv_dim, kernel)
        assert layer.delta_sum.shape == (3, heads)
        assert layer.A.shape == (heads,)
        torch.testing.assert_close(layer.A, -torch.exp(mixer.A_log.float()))
    # the SSM layers are the model layers whose type is linear attention (Zamba2: every layer holds a Mamba mixer)
    expected = [i for i, kind in enumerate(config.layer_types) if kind != "full_attention" and kind != "mlp"]
    if arch == "zamba2":
        expected = list(range(config.num_hidden_layers))
    assert [i for i, _ in mixers] == expected
    assert all(cache.layers[i].filled == (i in expected) for i in range(config.num_hidden_layers))
