"""Delta-rule hybrids (gated DeltaNet layers + attention: Qwen3.5, Qwen3-Next, Olmo-Hybrid) end to end: the state
path against the stock mixers, the affine identity S_AB = M_B S_A + S_B on real encodings, the compositions where
they are exact (the first layer of a model whose conv window is one token: no context reaches another's layer
input), the stores' transitions, and the refusals.

The exactness of one state + query against context + query (greedy, sampling, beams, padded batches, per-row lists)
is the hybrid suites' (tests/test_hybrid_exactness.py, test_state_contract.py, test_model_contract.py, which run
these architectures from tests/architectures.py's ``DELTA_RULE_CONFIGS``)."""

import itertools

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import StateComposer, compat
from hf_statecompose.ops.delta_rule import MAX_ALL_ORDERS
from hf_statecompose.store import StateStore

from architectures import DELTA_RULE_CONFIGS, DELTA_RULE_MOE, EOS, hybrid_model, ids, tiny_hybrid
from helpers import relative_error
from store_helpers import TEXTS, BagOfWords, CharTokenizer

ARCHS = list(DELTA_RULE_CONFIGS)


def _model(arch, **overrides):
    return hybrid_model(arch, dtype=torch.float32, **overrides)


@pytest.fixture(scope="module", params=ARCHS)
def one_token_conv(request):
    """A float32 model whose conv window is one token (kernel 1): at its first layer (a GDN layer fed by the
    embeddings) no token of one context reaches another's layer input, so compositions there are exact."""
    return _model(request.param, linear_conv_kernel_dim=1)


def _layer0(state):
    return state.ssm_states[0], state.transitions[0]


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_encoded_state_equals_the_stock_models_cache(arch):
    """Our encode and the stock model's own prefill (its cache) hold the same recurrent state in every GDN layer."""
    model = _model(arch)
    context = ids(37, seed=1)
    state = hsc.encode(model, context)
    stock = hybrid_model(arch, dtype=torch.float32, enable=False)
    out = stock(context, use_cache=True)
    cache = compat.output_cache(out) or out.past_key_values
    for v, layer in enumerate(state.ssm_layer_indices):
        theirs = cache.layers[layer].recurrent_states[0]
        assert relative_error(state.ssm_states[v], theirs) < 1e-5, v
    # and the context matters to the state: another context gives another state
    other = hsc.encode(model, ids(37, seed=2))
    assert relative_error(other.ssm_states[0], state.ssm_states[0]) > 1e-2


@torch.no_grad()
def test_affine_identity_on_real_encodings(one_token_conv):
    """Encoding A then B is M_B S_A + S_B (and M_AB = M_B M_A): at the first layer with a one-token conv window, and
    in every layer when B continues A's state (a forward over B with A's state as the cache)."""
    model = one_token_conv
    a, b = ids(9, seed=3), ids(12, seed=4)
    sa, sb, sab = hsc.encode(model, a), hsc.encode(model, b), hsc.encode(model, torch.cat([a, b], 1))
    (s_a, m_a), (s_b, m_b), (s_ab, m_ab) = _layer0(sa), _layer0(sb), _layer0(sab)
    assert relative_error(m_b @ s_a + s_b, s_ab) < 1e-5
    assert relative_error(m_b @ m_a, m_ab) < 1e-5
    assert relative_error(s_b, s_ab) > 1e-2  # A's context reaches the state through M_B
    continued = sa.clone()
    model(b, **compat.cache_kwargs(continued, hybrid=True), use_cache=True)
    for v in range(sab.num_layers):
        assert relative_error(continued.ssm_states[v], sab.ssm_states[v]) < 1e-5, v
        assert relative_error(continued.transitions[v], sab.transitions[v]) < 1e-5, v


@torch.no_grad()
def test_compositions_are_exact_at_the_first_layer(one_token_conv):
    """caso is the list-order concatenation; picaso_r the mean of the rotations' concatenations; picaso_s the mean of
    all 3! orders' concatenations: states and transitions, at the first layer."""
    model = one_token_conv
    contexts = [ids(n, seed=10 + n) for n in (7, 11, 5)]
    states = [hsc.encode(model, c) for c in contexts]

    def concatenated(order):
        return _layer0(hsc.encode(model, torch.cat([contexts[i] for i in order], 1)))

    def mean(orders):
        pairs = [concatenated(o) for o in orders]
        return torch.stack([s for s, _ in pairs]).mean(0), torch.stack([m for _, m in pairs]).mean(0)

    expected = {
        "caso": concatenated((0, 1, 2)),
        "picaso_r": mean([(0, 1, 2), (1, 2, 0), (2, 0, 1)]),
        "picaso_s": mean(itertools.permutations(range(3))),
    }
    for method, (state, transition) in expected.items():
        composed = StateComposer(method).compose(states)
        assert relative_error(composed.ssm_states[0], state) < 1e-5, method
        assert relative_error(composed.transitions[0], transition) < 1e-5, method
    # the three differ (the orders matter), so each test above tells them apart
    assert relative_error(expected["caso"][0], expected["picaso_s"][0]) > 1e-3
    assert relative_error(expected["picaso_r"][0], expected["picaso_s"][0]) > 1e-4


@torch.no_grad()
def test_caso_conv_window_is_the_last_contexts():
    model = _model("qwen3_5_text")
    contexts = [ids(n, seed=20 + n) for n in (6, 8)]
    composed = StateComposer("caso").compose([hsc.encode(model, c) for c in contexts])
    concat = hsc.encode(model, torch.cat(contexts, 1))
    assert torch.equal(composed.conv_states[0], concat.conv_states[0])  # the first layer's window: B's last tokens


