"""Fine-tuning for composition: BPTC / BP2C losses and gradients, LoRA adapters, the recipe."""

import json
import sys
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.training import CompositionExample, composition_loss, encode_contexts

from helpers import random_ids, save_tiny_finetune_base, tiny_model

peft = pytest.importorskip("peft")
ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"mamba2": ["in_proj"], "mamba": ["in_proj", "x_proj"]}


def lora_model(arch, seed=0, random_b=True):
    """A tiny model with LoRA; ``random_b`` makes the adapter non-zero (PEFT starts B at 0)."""
    model = tiny_model(arch, seed=seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[arch], task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config)
    if random_b:
        torch.manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
    return wrapped


def examples(k, rows=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(rows):
        contexts = [random_ids(int(torch.randint(3, 12, (1,), generator=g)), generator=g)[0] for _ in range(k)]
        out.append(CompositionExample(random_ids(4 + r, generator=g)[0], random_ids(3, generator=g)[0], contexts))
    return out


def lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def test_one_context_bptc_equals_backprop_through_the_concatenation(arch):
    """One state composes to itself exactly: BPTC's loss *and gradients* equal training on context + query."""
    model = lora_model(arch)
    model.train()
    ex = examples(1, rows=1)[0]
    loss = composition_loss(model, [ex], "bptc")
    loss.backward()
    composed = lora_grads(model)
    model.zero_grad()
    ids = torch.cat([ex.contexts[0], ex.query, ex.target])[None]
    labels = torch.full_like(ids, -100)
    labels[0, -len(ex.target) :] = ex.target
    reference = model(input_ids=ids, labels=labels).loss
    reference.backward()
    expected = lora_grads(model)
    assert abs(loss.item() - reference.item()) < 1e-5 * abs(reference.item())
    assert set(composed) == set(expected) and len(expected) >= 2 * model.config.num_hidden_layers
    for name in expected:
        err = (composed[name] - expected[name]).abs().max() / expected[name].abs().max().clamp_min(1e-12)
        assert err < 1e-3, name


def test_bptc_gradients_reach_lora_through_the_context_encodings_and_bp2c_stops_them(arch, monkeypatch):
    # BP2C encodes without autograd, BPTC with it: on CPU the first would take the native float32 kernels and
    # the second the torch path, whose roundings differ (each is checked against the fp64 reference in
    # test_ops.py). "BP2C is BPTC with detached states" is exact only on one path: run both on torch.
    monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", "0")
    model = lora_model(arch)
    model.train()
    batch = examples(3)
    # BPTC: the states are part of the graph and receive gradient
    states = encode_contexts(model, [c for ex in batch for c in ex.contexts], "bptc")
    assert all(s.ssm_states[i].requires_grad for s in states for i in range(s.num_layers))
    per_row = [states[3 * r : 3 * r + 3] for r in range(3)]
    q = torch.stack([ex.query[-3:] for ex in batch])
    out = model(input_ids=q, past_states=per_row).logits.sum()
    grads = torch.autograd.grad(out, [s.ssm_states[0] for s in states] + [s.delta_sums[0] for s in states])
    assert all(g.abs().max() > 0 for g in grads)
    # BP2C: no graph into the encodings
    states = encode_contexts(model, [c for ex in batch for c in ex.contexts], "bp2c")
    assert not any(
        s.ssm_states[i].requires_grad or s.conv_states[i].requires_grad or s.delta_sums[i].requires_grad
        for s in states
        for i in range(s.num_layers)
    )

    model.zero_grad()
    bptc_loss = composition_loss(model, batch, "bptc")
    bptc_loss.backward()
    bptc = lora_grads(model)
    model.zero_grad()
    bp2c_loss = composition_loss(model, batch, "bp2c")
    bp2c_loss.backward()
    bp2c = lora_grads(model)
    assert torch.allclose(bptc_loss, bp2c_loss)  # same forward value, different gradients
    assert set(bptc) == set(bp2c)
    # every adapter gets gradient in both; BPTC's differs by what flowed through the encodings
    assert all(bptc[n].abs().max() > 0 and bp2c[n].abs().max() > 0 for n in bptc)
    diff = max(float((bptc[n] - bp2c[n]).abs().max() / bptc[n].abs().max()) for n in bptc)
    assert diff > 1e-3
    # BP2C is exactly BPTC with the states detached
    model.zero_grad()
    states = [s.detach() for s in encode_contexts(model, [c for ex in batch for c in ex.contexts], "bptc")]
    detached = [CompositionExample(ex.query, ex.target, []) for ex in batch]
    from hf_statecompose.training import _left_pad, _summed_loss

    rows, labels = zip(
        *[
            (torch.cat([ex.query, ex.target]), torch.cat([torch.full_like(ex.query, -100), ex.target]))
            for ex in detached
        ]
    )
    ids, mask = _left_pad(list(rows), 0)
    label_ids, _ = _left_pad(list(labels), -100)
    loss = _summed_loss(model, ids, mask, label_ids, past_states=[states[3 * r : 3 * r + 3] for r in range(3)]) / int(
        (label_ids != -100).sum()
    )
    loss.backward()
    for n, g in lora_grads(model).items():
        assert torch.allclose(g, bp2c[n], rtol=1e-5, atol=1e-8), n


def test_checkpointed_context_encodings_give_the_same_gradients(arch):
    model = lora_model(arch)
    model.train()
    batch = examples(2)
    composition_loss(model, batch, "bptc").backward()
    plain = lora_grads(model)
    model.zero_grad()
    composition_loss(model, batch, "bptc", checkpoint_contexts=True).backward()
    for n, g in lora_grads(model).items():
        assert torch.allclose(g, plain[n], rtol=1e-4, atol=1e-7), n


def test_layer_gradient_checkpointing_with_states_is_refused(arch):
    model = lora_model(arch)
    model.get_base_model().activation_checkpointing_enable()
    model.train()
    with pytest.raises(ValueError, match="checkpoint_contexts=True"):
        composition_loss(model, examples(2), "bptc")
    model.eval()  # inference is unaffected
    with torch.no_grad():
        composition_loss(model, examples(2), "bptc")


def test_three_bptc_steps_change_the_lora_weights_and_the_adapter_reloads_identically(arch, tmp_path):
    model = lora_model(arch, random_b=False)
    base_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora_before = {n: p.clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(3):
        loss = composition_loss(model, examples(2, seed=step), "bptc")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert len(changed) == len(lora_before)
    assert all(torch.equal(p, base_before[n]) for n, p in model.named_parameters() if not p.requires_grad)

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert not list((tmp_path / "adapter").glob("*.bin"))
    reloaded = peft.PeftModel.from_pretrained(tiny_model(arch), tmp_path / "adapter")
    ids = random_ids(9)
    context = random_ids(7)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)
        state = hsc.ComposableMambaCache.encode(model, context)
        again = hsc.ComposableMambaCache.encode(reloaded, context)
        assert state.fingerprint == again.fingerprint
        assert torch.equal(
            model(input_ids=ids, past_states=[state]).logits, reloaded(input_ids=ids, past_states=[again]).logits
        )
        # the adapter changes the states: a state of the base model is refused by the adapted one
        with pytest.raises(ValueError, match=r"(?i)fingerprint|another model"):
            reloaded(input_ids=ids, past_states=[hsc.ComposableMambaCache.encode(tiny_model(arch), context)])


def test_generate_through_peft_with_one_state_equals_generate_from_the_concatenation(arch):
    model = lora_model(arch)
    model.eval()
    context, query = random_ids(11), random_ids(5)
    state = hsc.ComposableMambaCache.encode(model, context)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    composed = model.generate(input_ids=query, past_states=[state], **kwargs)
    full = model.generate(input_ids=torch.cat([context, query], 1), **kwargs)
    assert torch.equal(composed[0, query.shape[1] :], full[0, context.shape[1] + query.shape[1] :])


def test_bad_objective_and_empty_batch_are_refused():
    model = lora_model("mamba2")
    with pytest.raises(ValueError, match="objective"):
        composition_loss(model, examples(1), "sgd")
    with pytest.raises(ValueError, match="empty"):
        composition_loss(model, [], "bptc")
    with pytest.raises(ValueError, match="non-empty"):
        composition_loss(model, [CompositionExample(torch.tensor([], dtype=torch.long), torch.tensor([5]), [])], "bptc")


# ---------------------------------------------------------------------------------------------- recipe
@pytest.fixture(scope="module")
def recipe():
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    yield finetune
    sys.path.remove(str(ROOT / "recipes"))


def test_config_merges_defaults_experiment_and_overrides(recipe):
    cfg = recipe.load_config("bp2c-mamba", overrides=["lora.r=4", "lr=5e-4", "eval.k=3"])
    assert cfg["objective"] == "bp2c" and cfg["arch"] == "mamba"
    assert cfg["lora"]["r"] == 4 and cfg["lora"]["alpha"] == 32 and cfg["lr"] == 5e-4
    assert cfg["eval"]["k"] == 3 and cfg["eval"]["before"] is True
    assert cfg["out"].endswith("adapters/bp2c-mamba")
    with pytest.raises(SystemExit, match="unknown experiment"):
        recipe.load_config("nope")
    with pytest.raises(SystemExit, match="objective"):
        recipe.load_config("smoke", overrides=["objective=sgd"])


def test_recipe_runs_three_bptc_steps_on_a_tiny_model(recipe, tmp_path, monkeypatch):
    """The whole recipe (data, LoRA, accelerate, save, results, card) on a tiny model with the demo tokenizer."""

    save_tiny_finetune_base(tmp_path / "base")
    monkeypatch.setenv("HF_STATECOMPOSE_CACHE", str(tmp_path / "cache"))
    results = recipe.main(
        [
            "--experiment",
            "smoke",
            "--set",
            f"model={tmp_path / 'base'}",
            "--set",
            f"out={tmp_path / 'out'}",
            "--set",
            "wiki_pool_segments=12",
        ]
    )
    assert results["training"]["steps"] == 3 and len(results["log"]) == 3
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["config"]["objective"] == "bptc"
    assert (tmp_path / "out" / "README.md").read_text().count("PeftModel.from_pretrained") == 1
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "out" / "adapter_model.safetensors")
    lora_b = [t for n, t in weights.items() if "lora_B" in n]
    assert lora_b and all(t.abs().max() > 0 for t in lora_b)  # B starts at zero: three steps moved it


