"""The state object: contract, batch operations, persistence, fingerprints."""

import os

import torch
from transformers import DynamicCache

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache

from helpers import random_ids, tiny_model


@torch.no_grad()
def test_public_contract(model):
    state = ComposableMambaCache.encode(model, random_ids(12, batch=2))
    assert isinstance(state, DynamicCache) and state.num_layers == model.config.num_hidden_layers
    assert state.batch_size == 2 and state.num_tokens.tolist() == [12, 12]
    for i in range(state.num_layers):
        ssm, conv, log_decay = state.ssm_states[i], state.conv_states[i], state.log_decay(i)
        assert ssm.dtype == torch.float32 and conv.shape[-1] == model.config.conv_kernel
        assert torch.broadcast_shapes(log_decay.shape, ssm.shape) == ssm.shape
        assert (log_decay <= 0).all()
    if model.config.model_type == "mamba":
        assert state.delta_sums[0].shape == (2, model.config.intermediate_size)
    else:
        assert state.delta_sums[0].shape == (2, model.config.num_heads)


@torch.no_grad()
def test_rows_stack_clone_to(model):
    a = ComposableMambaCache.encode(model, random_ids(8, batch=2))
    b = ComposableMambaCache.encode(model, random_ids(5))
    stacked = ComposableMambaCache.stack([a, b])
    assert stacked.batch_size == 3 and stacked.num_tokens.tolist() == [8, 8, 5]
    torch.testing.assert_close(stacked.select(2).ssm_states[1], b.ssm_states[1])
    torch.testing.assert_close(stacked[0:2].conv_states[0], a.conv_states[0])
    assert torch.equal(stacked.select(2).context_tokens(0), b.context_tokens(0))
    copy = a.clone()
    copy.ssm_states[0].add_(1)
    assert not torch.equal(copy.ssm_states[0], a.ssm_states[0])
    moved = a.to("cpu", dtype=torch.float64)
    assert moved.conv_states[0].dtype == torch.float64 and moved.model_dtype == torch.float64
    assert moved.ssm_states[0].dtype == torch.float32


@torch.no_grad()
def test_save_load_round_trip(model, tmp_path):
    state = ComposableMambaCache.encode(model, random_ids(9, batch=2))
    path = tmp_path / "ctx0.safetensors"
    ComposableMambaCache.save(state, path)
    loaded = ComposableMambaCache.load(path, model=model)
    for i in range(state.num_layers):
        assert torch.equal(loaded.ssm_states[i], state.ssm_states[i])
        assert torch.equal(loaded.conv_states[i], state.conv_states[i])
        assert torch.equal(loaded.log_decay(i), state.log_decay(i))
    assert torch.equal(loaded.token_ids, state.token_ids) and loaded.fingerprint == state.fingerprint
    query = random_ids(4, batch=2)
    assert torch.equal(model(query, past_states=[loaded]).logits, model(query, past_states=[state]).logits)
    # without a model the file still loads (for composition offline)
    assert ComposableMambaCache.load(path).num_layers == state.num_layers
    assert [p.name for p in tmp_path.iterdir()] == ["ctx0.safetensors"]  # no temporary left behind


def test_a_crash_mid_write_keeps_the_old_file(model, tmp_path, monkeypatch):
    state = ComposableMambaCache.encode(model, random_ids(9))
    path = tmp_path / "ctx.safetensors"
    state.save(path)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(os, "replace", crash)
    other = ComposableMambaCache.encode(model, random_ids(4))
    try:
        other.save(path)
    except KeyboardInterrupt:
        pass
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ctx.safetensors"]


def test_fingerprint_tells_models_apart(arch):
    base = tiny_model(arch, seed=0)
    assert hsc.model_fingerprint(base) == hsc.model_fingerprint(tiny_model(arch, seed=0))
    assert hsc.model_fingerprint(base) != hsc.model_fingerprint(tiny_model(arch, seed=1))
    assert hsc.model_fingerprint(base) != hsc.model_fingerprint(tiny_model(arch, seed=0, layers=3))
    # a change of one weight that shapes states (e.g. an adapter update) changes it; the LM head does not
    before = hsc.model_fingerprint(base)
    with torch.no_grad():
        base.backbone.layers[1].mixer.in_proj.weight[0, 0] += 1e-3
    assert hsc.model_fingerprint(base) != before
    before = hsc.model_fingerprint(base)
    with torch.no_grad():
        base.backbone.norm_f.weight.mul_(2)
    assert hsc.model_fingerprint(base) == before
