"""The embedded hybrid demo (transformers' NemotronH: Mamba-2 layers and attention layers without
positional encoding): it ships as small safetensors with its card, loads offline with the Mamba-2 demo's
tokenizer, has the promised architecture, and uses its context (measured with the evaluation recipe)."""
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import NemotronHForCausalLM

import hf_statecompose as hsc
from hf_statecompose.demo import DEMO_DIR

ROOT = Path(__file__).resolve().parents[1]
FOLDER = DEMO_DIR / "hybrid"


@pytest.fixture(scope="module")
def hybrid():
    return hsc.load_demo("hybrid")


# measured on the shipped checkpoint (first 8 demo questions, k = 2): answer loss 1.626 without context,
# 0.242 concatenated; 0 / 8 right without, 8 / 8 with. The test asks for about half of each gap.
MARGIN, MIN_EXTRA_CORRECT = 0.7, 4


def _recipe():
    spec = importlib.util.spec_from_file_location("eval_hybrid_demo", ROOT / "recipes" / "eval_hybrid_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkpoint_is_small_safetensors_with_model_card():
    assert (FOLDER / "model.safetensors").stat().st_size <= 20 * 2**20
    assert not [p for p in FOLDER.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    card = (ROOT / "model_cards" / "demo-hybrid.md").read_text()
    assert card == (FOLDER / "README.md").read_text()
    assert "CC BY-SA 4.0" in card and "NemotronHForCausalLM" in card
    assert (FOLDER / "tokenizer.json").read_bytes() == (DEMO_DIR / "mamba2" / "tokenizer.json").read_bytes()


def test_is_nemotron_h_with_mamba2_and_two_attention_layers(hybrid):
    model, tokenizer = hybrid
    config = model.config
    assert config.model_type == "nemotron_h" and isinstance(model, NemotronHForCausalLM)
    assert config.layers_block_type.count("full_attention") == 2
    assert set(config.layers_block_type) == {"linear_attention", "full_attention"}  # Mamba-2 and attention, no MLP
    assert (config.hidden_size, config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size) == (256, 8, 64, 64)
    assert len(tokenizer) == config.vocab_size == 4096
    assert not model.training


def test_attention_layers_have_no_positional_encoding(hybrid):
    """NoPE: no rotary module or RoPE setting, and an attention layer over a full (non-causal) mask is
    permutation-equivariant (with any positional encoding, permuting the tokens would change the scores)."""
    model, _ = hybrid
    assert not [name for name, _ in model.named_modules() if "rotary" in name.lower() or "rope" in name.lower()]
    assert not [key for key in model.config.to_dict() if "rope" in key.lower()]
    layers = [layer.mixer for layer, kind in zip(model.model.layers, model.config.layers_block_type) if kind == "full_attention"]
    assert len(layers) == 2
    torch.manual_seed(0)
    x = torch.randn(1, 7, model.config.hidden_size)
    perm = torch.randperm(7)
    full = torch.zeros(1, 1, 7, 7)
    with torch.no_grad():
        for layer in layers:
            out, _ = layer(x, attention_mask=full)
            permuted, _ = layer(x[:, perm], attention_mask=full)
            torch.testing.assert_close(permuted, out[:, perm], rtol=1e-5, atol=1e-5)


def test_context_helps_when_concatenated(hybrid):
    """On the demo questions (the answer's passage and one other, concatenated before the query) the
    answer's loss falls well below the query-only loss; the margin here is about half the one measured."""
    model, tokenizer = hybrid
    recipe = _recipe()
    items = recipe.questions_with_passages(k=2, seed=0, limit=8)
    none = [recipe.stock_condition(model, tokenizer, item, with_context=False) for item in items]
    concat = [recipe.stock_condition(model, tokenizer, item, with_context=True) for item in items]
    loss_none = sum(r["loss"] for r in none) / len(none)
    loss_concat = sum(r["loss"] for r in concat) / len(concat)
    assert loss_concat < loss_none - MARGIN, (loss_none, loss_concat)
    assert sum(r["correct"] for r in concat) >= sum(r["correct"] for r in none) + MIN_EXTRA_CORRECT


def test_unknown_architectures_are_still_refused_by_load_demo():
    with pytest.raises(ValueError, match="arch"):
        hsc.load_demo("jamba")


def test_zero_attention_ablation(hybrid):
    """``eval_hybrid_demo.py --zero-attention``: the attention layers' output projections become zero (the
    model then computes what its Mamba-2 layers alone compute); a model without attention layers is refused."""
    model, _ = hybrid
    model = type(model)(model.config)  # a fresh copy: the fixture's model is shared
    recipe = _recipe()
    recipe.zero_attention(model)
    attention = [layer for layer in model.model.layers if layer.block_type == "full_attention"]
    assert len(attention) == 2 and all(not layer.mixer.o_proj.weight.any() for layer in attention)
    mamba2, _ = hsc.load_demo()
    with pytest.raises(ValueError, match="no attention layers"):
        recipe.zero_attention(mamba2)


def test_model_card_names_the_hybrid_training_flags():
    """The card's recipe line repeats every non-default hybrid flag, so it says exactly how it was trained."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "recipes"))
    from model_card import render

    summary = json.loads((FOLDER / "training_log.json").read_text())["summary"]
    assert "--max-towns" not in render(summary)
    card = render({**summary, "max_towns": 24, "qk_init_std": 0.1, "induction_init": True, "freeze_ssm_steps": 300})
    assert "--max-towns 24 --qk-init-std 0.1 --freeze-ssm-steps 300 --induction-init" in card
    assert "2–24 fictional towns" in card and "least squares" in card and "first 300 steps" in card
