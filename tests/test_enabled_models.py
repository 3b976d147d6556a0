"""An enabled model is an ordinary object: deepcopy, pickle, torch.save, .to(), PEFT and save_pretrained
carry the enabled behaviour with it and run *its* weights; disable gives the stock classes back."""

import copy
import inspect
import io
import json
import pickle

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache

from helpers import load_saved, pickle_round_trip, random_ids, tiny_model, trusted_loads

NEW = 5


def _generate(model, query, states):
    return model.generate(query, past_states=states, max_new_tokens=NEW, do_sample=False)


def _stock_class(arch):
    from transformers import Mamba2ForCausalLM, MambaForCausalLM

    return MambaForCausalLM if arch == "mamba" else Mamba2ForCausalLM


def _nudge(model):
    """Change a weight that shapes the states (in place)."""
    with torch.no_grad():
        model.backbone.layers[0].mixer.in_proj.weight.mul_(1.5)


@torch.no_grad()
def test_deepcopy_runs_the_copys_own_weights(arch):
    original = tiny_model(arch)
    duplicate = copy.deepcopy(original)
    _nudge(duplicate)
    independent = tiny_model(arch)  # the same seed: the original's weights, changed the same way, enabled on its own
    _nudge(independent)
    ids = random_ids(9)
    assert not torch.equal(duplicate(ids).logits, original(ids).logits)
    assert torch.equal(duplicate(ids).logits, independent(ids).logits)
    context, query = random_ids(11), random_ids(4)
    state = ComposableMambaCache.encode(duplicate, context)
    assert torch.equal(_generate(duplicate, query, [state]), _generate(independent, query, [state]))
    # and with past_states the copy's composed logits are its own
    logits = duplicate(query, past_states=[state]).logits
    assert torch.equal(logits, independent(query, past_states=[state]).logits)
    assert hsc.is_enabled(duplicate) and type(duplicate) is type(original)


@torch.no_grad()
def test_pickle_round_trip_keeps_the_model_enabled(arch):
    model = tiny_model(arch)
    state = ComposableMambaCache.encode(model, random_ids(12))
    query = random_ids(3)
    loaded = pickle_round_trip(model)  # bytes made by this test (models must survive pickle)
    assert hsc.is_enabled(loaded) and isinstance(loaded, _stock_class(arch))
    assert type(loaded.backbone.layers[1].mixer) is type(model.backbone.layers[1].mixer)
    assert hsc.get_backend(loaded) == hsc.get_backend(model)
    assert torch.equal(_generate(loaded, query, [state, state]), _generate(model, query, [state, state]))


@torch.no_grad()
def test_unpickling_where_the_enabled_classes_were_never_made(arch, monkeypatch):
    """A fresh process has no enabled classes yet: loading makes them from the stock classes."""
    from hf_statecompose.generation import integration
    from hf_statecompose.models import mixers

    model = tiny_model(arch)
    state = ComposableMambaCache.encode(model, random_ids(9))
    query = random_ids(3)
    data = pickle.dumps(model)
    monkeypatch.setattr(integration, "_ENABLED_CLASSES", {})
    monkeypatch.setattr(mixers, "_COMPOSABLE_MIXER_CLASSES", {})
    loaded = trusted_loads(data)  # bytes made by this test (models must survive pickle)
    assert type(loaded) is not type(model) and hsc.is_enabled(loaded)
    stock_mixer = type(model.backbone.layers[0].mixer)._hsc_stock_class
    assert type(loaded.backbone.layers[0].mixer) is mixers._COMPOSABLE_MIXER_CLASSES[stock_mixer]  # made on load
    assert torch.equal(_generate(loaded, query, [state]), _generate(model, query, [state]))


@torch.no_grad()
def test_torch_save_round_trip_keeps_the_model_enabled(arch):
    model = tiny_model(arch)
    state = ComposableMambaCache.encode(model, random_ids(12))
    query = random_ids(3)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the user's own model, loaded back through the restricted unpickler (helpers.load_saved)
    buffer.seek(0)
    loaded = load_saved(buffer)
    assert hsc.is_enabled(loaded)
    assert torch.equal(_generate(loaded, query, [state]), _generate(model, query, [state]))


