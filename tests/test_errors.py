"""Bad input gets a clear ValueError / TypeError naming the problem and the fix."""

import pickle
import re

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer

from helpers import random_ids, tiny_model


@pytest.fixture
def state(model):
    with torch.no_grad():
        return ComposableMambaCache.encode(model, random_ids(9))


def _generate(model, states, **kwargs):
    return model.generate(random_ids(3), past_states=states, max_new_tokens=2, do_sample=False, **kwargs)


def test_empty_list(model):
    with pytest.raises(ValueError, match="past_states is empty: pass at least one ComposableMambaCache"):
        _generate(model, [])
    with pytest.raises(ValueError, match=r"^states is empty: pass at least one state to compose"):
        StateComposer("picaso_s").compose([])


def test_not_a_state(model, state):
    with pytest.raises(TypeError, match=r"past_states\[1\] must hold ComposableMambaCache objects .*got Tensor"):
        _generate(model, [state, torch.zeros(3)])
    with pytest.raises(TypeError, match=r"past_states must be a list of states .*not a single state"):
        _generate(model, state)
    with pytest.raises(
        ValueError,
        match=r"past_states\[0\] holds a ComposableMambaCache with no state; encode a "
        "context into it first",
    ):
        _generate(model, [ComposableMambaCache.empty_for(model)])


def test_state_from_another_model(arch, state, model):
    other = tiny_model(arch, seed=7)  # same config, other weights
    with pytest.raises(ValueError, match="re-encode the contexts with this model"):
        _generate(other, [state])
    with torch.no_grad():
        foreign = ComposableMambaCache.encode(other, random_ids(5))
    with pytest.raises(
        ValueError,
        match=r"^states\[1\] was encoded by a different model .* than states\[0\] "
        r".*; encode every context with the same model",
    ):
        StateComposer("soup").compose([state, foreign])


def test_state_from_another_config(arch, state):
    deeper = tiny_model(arch, layers=3)
    with pytest.raises(
        ValueError,
        match=r"past_states\[0\] has 2 layers, the model 3; the state belongs to another "
        "model: re-encode the contexts with this model",
    ):
        _generate(deeper, [state])
    wider = tiny_model(arch, conv_kernel=2)
    with pytest.raises(
        ValueError,
        match=r"past_states\[0\] layer 0 conv window has per-row shape \(\d+, 4\), this "
        r"model expects \(\d+, 2\); .*re-encode the contexts with this model",
    ):
        _generate(wider, [state])


def test_shape_tampering_is_caught(model, state):
    bad = state.clone()
    bad.layers[1].ssm_state = bad.ssm_states[1][..., :-1]
    with pytest.raises(
        ValueError,
        match=r"past_states\[0\] layer 1 SSM state has per-row shape \(.*7\), this model "
        r"expects \(.*8\); .*re-encode the contexts with this model",
    ):
        _generate(model, [bad])
    with pytest.raises(
        ValueError,
        match=r"^states\[1\] layer 1 SSM state has shape \(1, .*7\), states\[0\] "
        r"has \(1, .*8\)",
    ):
        StateComposer("soup").compose([state, bad])


def test_dtype_mismatch(model, state):
    with pytest.raises(
        ValueError,
        match=r"past_states\[0\] was encoded with the model in torch.bfloat16, the model is "
        "now torch.float32; re-encode the contexts with the model in torch.float32",
    ):
        _generate(model, [state.to(dtype=torch.bfloat16)])
    with pytest.raises(
        ValueError,
        match=r"^states\[1\] was encoded in torch.bfloat16, states\[0\] in "
        "torch.float32; encode all contexts with the model in one dtype",
    ):
        StateComposer("soup").compose([state, state.to(dtype=torch.bfloat16)])


def test_device_mismatch(model, state):
    on_meta = state.to("meta")
    with pytest.raises(ValueError, match=r"past_states\[0\] is on meta, the model on cpu; use state.to\(device\)"):
        _generate(model, [on_meta])
    with pytest.raises(
        ValueError,
        match=r"^states\[1\] is on meta, states\[0\] on cpu; move them with "
        r"\.to\(device\)",
    ):
        StateComposer("soup").compose([state, on_meta])


