"""Bad input gets a clear ValueError / TypeError naming the problem and the fix."""
import pickle

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
    with pytest.raises(ValueError, match="empty"):
        _generate(model, [])
    with pytest.raises(ValueError, match="empty"):
        StateComposer("picaso_s").compose([])


def test_not_a_state(model, state):
    with pytest.raises(TypeError, match="ComposableMambaCache"):
        _generate(model, [state, torch.zeros(3)])
    with pytest.raises(TypeError, match="list"):
        _generate(model, state)
    with pytest.raises(ValueError, match="no state"):
        _generate(model, [ComposableMambaCache.empty_for(model)])


def test_state_from_another_model(arch, state, model):
    other = tiny_model(arch, seed=7)  # same config, other weights
    with pytest.raises(ValueError, match="re-encode the contexts with this model"):
        _generate(other, [state])
    with torch.no_grad():
        foreign = ComposableMambaCache.encode(other, random_ids(5))
    with pytest.raises(ValueError, match="different model"):
        StateComposer("soup").compose([state, foreign])


def test_state_from_another_config(arch, state):
    deeper = tiny_model(arch, layers=3)
    with pytest.raises(ValueError, match="3"):
        _generate(deeper, [state])
    wider = tiny_model(arch, conv_kernel=2)
    with pytest.raises(ValueError, match="re-encode"):
        _generate(wider, [state])


def test_shape_tampering_is_caught(model, state):
    bad = state.clone()
    bad.layers[1].ssm_state = bad.ssm_states[1][..., :-1]
    with pytest.raises(ValueError, match="shape"):
        _generate(model, [bad])
    with pytest.raises(ValueError, match="shape"):
        StateComposer("soup").compose([state, bad])


def test_dtype_mismatch(model, state):
    with pytest.raises(ValueError, match="bfloat16"):
        _generate(model, [state.to(dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="dtype|encoded in"):
        StateComposer("soup").compose([state, state.to(dtype=torch.bfloat16)])


def test_device_mismatch(model, state):
    on_meta = state.to("meta")
    with pytest.raises(ValueError, match="meta"):
        _generate(model, [on_meta])
    with pytest.raises(ValueError, match="meta"):
        StateComposer("soup").compose([state, on_meta])


def test_batch_mismatch(model, state):
    with torch.no_grad():
        two = ComposableMambaCache.encode(model, random_ids(4, batch=2))
    with pytest.raises(ValueError, match="batch size"):
        StateComposer("soup").compose([state, two])
    with pytest.raises(ValueError, match="batch"):
        model.generate(random_ids(3, batch=3), past_states=[two], max_new_tokens=2)
    with pytest.raises(ValueError, match="one list of states per row"):
        model.generate(random_ids(3, batch=3), past_states=[[state], [state]], max_new_tokens=2)
    with pytest.raises(ValueError, match="batch-1"):
        model.generate(random_ids(3, batch=2), past_states=[[two], [state]], max_new_tokens=2)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_nan_or_inf_in_a_state(model, state, bad_value):
    bad = state.clone()
    bad.ssm_states[0][0, 0, 0] = bad_value
    with pytest.raises(ValueError, match="NaN or inf"):
        _generate(model, [state, bad])
    with pytest.raises(ValueError, match="NaN or inf"):
        model(random_ids(3), past_states=[bad])
    bad = state.clone()
    bad.delta_sums[1][0, 0] = bad_value
    with pytest.raises(ValueError, match="NaN or inf"):
        StateComposer("picaso_r").compose([state, bad])


def test_bad_weights_and_methods(model, state):
    with pytest.raises(ValueError, match="non-negative"):
        StateComposer("weighted", weights=[1.5, -0.5])
    with pytest.raises(ValueError, match="sum to 1"):
        StateComposer("weighted", weights=[0.5, 0.6])
    with pytest.raises(ValueError, match="NaN"):
        StateComposer("weighted", weights=[float("nan"), 1.0])
    with pytest.raises(ValueError, match="weights="):
        StateComposer("weighted")
    with pytest.raises(ValueError, match="one weight per state"):
        StateComposer("weighted", weights=[0.5, 0.5]).compose([state, state, state])
    with pytest.raises(ValueError, match="unknown composition method 'picasso'"):
        StateComposer("picasso")
    with pytest.raises(ValueError, match="unknown conv policy"):
        StateComposer("caso", conv="median")
    with pytest.raises(ValueError, match="pass model="):
        StateComposer("concat").compose([state, state])
    composed = StateComposer("soup").compose([state, state])
    with pytest.raises(ValueError, match="context tokens"):
        StateComposer("concat").compose([composed, state], model=model)


def test_bad_generate_arguments(model, state):
    with pytest.raises(ValueError, match="unknown composition method"):
        _generate(model, [state], composition="mean")
    with pytest.raises(ValueError, match="not both"):
        _generate(model, [state], cache_params=state.clone())


def test_bad_encode_input(model):
    ids = random_ids(5, batch=2)
    right_padded = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match="left padding"):
        ComposableMambaCache.encode(model, ids, attention_mask=right_padded)
    with pytest.raises(ValueError, match="all padding"):
        ComposableMambaCache.encode(model, ids, attention_mask=torch.tensor([[0] * 5, [1] * 5]))
    with pytest.raises(ValueError, match="non-empty"):
        ComposableMambaCache.encode(model, torch.zeros(1, 0, dtype=torch.long))


def test_other_architectures_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(TypeError, match="Mamba"):
        hsc.enable(gpt2)


def test_truncated_file(model, state, tmp_path):
    path = tmp_path / "s.safetensors"
    state.save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        ComposableMambaCache.load(path, model=model)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        ComposableMambaCache.load(path, model=model)


def test_corrupted_file(model, state, tmp_path):
    path = tmp_path / "s.safetensors"
    state.save(path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside the tensor data: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupted"):
        ComposableMambaCache.load(path, model=model)
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="safetensors"):
        ComposableMambaCache.load(path)


def test_pickles_are_refused(model, state, tmp_path):
    torch_file = tmp_path / "state.pt"
    torch.save({"ssm": state.ssm_states[0]}, torch_file)
    with pytest.raises(ValueError, match="pickle"):
        ComposableMambaCache.load(torch_file, model=model)
    raw = tmp_path / "state.pkl"
    raw.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="pickle"):
        ComposableMambaCache.load(raw)


def test_load_into_another_model(arch, state, tmp_path):
    path = tmp_path / "s.safetensors"
    state.save(path)
    with pytest.raises(ValueError, match="re-encode"):
        ComposableMambaCache.load(path, model=tiny_model(arch, seed=3))
    with pytest.raises(ValueError, match="layers"):
        ComposableMambaCache.load(path, model=tiny_model(arch, layers=3))
