"""Composing hybrid states (issue 22): the attention layers' placement (``concat`` with RoPE re-rotation, ``shared``,
``none``), order invariance without positional encoding, the model-based baselines, and the refusals.

Tiny random float64 hybrids (:mod:`architectures`), every supported hybrid architecture.
"""

import itertools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Mamba2Config, Mamba2ForCausalLM

import hf_statecompose as hsc
from hf_statecompose import StateComposer, compat
from hf_statecompose.state.architectures import architecture

from architectures import HYBRID_CONFIGS as CONFIGS
from architectures import VOCAB, arch_params, hybrid_model, ids, left_pad
from helpers import relative_error

TOL64 = 1e-6  # relative, logits of float64 models (the SSM states are float32)


def encode_all(model, lengths, seed=0):
    contexts = [ids(n, seed=seed + k) for k, n in enumerate(lengths)]
    return contexts, [hsc.encode(model, c) for c in contexts]


def capture_backbone_inputs(model):
    """A forward pre-hook on the backbone that records the keyword arguments of its calls (position_ids, mask)."""
    calls = []
    handle = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True
    )
    return calls, handle


# ------------------------------------------------------------------------------------- (a) NoPE: order invariance
NOPE = {
    "nemotron_h": {},
    "granitemoehybrid": {"position_embedding_type": None},
    "zamba2": {"use_mem_rope": False},
    "jamba": {},
}


@pytest.mark.parametrize("arch", arch_params(NOPE))
@torch.no_grad()
def test_picaso_s_is_invariant_to_the_order_of_the_states_without_positional_encoding(arch):
    """Attention without positional encoding reads the union of keys and values, whatever their order, and
    PICASO-S is symmetric in its states: the logits of all 6 orders of 3 states agree to float rounding. CASO (order
    dependent) on the same states and query does not, so the comparison can fail."""
    model = hybrid_model(arch, **NOPE[arch])
    assert architecture(arch).rotary_dims(model.config) == 0
    _, states = encode_all(model, (5, 9, 7), seed=10)
    query = ids(4, seed=20)

    def logits(order, method):
        return model(query, past_states=[states[i] for i in order], composition=StateComposer(method)).logits

    reference = logits((0, 1, 2), "picaso_s")
    for order in itertools.permutations(range(3)):
        assert relative_error(logits(order, "picaso_s"), reference) < TOL64, order
    caso = logits((0, 1, 2), "caso")
    assert max(relative_error(logits(order, "caso"), caso) for order in itertools.permutations(range(3))) > 1e-3


@pytest.mark.parametrize("arch", ["bamba", "zamba2"])
@torch.no_grad()
def test_with_rope_only_the_shared_placement_is_order_free(arch):
    """With RoPE the ``concat`` placement puts the keys at order-dependent positions, so PICASO-S alone does not make
    the logits order-free; the ``shared`` placement (every context at its own positions) does."""
    model = hybrid_model(arch)
    assert architecture(arch).rotary_dims(model.config) > 0
    with torch.no_grad():  # sharper attention than a random init's near-uniform one, so that key positions matter
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(4.0)
    _, states = encode_all(model, (5, 9, 7), seed=10)
    query = ids(4, seed=20)

    def logits(order, placement):
        composer = StateComposer("picaso_s", attention=placement)
        return model(query, past_states=[states[i] for i in order], composition=composer).logits

    orders = list(itertools.permutations(range(3)))
    concat = max(relative_error(logits(order, "concat"), logits(orders[0], "concat")) for order in orders)
    shared = max(relative_error(logits(order, "shared"), logits(orders[0], "shared")) for order in orders)
    assert concat > 1e-5  # measured 6e-4 (Bamba), 8e-5 (Zamba2)
    assert shared < TOL64  # measured 0


# ------------------------------------------------------------------------------------- (b) RoPE: re-rotated keys
# the attention layer first, so that its keys depend only on the tokens and their positions
ROPE_FIRST = {
    "bamba": dict(attn_layer_indices=[0]),  # partial RoPE: half of each head's dims rotate
    "granitemoehybrid": dict(layer_types=["attention", "mamba", "mamba"], position_embedding_type="rope"),
    "falcon_h1": {},  # every layer has both parts: layer 0's attention reads the embeddings
    "zamba2": dict(
        layers_block_type=["hybrid", "mamba", "mamba", "hybrid"]
    ),  # the shared block reads [embeddings, embeddings]
}


