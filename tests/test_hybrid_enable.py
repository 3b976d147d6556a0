"""``hsc.enable`` on hybrid models configured without any SSM layer (every layer attention): what transformers' own
GraniteMoeHybrid suite builds in ``test_attention_only_forward``.

``enable`` must still work and change nothing for calls without ``past_states`` (transformers' suites run with every
model enabled, tests/enable_plugin.py); such a model has no state to encode, so ``hsc.encode`` refuses it, saying why.
"""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import hf_statecompose as hsc

SMALL = dict(
    vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, pad_token_id=0
)
# every layer attention (the hybrids whose config lets a layer be attention alone)
ATTENTION_ONLY = {
    "granitemoehybrid": dict(
        num_hidden_layers=2,
        layer_types=["attention", "attention"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        num_local_experts=0,
        shared_intermediate_size=48,
        position_embedding_type=None,
    ),
    "bamba": dict(
        num_hidden_layers=2,
        attn_layer_indices=[0, 1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
    ),
    "nemotron_h": dict(
        num_hidden_layers=3,
        hybrid_override_pattern="*-*",
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=1,
        chunk_size=16,
    ),
}


def _attention_only_model(model_type: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SMALL, **ATTENTION_ONLY[model_type])
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", sorted(ATTENTION_ONLY))
def test_enable_attention_only_hybrid_changes_nothing(model_type):
    model = _attention_only_model(model_type)
    ids = torch.randint(1, 64, (2, 6))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert hsc.enable(model) is model and hsc.is_enabled(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), tokens)


@pytest.mark.parametrize("model_type", sorted(ATTENTION_ONLY))
def test_encode_refuses_attention_only_hybrid(model_type):
    model = hsc.enable(_attention_only_model(model_type))
    with pytest.raises(ValueError, match=r"has no SSM layer .*no state to encode or compose"):
        hsc.encode(model, torch.randint(1, 64, (1, 5)))


# issue 41 item 7: a hybrid whose config has no attention layer (every layer recurrent); transformers' forward with a
# cache fails on it (stock too, with use_cache=True: "`get_seq_length` / `get_mask_sizes` can only be called on
# Attention layers"); encode says what the model lacks and what to do, from an hf_statecompose frame
RECURRENT_ONLY = {
    "qwen3_5_text": dict(layer_types=["linear_attention"] * 4),
    "qwen3_next": dict(layer_types=["linear_attention"] * 4),
    "kimi_linear": dict(layer_types=["linear_attention"] * 4),
    "nemotron_h": dict(hybrid_override_pattern="M-M-"),
    "bamba": dict(attn_layer_indices=[]),
    "granitemoehybrid": dict(layer_types=["mamba"] * 3),
    "zamba2": dict(layers_block_type=["mamba"] * 4),
}


@pytest.mark.parametrize("arch", sorted(RECURRENT_ONLY))
def test_encode_refuses_a_hybrid_without_attention_layers(arch):
    import traceback

    from architectures import hybrid_model

    model = hybrid_model(arch, dtype=torch.float32, **RECURRENT_ONLY[arch])
    with pytest.raises(
        ValueError,
        match=rf"this {arch} model has no attention layer \(layer kinds .*\): .*give its config an attention layer",
    ) as error:
        hsc.encode(model, torch.randint(3, 64, (1, 5)))
    assert "hf_statecompose" in traceback.extract_tb(error.value.__traceback__)[-1].filename