@torch.no_grad()
def test_to_float64_keeps_it_enabled_and_exact(arch):
    model = tiny_model(arch).to(torch.float64)
    assert hsc.is_enabled(model)
    context, query = random_ids(13), random_ids(4)
    state = ComposableMambaCache.encode(model, context)
    assert state.model_dtype == torch.float64
    full = model(torch.cat([context, query], 1)).logits[:, context.shape[1] :]
    composed = model(query, past_states=[state]).logits
    assert (composed - full).abs().max() < 1e-6  # float64 model; the logits come back rounded to float32
    expected = model.generate(torch.cat([context, query], 1), max_new_tokens=NEW, do_sample=False)
    assert torch.equal(_generate(model, query, [state]), expected[:, context.shape[1] :])


def _lora(model, arch):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["in_proj"], init_lora_weights=False)  # a non-zero adapter
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("order", ["enable_then_peft", "peft_then_enable"])
@torch.no_grad()
def test_peft_either_way(order):
    arch = "mamba2"
    if order == "enable_then_peft":
        wrapped = _lora(tiny_model(arch), arch)
    else:
        stock = hsc.disable(tiny_model(arch))
        wrapped = hsc.enable(_lora(stock, arch))
    assert hsc.is_enabled(wrapped) and hsc.is_enabled(wrapped.get_base_model())
    wrapped.eval()
    context, query = random_ids(10), random_ids(4)
    state = ComposableMambaCache.encode(wrapped, context)
    expected = wrapped.generate(input_ids=torch.cat([context, query], 1), max_new_tokens=NEW, do_sample=False)
    out = wrapped.generate(input_ids=query, past_states=[state], max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, expected[:, context.shape[1] :])
    duplicate = copy.deepcopy(wrapped)  # trl's reference model
    assert torch.equal(
        duplicate.generate(input_ids=query, past_states=[state], max_new_tokens=NEW, do_sample=False), out
    )
    hsc.disable(wrapped)
    assert not hsc.is_enabled(wrapped) and type(wrapped.get_base_model()) is _stock_class(arch)


def test_disable_restores_the_stock_classes_exactly(arch):
    model = tiny_model(arch)
    enabled_class = type(model)
    assert hsc.enable(model) is model and type(model) is enabled_class  # idempotent: no class on top of a class
    assert type(tiny_model(arch, seed=1)) is enabled_class  # made once per stock class
    hsc.disable(model)
    assert type(model) is _stock_class(arch)
    for block in model.backbone.layers:
        assert type(block.mixer).__name__ in ("MambaMixer", "Mamba2Mixer")
        assert type(block.mixer).__module__.startswith("transformers.")
        assert "_hsc_backend" not in block.mixer.__dict__
    assert not hsc.is_enabled(model)
    assert not any(name in model.__dict__ for name in ("forward", "generate"))
    state = ComposableMambaCache.encode(model, random_ids(5))
    with pytest.raises(ValueError, match="enable"):  # the stock methods refuse past_states (they would ignore it)
        model.generate(random_ids(3), past_states=[state], max_new_tokens=2)
    hsc.enable(model)
    assert type(model) is enabled_class and hsc.is_enabled(model)


def test_enabled_methods_keep_the_stock_signature(model):
    """transformers inspects forward's parameters; they stay the stock ones, plus past_states, composition and
    attention."""
    stock = _stock_class(model.config.model_type)
    for name in ("forward", "generate"):
        ours = inspect.signature(getattr(model, name)).parameters
        theirs = inspect.signature(getattr(stock, name)).parameters
        assert [p for p in ours if p not in ("past_states", "composition", "attention")] == [
            p for p in theirs if p != "self"
        ]
        assert ours["past_states"].kind is inspect.Parameter.KEYWORD_ONLY
    with pytest.raises(ValueError, match="not used by the model"):  # stock kwarg validation still runs
        model.generate(random_ids(3), max_new_tokens=2, not_an_argument=1)