def test_rows_without_contexts_equal_the_plain_model(arch):
    model = lora_model(arch)
    model.train()
    batch = [CompositionExample(ex.query, ex.target, []) for ex in examples(0, rows=3)]
    loss = composition_loss(model, batch, "bptc")
    loss.backward()
    ours = lora_grads(model)
    model.zero_grad()
    total, count = 0.0, 0
    for ex in batch:  # one row at a time, stock transformers, no padding
        ids = torch.cat([ex.query, ex.target])[None]
        labels = torch.full_like(ids, -100)
        labels[0, -len(ex.target) :] = ex.target
        total = total + model(input_ids=ids, labels=labels).loss * len(ex.target)
        count += len(ex.target)
    (total / count).backward()
    assert abs(loss.item() - (total / count).item()) < 1e-5
    for n, g in lora_grads(model).items():
        assert torch.allclose(ours[n], g, rtol=1e-3, atol=1e-6), n


def test_row_reduction_is_the_mean_of_each_rows_mean():
    model = lora_model("mamba2")
    batch = examples(2, rows=3)
    batch[0] = CompositionExample(batch[0].query, random_ids(9)[0], batch[0].contexts)  # a longer target
    with torch.no_grad():
        per_row = [composition_loss(model, [ex], "bp2c") for ex in batch]
        token = composition_loss(model, batch, "bp2c")
        row = composition_loss(model, batch, "bp2c", reduction="row")
    lengths = [ex.target.numel() for ex in batch]
    assert torch.allclose(row, torch.stack(per_row).mean(), rtol=1e-5)
    assert torch.allclose(token, sum(l * n for l, n in zip(per_row, lengths)) / sum(lengths), rtol=1e-5)
    assert not torch.allclose(row, token, rtol=1e-3)
    with pytest.raises(ValueError, match="reduction"):
        composition_loss(model, batch, "bp2c", reduction="sum")