def _state(arch="qwen3_5_text", length=6, seed=30):
    model = _model(arch)
    return model, hsc.encode(model, ids(length, seed=seed))


@torch.no_grad()
@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m * 1.5 + 0.5, "transition .* has spectral norm"),
        (lambda m: m.masked_fill(torch.rand_like(m) < 0.1, float("nan")), "transition contains NaN"),
        (lambda m: m[..., :-1], "transition has shape"),
        (lambda m: m.double(), "transition is torch.float64"),
        (lambda m: None, "transition is missing"),
    ],
)
def test_crafted_transitions_are_refused(edit, message):
    model, state = _state()
    state.transitions[1] = edit(state.transitions[1])
    with pytest.raises(ValueError, match=message):
        model.generate(ids(3, seed=31), past_states=[state], max_new_tokens=2)
    with pytest.raises(ValueError, match=message):
        StateComposer("caso").compose([state, state])


@torch.no_grad()
def test_picaso_s_beyond_its_limit_is_refused_naming_picaso_r():
    _, state = _state(length=3)
    with pytest.raises(ValueError, match=r"picaso_s over 13 delta-rule states .* method='picaso_r'"):
        StateComposer("picaso_s").compose([state] * (MAX_ALL_ORDERS + 1))
    StateComposer("picaso_r").compose([state] * (MAX_ALL_ORDERS + 1))  # linear in n: no limit


@torch.no_grad()
def test_picaso_s_too_costly_for_the_model_is_refused(monkeypatch):
    from hf_statecompose.composition import composer

    _, state = _state(length=3)
    StateComposer("picaso_s").compose([state] * 4)
    # per layer and head 8 x 8 @ 8 x 16: 4 states take 4·2^3 = 32 products of 1024 multiply-adds x 4 heads x 3 layers
    monkeypatch.setattr(composer, "DELTA_PICASO_S_MAX_MULTIPLY_ADDS", 32 * 1024 * 4 * 3 - 1)
    with pytest.raises(ValueError, match=r"needs 3.9e\+05 multiply-adds .* DELTA_PICASO_S_MAX_MULTIPLY_ADDS"):
        StateComposer("picaso_s").compose([state] * 4)
    monkeypatch.setattr(composer, "DELTA_PICASO_S_MAX_MULTIPLY_ADDS", 32 * 1024 * 4 * 3)
    StateComposer("picaso_s").compose([state] * 4)


@torch.no_grad()
def test_a_state_of_another_delta_rule_model_is_refused():
    _, state = _state("qwen3_5_text")
    other = _model("qwen3_next")
    with pytest.raises(ValueError, match="is a state of a 'qwen3_5_text' model"):
        other.generate(ids(3, seed=31), past_states=[state], max_new_tokens=2)


@pytest.mark.parametrize("backend", ["folder", "lance"])
def test_a_bf16_store_keeps_the_transitions_in_bf16(backend, tmp_path):
    """A bf16 store keeps M in bf16 beside the state (half the bytes); read back, M is float32 within bf16 rounding,
    and a state read from an fp32 store is the encoded one bit for bit."""
    if backend == "lance":
        pytest.importorskip("lancedb")
    model = tiny_hybrid("qwen3_5_text")
    with torch.no_grad():  # slow decays: with the stock init (A up to 16) M underflows to 0 within the context
        for block in model.model.layers:
            if hasattr(block, "linear_attn"):
                block.linear_attn.A_log.fill_(-3.0)
    for dtype, tolerance in (("bf16", 1e-2), ("fp32", 0.0)):
        store = StateStore(str(tmp_path / dtype), model, CharTokenizer(), retriever=BagOfWords(), backend=backend,
                           storage_dtype=dtype)  # fmt: skip
        read = store.get(store.add(TEXTS[:2], show_progress=False)[1])
        expected = hsc.encode(model, torch.tensor([CharTokenizer()(TEXTS[1])["input_ids"]]))
        for v in range(expected.num_layers):
            assert read.transitions[v].dtype == torch.float32
            assert expected.transitions[v].abs().max() > 0.1, v  # M carries the context
            error = relative_error(read.transitions[v], expected.transitions[v])
            assert error <= tolerance + 1e-6 and (dtype == "fp32" or error > 0), (dtype, v)


@torch.no_grad()
def test_qwen3_5_moe_one_state_plus_query_is_context_plus_query():
    """Qwen3.5-MoE (float32 only: its experts' grouped matmul has no float64 kernel): greedy generation and the
    logits from one state equal the concatenation's; and the context changes them."""
    model = hybrid_model("qwen3_5_moe_text", dtype=torch.float32, **DELTA_RULE_MOE)
    model.generation_config.eos_token_id = None
    context, query = ids(13, seed=50), ids(4, seed=51)
    full = torch.cat([context, query], 1)
    expected = model(full).logits[:, -4:]
    assert relative_error(model(query).logits, expected) > 1e-2
    state = hsc.encode(model, context)
    assert relative_error(model(query, past_states=[state]).logits, expected) < 1e-4
    kwargs = dict(max_new_tokens=6, do_sample=False)
    ours = model.generate(query, past_states=[state], **kwargs)[:, 4:]
    assert torch.equal(ours, model.generate(full, **kwargs)[:, full.shape[1] :])
    assert EOS not in ours  # (eos disabled above: the lengths are the ones asked for)