def test_save_pretrained_names_the_stock_class(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_model("mamba2", layers=1)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Mamba2ForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is _stock_class("mamba2") and not hsc.is_enabled(reloaded)


@torch.no_grad()
def test_encode_does_not_enable_past_states(arch):
    """encode swaps the mixers for the state-aware ones (inert for every other call) and nothing else:
    the model's class stays the stock one and past_states needs enable()."""
    model = hsc.disable(tiny_model(arch))
    ids = random_ids(8, batch=2)
    before = model(ids).logits
    context = random_ids(6)
    state = hsc.encode(model, context)
    assert type(model) is _stock_class(arch) and not hsc.is_enabled(model)
    assert type(model.backbone.layers[0].mixer).__name__.startswith("Composable")
    assert torch.equal(model(ids).logits, before)
    with pytest.raises(ValueError, match="enable"):
        model(random_ids(3), past_states=[state])
    again = hsc.encode(hsc.enable(model), context)
    assert all(torch.equal(a, b) for a, b in zip(state.ssm_states, again.ssm_states))


@torch.no_grad()
def test_accelerate_hooks_before_enable_and_after_disable():
    """accelerate keeps the forward it wraps in the instance (device_map over several devices hooks the model
    at load time, before enable): enable / disable must reach it."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = hsc.disable(tiny_model("mamba2"))
    hooks.add_hook_to_module(model, hooks.AlignDevicesHook(io_same_device=True))
    hsc.enable(model)
    state = ComposableMambaCache.encode(model, random_ids(8))
    query = random_ids(3)
    expected = tiny_model("mamba2")(query, past_states=[state]).logits  # the same weights, not hooked
    assert torch.equal(model(query, past_states=[state]).logits, expected)
    hooks.remove_hook_from_module(model)  # leaves the wrapped forward in the instance as `forward`
    hsc.disable(model)
    with pytest.raises(ValueError, match="enable"):
        model(query, past_states=[state])


@torch.no_grad()
def test_a_mixer_forward_replaced_on_the_instance_still_takes_the_state_path(arch):
    """transformers' Hub kernels (kernels' ``kernelize``, at ``from_pretrained``) bind a Hub layer's forward on the
    module instance (``module.forward = MethodType(layer.forward, module)``), which shadows the class that enable
    swaps. Simulated here: enable routes such a mixer, so calls on our cache take the state path (the results of the
    same model without the replacement) and every other call the instance forward; disable gives it back."""
    import types

    from hf_statecompose.models.mixers import ssm_mixers

    reference = tiny_model(arch)
    model = hsc.disable(copy.deepcopy(reference))
    stock = type(ssm_mixers(model)[0])
    calls = []

    def hub_forward(self, hidden_states, *args, **kwargs):  # a Hub layer's forward: the stock computation, counted
        calls.append(self.layer_idx)
        return stock.forward(self, hidden_states, *args, **kwargs)

    for mixer in ssm_mixers(model):
        mixer.forward = types.MethodType(hub_forward, mixer)
    hsc.enable(model)
    context, query = random_ids(11), random_ids(4)
    state = ComposableMambaCache.encode(model, context)
    assert torch.equal(state.ssm_states[0], ComposableMambaCache.encode(reference, context).ssm_states[0])
    assert torch.equal(_generate(model, query, [state, state]), _generate(reference, query, [state, state]))
    assert torch.equal(model(query, past_states=[state]).logits, reference(query, past_states=[state]).logits)
    assert calls == []  # nothing on our cache reached the instance forward
    # any other call (the stock cache of a plain generate) runs the instance forward, as before enable
    plain = model.generate(query, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(plain, reference.generate(query, max_new_tokens=NEW, do_sample=False))
    assert len(calls) == NEW * len(ssm_mixers(model))
    # enable again is a no-op, a deep copy keeps the routing, and disable puts the instance forward back
    hsc.enable(model)
    duplicate = copy.deepcopy(model)
    assert torch.equal(_generate(duplicate, query, [state]), _generate(reference, query, [state]))
    hsc.disable(model)
    assert all(mixer.__dict__["forward"].__func__ is hub_forward for mixer in ssm_mixers(model))


@torch.no_grad()
def test_a_gated_deltanet_forward_replaced_on_the_instance_still_takes_the_state_path():
    """The layer transformers maps to a Hub kernel by default (Qwen3.5's GatedDeltaNet, on sm_121 / gfx1151 GPUs),
    replaced on the instance as kernelize does: its states and composed logits are the unreplaced model's, and a
    plain forward (no states) runs the instance forward."""
    import types

    from hf_statecompose.models.mixers import ssm_mixers

    from architectures import hybrid_model, ids

    reference = hybrid_model("qwen3_5_text")
    model = hybrid_model("qwen3_5_text", enable=False)
    stock = type(ssm_mixers(model)[0])
    calls = []

    def hub_forward(self, hidden_states, *args, **kwargs):
        calls.append(self.layer_idx)
        return stock.forward(self, hidden_states, *args, **kwargs)

    for mixer in ssm_mixers(model):
        mixer.forward = types.MethodType(hub_forward, mixer)
    hsc.enable(model)
    context, query = ids(9), ids(3, seed=1)
    state = hsc.encode(model, context)
    logits = model(query, past_states=[state, state]).logits
    assert torch.equal(logits, reference(query, past_states=[state, state]).logits) and calls == []
    assert torch.equal(model(query).logits, reference(query).logits)
    assert len(calls) == len(ssm_mixers(model))