@pytest.mark.parametrize("arch", list(ROPE_FIRST))
@pytest.mark.parametrize("with_model", [False, True], ids=["config_rope", "model_rope"])
@torch.no_grad()
def test_concat_placement_rerotates_keys_to_the_concatenations(arch, with_model):
    model = hybrid_model(arch, **ROPE_FIRST[arch])
    layout = architecture(arch)
    assert layout.attention_layer_indices(model.config)[0] == 0
    rotary = layout.rotary_dims(model.config)
    head_dim = layout.attention_shape(model.config)[1]
    assert 0 < rotary <= head_dim and (rotary < head_dim) == (arch == "bamba")
    (c1, c2), (s1, s2) = encode_all(model, (6, 9), seed=30)
    whole = hsc.encode(model, torch.cat([c1, c2], 1)).layers[0]
    composed = StateComposer("picaso_r").compose([s1, s2], model=model if with_model else None).layers[0]
    assert composed.positions.tolist() == [list(range(15))]
    torch.testing.assert_close(composed.keys[:, :, :6], whole.keys[:, :, :6], rtol=0, atol=1e-12)
    # to float32 rounding: transformers computes the RoPE tables (cos, sin) in float32, the re-rotation is float64
    assert relative_error(composed.keys[:, :, 6:], whole.keys[:, :, 6:]) < 1e-6  # measured <= 1.0e-7
    torch.testing.assert_close(composed.values, whole.values, rtol=0, atol=1e-12)
    # without the re-rotation, state 2's keys (rotated to 0..8) are not the concatenation's (rotated to 6..14): only
    # the dims RoPE leaves alone agree
    raw = s2.layers[0].keys
    assert relative_error(raw[..., :rotary], whole.keys[:, :, 6:, :rotary]) > 1e-2
    torch.testing.assert_close(raw[..., rotary:], whole.keys[:, :, 6:, rotary:], rtol=0, atol=1e-12)


@pytest.mark.parametrize("placement", ["concat", "shared"])
@pytest.mark.parametrize("arch", arch_params(("bamba", "zamba2", "nemotron_h", "falcon_h1")))
@torch.no_grad()
def test_left_padded_batch_states_compose_as_their_rows_alone(arch, placement):
    """Composing batch states whose rows are left padded: each state's padding leaves the middle of the composed keys
    (which stay left padded per row), so every row's logits are those of its rows composed alone."""
    model = hybrid_model(arch)
    first, first_mask = left_pad([ids(3, seed=80)[0], ids(7, seed=81)[0]])
    second, second_mask = left_pad([ids(5, seed=82)[0], ids(2, seed=83)[0]])
    states = [
        hsc.encode(model, first, attention_mask=first_mask),
        hsc.encode(model, second, attention_mask=second_mask),
    ]
    composer = StateComposer("picaso_r", attention=placement)
    composed = composer.compose(states, model=model)
    real = composed.key_mask
    assert real.tolist() == [[False] + [True] * 8, [True] * 9]  # 3 + 5 and 7 + 2 keys, left padded
    queries, mask = left_pad([ids(4, seed=84)[0], ids(2, seed=85)[0]])
    logits = model(queries, attention_mask=mask, past_states=states, composition=composer).logits
    for r, length in enumerate((4, 2)):
        alone = model(
            queries[r : r + 1, -length:], past_states=[s.select(r) for s in states], composition=composer
        ).logits
        assert relative_error(logits[r, -length:], alone[0]) < TOL64, r


# ------------------------------------------------------------------------------------- (c) shared placement
@torch.no_grad()
def test_shared_placement_keeps_each_context_at_its_own_positions():
    model = hybrid_model("bamba")
    _, states = encode_all(model, (5, 9, 7), seed=40)
    composed = StateComposer("picaso_r", attention="shared").compose(states, model=model)
    for layer in composed.attention_layers:
        assert layer.positions.tolist() == [list(range(5)) + list(range(9)) + list(range(7))]
        # keys not moved: each state's own
        assert torch.equal(layer.keys, torch.cat([s.attention_layers[0].keys for s in states], -2))
    queries, mask = left_pad([ids(4, seed=41)[0], ids(2, seed=42)[0]])
    calls, handle = capture_backbone_inputs(model)
    try:
        model(
            queries, attention_mask=mask, past_states=states, composition=StateComposer("picaso_r", attention="shared")
        )
        model(queries, attention_mask=mask, past_states=states)  # concat placement, for contrast
    finally:
        handle.remove()
    shared, concat = calls
    # the query starts after the longest context (9), its padding masked; all 21 keys are real
    assert shared["position_ids"].tolist() == [[9, 10, 11, 12], [0, 0, 9, 10]]
    assert concat["position_ids"].tolist() == [[21, 22, 23, 24], [0, 0, 21, 22]]
    assert shared["attention_mask"].tolist() == [[1] * 25, [1] * 21 + [0, 0, 1, 1]]
    # generation's one-token steps go on from there (rows at 13 / 11, then 14 / 12), under every placement
    model.generation_config.eos_token_id = None
    for placement, first in (("shared", (13, 11)), ("concat", (25, 23)), ("none", (4, 2))):
        calls, handle = capture_backbone_inputs(model)
        try:
            model.generate(
                queries,
                attention_mask=mask,
                past_states=states,
                max_new_tokens=3,
                do_sample=False,
                composition=StateComposer("picaso_r", attention=placement),
            )
        finally:
            handle.remove()
        steps = [call["position_ids"].tolist() for call in calls[1:]]
        assert steps == [[[first[0]], [first[1]]], [[first[0] + 1], [first[1] + 1]]], placement