def test_batch_mismatch(model, state):
    with torch.no_grad():
        two = ComposableMambaCache.encode(model, random_ids(4, batch=2))
    with pytest.raises(ValueError, match=r"^states\[1\] has batch size 2, states\[0\] has 1"):
        StateComposer("soup").compose([state, two])
    with pytest.raises(ValueError, match="past_states have batch size 2 but the query batch has 3 rows"):
        model.generate(random_ids(3, batch=3), past_states=[two], max_new_tokens=2)
    with pytest.raises(
        ValueError, match="past_states has 2 lists but the query batch has 3 rows; pass one list of states per row"
    ):
        model.generate(random_ids(3, batch=3), past_states=[[state], [state]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"past_states\[0\]\[0\] has batch size 2; per-row lists take batch-1 states"):
        model.generate(random_ids(3, batch=2), past_states=[[two], [state]], max_new_tokens=2)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nan_or_inf_in_a_state(model, state, bad_value):
    bad = state.clone()
    bad.ssm_states[0][0, 0, 0] = bad_value
    corrupted = "contains NaN or inf; the state is corrupted, re-encode the context"
    with pytest.raises(ValueError, match=r"^past_states\[1\]: layer 0 SSM state " + corrupted):
        _generate(model, [state, bad])
    with pytest.raises(ValueError, match=r"^past_states\[0\]: layer 0 SSM state " + corrupted):
        model(random_ids(3), past_states=[bad])
    bad = state.clone()
    bad.delta_sums[1][0, 0] = bad_value
    with pytest.raises(ValueError, match=r"^states\[1\]: layer 1 ΣΔ " + corrupted):
        StateComposer("picaso_r").compose([state, bad])


def test_bad_weights_and_methods(model, state):
    with pytest.raises(ValueError, match=r"weights must be non-negative, got \[1.5, -0.5\]"):
        StateComposer("weighted", weights=[1.5, -0.5])
    with pytest.raises(ValueError, match=r"weights must sum to 1 \(got 1.1\); normalise them"):
        StateComposer("weighted", weights=[0.5, 0.6])
    with pytest.raises(ValueError, match="weights contain NaN or inf"):
        StateComposer("weighted", weights=[float("nan"), 1.0])
    with pytest.raises(ValueError, match=r"method='weighted' needs weights=\[w_1, \.\.\., w_n\]"):
        StateComposer("weighted")
    with pytest.raises(ValueError, match="got 2 weights for 3 states; pass one weight per state"):
        StateComposer("weighted", weights=[0.5, 0.5]).compose([state, state, state])
    with pytest.raises(ValueError, match="unknown composition method 'picasso'"):
        StateComposer("picasso")
    with pytest.raises(ValueError, match="unknown conv policy 'median'; choose one of mean, last, weighted"):
        StateComposer("caso", conv="median")
    with pytest.raises(ValueError, match="method 'concat' re-encodes the context tokens: pass model="):
        StateComposer("concat").compose([state, state])
    composed = StateComposer("soup").compose([state, state])
    with pytest.raises(
        ValueError,
        match=r"this state does not carry its context tokens \(it was composed or "
        r"continued\); the 'concat' and 'piconcat_r' methods need states made by",
    ):
        StateComposer("concat").compose([composed, state], model=model)


def test_bad_generate_arguments(model, state):
    with pytest.raises(ValueError, match="unknown composition method 'mean'; choose one of soup, weighted, caso"):
        _generate(model, [state], composition="mean")
    with pytest.raises(ValueError, match=r"pass either past_states or a cache \(cache / cache_params\), not both"):
        _generate(model, [state], cache_params=state.clone())


def test_bad_encode_input(model):
    ids = random_ids(5, batch=2)
    right_padded = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"needs left padding .*: set tokenizer.padding_side = 'left'"):
        ComposableMambaCache.encode(model, ids, attention_mask=right_padded)
    with pytest.raises(ValueError, match=r"attention_mask: row 0 is a context of no tokens \(all padding\); it has no"):
        ComposableMambaCache.encode(model, ids, attention_mask=torch.tensor([[0] * 5, [1] * 5]))
    with pytest.raises(ValueError, match=r"input_ids \(shape \(1, 0\)\) is a context of no tokens; it has no state"):
        ComposableMambaCache.encode(model, torch.zeros(1, 0, dtype=torch.long))


def test_other_architectures_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    from hf_statecompose.state.architectures import supported_text, supported_types_text

    # the supported architectures, every row of the architecture table, listed by name and model_type
    assert "Falcon-H1 ('falcon_h1')" in supported_text() and "COFFEE ('coffee')" in supported_text()
    assert "'falcon_h1'" in supported_types_text() and len(supported_types_text()) < 300  # (the one-line error)
    with pytest.raises(
        TypeError, match=re.escape(f"supports the model types {supported_types_text()}; got model_type 'gpt2'")
    ):
        hsc.enable(gpt2)


def test_truncated_file(model, state, tmp_path):
    path = tmp_path / "s.safetensors"
    state.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError,
        match=r"is not a readable safetensors state file \(truncated or corrupted\?\).*; "
        "re-encode the context or restore the file",
    ):
        ComposableMambaCache.load(path, model=model)
    path.write_bytes(data[:5])
    with pytest.raises(
        ValueError,
        match=r"is not a safetensors state file \(truncated or corrupted\?: no safetensors "
        r"header\); re-encode the context or restore the file",
    ):
        ComposableMambaCache.load(path, model=model)


def test_corrupted_file(model, state, tmp_path):
    path = tmp_path / "s.safetensors"
    state.save(path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside the tensor data: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(
        ValueError,
        match=r"tensor data does not match its recorded digest \(corrupted file\); "
        "re-encode the context",
    ):
        ComposableMambaCache.load(path, model=model)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"is not a safetensors state file .*no safetensors header"):
        ComposableMambaCache.load(path)


def test_pickles_are_refused(model, state, tmp_path):
    torch_file = tmp_path / "state.pt"
    torch.save({"ssm": state.ssm_states[0]}, torch_file)
    refused = r"looks like a pickle / torch.save file; hf_statecompose never unpickles"
    with pytest.raises(ValueError, match=r"state\.pt " + refused):
        ComposableMambaCache.load(torch_file, model=model)
    raw = tmp_path / "state.pkl"
    raw.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match=r"state\.pkl " + refused):
        ComposableMambaCache.load(raw)


def test_load_into_another_model(arch, state, tmp_path):
    path = tmp_path / "s.safetensors"
    state.save(path)
    with pytest.raises(
        ValueError,
        match=r"s\.safetensors was encoded by .* but this model has fingerprint .*: "
        "re-encode the contexts with this model",
    ):
        ComposableMambaCache.load(path, model=tiny_model(arch, seed=3))
    with pytest.raises(ValueError, match=r"s.safetensors holds 2 layers, the model has 3; .*re-encode the context"):
        ComposableMambaCache.load(path, model=tiny_model(arch, layers=3))
