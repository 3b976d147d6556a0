"""The embedded GDN demo (transformers' Qwen3.5 text model: gated DeltaNet layers and one attention layer): it ships
as small safetensors with its card, loads offline with the Mamba-2 demo's tokenizer, has the promised architecture,
its context changes its answers, and the ordering measured by ``recipes/eval_gdn_demo.py`` holds."""

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5ForCausalLM

import hf_statecompose as hsc
from hf_statecompose.demo import DEMO_DIR, DEMO_SPECS

from helpers import load_recipe

ROOT = Path(__file__).resolve().parents[1]
FOLDER = DEMO_DIR / "gdn"

# measured on the shipped checkpoint (the first 8 demo questions, recipes/eval_gdn_demo.py), right of 8 / answer loss:
# k = 1: no context 0 / 1.680; concatenated and every composition (soup, CASO, PICASO-S, PICASO-R) 8 / 0.009.
# k = 2: no context 0 / 1.680; concatenated 8 / 0.006; soup 8 / 0.286; CASO 8 / 0.007; PICASO-S, PICASO-R 8 / 0.007.
# The test asks: with context (text or composed state) at least 6 of 8 right and no context at most 2; the answer loss
# with context under 0.5 (no context: 1.68); at k = 1 every composition within 0.02 nats of the concatenation, at k = 2
# CASO / PICASO-S / PICASO-R within 0.02 and soup (which averages the answer's state with the other's) within 0.5.
MIN_RIGHT, MAX_RIGHT_NO_CONTEXT, MAX_CONTEXT_LOSS, MIN_NO_CONTEXT_LOSS = 6, 2, 0.5, 1.2
COMPOSED_VS_CONCAT, SOUP_VS_CONCAT_K2 = 0.02, 0.5
METHODS = ("soup", "caso", "picaso_s", "picaso_r")


@pytest.fixture(scope="module")
def gdn():
    return hsc.load_demo("gdn")


def _recipe():
    return load_recipe("eval_gdn_demo")


def test_checkpoint_is_small_safetensors_with_model_card():
    assert (FOLDER / "model.safetensors").stat().st_size <= 20 * 2**20
    assert not [p for p in FOLDER.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
    card = (ROOT / "model_cards" / "demo-gdn.md").read_text()
    assert card == (FOLDER / "README.md").read_text()
    assert "CC BY-SA 4.0" in card and "Qwen3_5ForCausalLM" in card and "eval_gdn_demo.py" in card
    assert (FOLDER / "tokenizer.json").read_bytes() == (DEMO_DIR / "mamba2" / "tokenizer.json").read_bytes()
    assert DEMO_SPECS["demo-gdn"] == "gdn"


def test_is_qwen3_5_text_with_gdn_layers_and_one_attention_layer(gdn):
    model, tokenizer = gdn
    config = model.config
    assert config.model_type == "qwen3_5_text" and isinstance(model, Qwen3_5ForCausalLM)
    assert config.layer_types.count("full_attention") == 1
    assert config.layer_types.count("linear_attention") == len(config.layer_types) - 1 >= 3
    assert config.tie_word_embeddings and model.lm_head.weight is model.get_input_embeddings().weight
    assert len(tokenizer) == config.vocab_size == 4096
    assert not model.training
    state = hsc.encode(model, tokenizer("Sollo river North.\n", return_tensors="pt").input_ids)
    assert type(state).__name__ == "ComposableDeltaRuleCache"
    gdn_layers = config.layer_types.count("linear_attention")
    assert len(state.ssm_states) == gdn_layers and len(state.transitions) == gdn_layers


def test_a_context_changes_the_answer(gdn):
    """The answer's passage given as a state changes the greedy answer after the query (measured: 8 of the first
    8 demo questions, a total variation of 0.90–0.98 between the next-token distributions), and the state path is
    the concatenation's: one state + query = passage + query."""
    model, tokenizer = gdn
    items = _recipe()._hybrid_recipe().questions_with_passages(1, limit=8)
    changed = 0
    for item in items:
        passage = tokenizer(item["passages"][0], return_tensors="pt").input_ids
        query = tokenizer(item["query"], return_tensors="pt").input_ids
        with torch.no_grad():
            alone = model(query).logits[0, -1].log_softmax(-1)
            with_state = model(query, past_states=[hsc.encode(model, passage)]).logits[0, -1].log_softmax(-1)
            full = model(torch.cat([passage, query], 1)).logits[0, -1].log_softmax(-1)
        torch.testing.assert_close(with_state, full, rtol=1e-4, atol=1e-4)
        assert (with_state.exp() - alone.exp()).abs().sum() / 2 > 0.5, item["query"]
        changed += int(with_state.argmax() != alone.argmax())
    assert changed >= 6, f"{changed}/{len(items)}"


def test_the_measured_ordering(gdn):
    """On the first 8 demo questions with the answer's passage alone (k = 1) and with one other (k = 2), the ordering
    measured by ``recipes/eval_gdn_demo.py`` (see the model card): the model recalls from its context, the text or a
    composed state, and answers at chance without it; the compositions track the concatenation."""
    model, tokenizer = gdn
    recipe = _recipe()
    results = recipe.evaluate(model, tokenizer, ks=(1, 2), limit=8, log=lambda *args: None)["k"]
    for k, result in results.items():
        loss = {condition: r["answer_loss"] for condition, r in result.items()}
        right = {condition: round(r["accuracy"] * 8) for condition, r in result.items()}
        assert set(loss) == {"none", "concat", *METHODS}
        assert right["none"] <= MAX_RIGHT_NO_CONTEXT and loss["none"] > MIN_NO_CONTEXT_LOSS, (k, right, loss)
        for condition in ("concat", *METHODS):  # recall: the context's text or its state composed gives the answer
            assert right[condition] >= MIN_RIGHT, (k, right)
            assert loss[condition] < MAX_CONTEXT_LOSS, (k, loss)
        for method in METHODS:  # the compositions land where the concatenated text does (soup, at k = 2, near it)
            tolerance = SOUP_VS_CONCAT_K2 if (k, method) == (2, "soup") else COMPOSED_VS_CONCAT
            assert abs(loss[method] - loss["concat"]) < tolerance, (k, method, loss)


def test_model_card_names_the_gdn_training_flags():
    """The card's recipe line repeats the GDN run's flags (steps, learning rate, threads, the embeddings' warm start,
    the layer pattern and the recall-only first phase)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from model_card import render

    summary = json.loads((FOLDER / "training_log.json").read_text())["summary"]
    card = render(summary)
    assert f"--arch gdn --steps {summary['steps_arg']} --lr {summary['lr']}" in card
    assert "--gdn-layers 'GG*G'" in card and f"--recall-only-steps {summary['recall_only_steps']}" in card
    assert "--arch gdn --minutes 30 --lr" in render({**summary, "steps_arg": None})
    assert ("--init-from" in card) == bool(summary.get("init_from"))
    assert "--gdn-init transformers" in render({**summary, "gdn_init": "transformers"})