# ------------------------------------------------------------------------------------- (d) no keys
def ssm_only(composed, model):
    """A fresh, empty state of ``model`` holding copies of the SSM layers of ``composed`` and no keys."""
    manual = hsc.ComposableMambaCache.empty_for(model)
    for v in range(composed.num_layers):
        manual.set_layer(
            v,
            ssm_state=composed.ssm_states[v].clone(),
            conv_state=composed.conv_states[v].clone(),
            delta_sum=composed.delta_sums[v].clone(),
            A=composed.A[v],
        )
    manual.num_tokens = composed.num_tokens.clone()
    assert not any(layer.has_keys for layer in manual.attention_layers)
    return manual


@pytest.mark.parametrize("arch", arch_params())
@torch.no_grad()
def test_none_placement_equals_the_ssm_state_without_keys(arch):
    """``attention="none"``: the attention layers see only the query. Built by hand: an empty state of the model with
    the SSM layers of the composed state (no keys), run by the stock forward with the query's own mask and positions."""
    model = hybrid_model(arch)
    _, states = encode_all(model, (6, 8), seed=50)
    query = ids(5, seed=51)
    ours = model(query, past_states=states, composition=StateComposer("picaso_r", attention="none")).logits
    with_keys = model(query, past_states=states, composition=StateComposer("picaso_r")).logits
    assert relative_error(with_keys, ours) > 1e-4  # the keys matter (Zamba2's shared block least: 2.5e-4)
    composed = StateComposer("picaso_r").compose(states, model=model)
    expected = model(
        query,
        attention_mask=torch.ones_like(query),
        position_ids=torch.arange(5)[None],
        use_cache=True,
        **compat.cache_kwargs(ssm_only(composed, model), hybrid=True),
    ).logits
    assert relative_error(ours, expected) < TOL64
    # and generation: the query's keys, then each new token's, are all the attention layers see
    model.generation_config.eos_token_id = None
    generated = model.generate(
        query,
        past_states=states,
        composition=StateComposer("picaso_r", attention="none"),
        max_new_tokens=6,
        do_sample=False,
    )
    expected = model.generate(
        query,
        attention_mask=torch.ones_like(query),
        max_new_tokens=6,
        do_sample=False,
        use_cache=True,
        **compat.cache_kwargs(ssm_only(composed, model), hybrid=True),
    )
    assert torch.equal(generated, expected)


# ------------------------------------------------------------------------------------- (e) model-based baselines
@pytest.mark.parametrize("arch", arch_params())
@torch.no_grad()
def test_concat_and_piconcat_r_re_encode_the_concatenation(arch):
    model = hybrid_model(arch)
    model.generation_config.eos_token_id = None
    contexts, states = encode_all(model, (5, 8, 6), seed=60)
    whole = hsc.encode(model, torch.cat(contexts, 1))
    concat = StateComposer("concat").compose(states, model=model)
    # (to float64 rounding, not bit for bit: the re-encoding passes an all-ones mask, which takes other kernels)
    for v in range(whole.num_layers):
        for name in ("ssm_states", "conv_states", "delta_sums"):
            torch.testing.assert_close(getattr(concat, name)[v], getattr(whole, name)[v], rtol=1e-12, atol=1e-12)
    for got, want in zip(concat.attention_layers, whole.attention_layers):
        assert torch.equal(got.positions, want.positions)
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.values, want.values, rtol=1e-12, atol=1e-12)
    query = ids(4, seed=61)
    full = torch.cat(contexts + [query], 1)
    expected = model.generate(full, max_new_tokens=8, do_sample=False)[:, full.shape[1] :]
    ours = model.generate(query, past_states=states, composition="concat", max_new_tokens=8, do_sample=False)
    assert torch.equal(ours[:, 4:], expected)
    without_first = model(query, past_states=states[1:], composition="concat").logits
    assert relative_error(without_first, model(query, past_states=states, composition="concat").logits) > 1e-4
    # piconcat_r: the SSM layers are the mean over the 3 rotations' encodings, the keys those of the list order
    piconcat = StateComposer("piconcat_r").compose(states, model=model)
    rotations = [hsc.encode(model, torch.cat(contexts[k:] + contexts[:k], 1)) for k in range(3)]
    for v in range(whole.num_layers):
        for name in ("ssm_states", "conv_states", "delta_sums"):
            mean = torch.stack([getattr(r, name)[v].float() for r in rotations]).mean(0)
            torch.testing.assert_close(getattr(piconcat, name)[v].float(), mean, rtol=1e-6, atol=1e-7)
    for got, want in zip(piconcat.attention_layers, whole.attention_layers):
        assert torch.equal(got.positions, want.positions)
        torch.testing.assert_close(got.keys, want.keys, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def bamba_state():
    model = hybrid_model("bamba")
    return hsc.encode(model, ids(6, seed=70))


@pytest.mark.parametrize("bare", [False, True], ids=["ForCausalLM", "Model"])
@pytest.mark.parametrize("arch", list(CONFIGS))
@torch.no_grad()
def test_never_enabled_hybrids_refuse_past_states(arch, bare, bamba_state):
    model = hybrid_model(arch, enable=False, bare=bare)
    assert not hsc.is_enabled(model)
    query = ids(3, seed=71)
    with pytest.raises(ValueError, match=r"past_states needs hf_statecompose.enable\(model\) first"):
        model(query, past_states=[bamba_state])
    if not bare:
        with pytest.raises(ValueError, match=r"enable\(model\) first"):
            model.generate(query, past_states=[bamba_state], max_new_tokens=2)


@torch.no_grad()
def test_encode_does_not_enable_and_the_stock_model_still_refuses():
    model = hybrid_model("bamba", enable=False)
    state = hsc.encode(model, ids(6, seed=72))
    assert not hsc.is_enabled(model)
    with pytest.raises(ValueError, match="enable"):
        model.generate(ids(3, seed=73), past_states=[state], max_new_tokens=2)


REFUSED = {
    "bailing_hybrid": (
        dict(
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "dense"],
            pad_token_id=0,
            head_dim=8,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
        "interleaved RoPE",
    ),
    "lfm2": (dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]), "short gated convolutions"),
}


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_linear_attention_hybrids_not_supported_are_refused(model_type):
    fields, reason = REFUSED[model_type]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        **fields,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(TypeError, match=f"does not compose '{model_type}' states: .*{reason}"):
        hsc.enable(model)
    with pytest.raises(TypeError, match=f"does not compose '{model_type}' states: .*{reason}"):
        hsc.encode(model, ids(5))
    assert not hsc.is_enabled(model)


@torch.no_grad()
def test_states_of_another_hybrid_are_refused(bamba_state):
    for arch in ("nemotron_h", "granitemoehybrid", "zamba2"):
        model = hybrid_model(arch)
        with pytest.raises(
            ValueError, match=rf"past_states\[0\] is a state of a 'bamba' model .* this model is '{arch}'"
        ):
            model(ids(3, seed=74), past_states=[bamba_state])
    # the same architecture with other weights too
    other = hybrid_model("bamba", seed=1)
    with pytest.raises(ValueError, match=r"past_states\[0\] was encoded by bamba model .* re-encode the contexts"):
        other(ids(3, seed=74), past_states=[bamba_state])


@torch.no_grad()
def test_a_hybrid_state_and_a_mamba2_state_in_one_list_are_refused(bamba_state):
    torch.manual_seed(0)
    mamba2 = hsc.enable(
        Mamba2ForCausalLM(
            Mamba2Config(
                vocab_size=VOCAB,
                hidden_size=32,
                state_size=8,
                num_hidden_layers=2,
                expand=2,
                num_heads=8,
                head_dim=8,
                n_groups=1,
                chunk_size=16,
            )
        )
        .double()
        .eval()
    )
    mamba2_state = hsc.encode(mamba2, ids(6, seed=75))
    model = hybrid_model("bamba")
    query = ids(3, seed=76)
    with pytest.raises(ValueError, match=r"past_states\[1\] is a state of a 'mamba2' model .* this model is 'bamba'"):
        model(query, past_states=[bamba_state, mamba2_state])
    with pytest.raises(ValueError, match=r"past_states\[1\]\[0\] is a state of a 'mamba2' model"):
        model(torch.cat([query, query]), past_states=[[bamba_state], [mamba2_state]])
    with pytest.raises(ValueError, match=r"past_states\[1\] is a state of a 'bamba' model .* this model is 'mamba2'"):
        mamba2(query, past_states=[mamba2_state, bamba_state])
    for states, odd in (
        ([bamba_state, mamba2_state], "a 'mamba2' model"),
        ([mamba2_state, bamba_state], "a 'bamba' model"),
    ):
        with pytest.raises(ValueError, match=rf"states\[1\] was encoded by a different model \({odd}"):
            StateComposer("picaso_r").compose(states)
