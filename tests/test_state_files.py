"""State files and fingerprints never give a silent wrong answer.

Every crafted file below is a valid safetensors file whose digest was recomputed with the module's own
``_digest``: only the schema / model checks can catch it.
"""

import copy
import json
import pickle

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from hf_statecompose import ComposableMambaCache, StateComposer
from hf_statecompose.state import serialization
from hf_statecompose.state.fingerprint import model_fingerprint
from hf_statecompose.state.validation import check_state

from helpers import pickle_round_trip, random_ids, tiny_model, torch_save_round_trip


@pytest.fixture
def state(model):
    with torch.no_grad():
        return ComposableMambaCache.encode(
            model, random_ids(6, batch=2), attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
        )


@pytest.fixture
def saved(state, tmp_path):
    path = tmp_path / "s.safetensors"
    state.save(path)
    return path


def _parts(path):
    with safe_open(path, framework="pt") as handle:
        meta = json.loads(handle.metadata()["hf_statecompose"])
    return load_file(path), meta


def _write(path, tensors, meta):
    meta = dict(meta, tensor_digest=serialization._digest(tensors))
    path.write_bytes(save(tensors, metadata={"hf_statecompose": json.dumps(meta)}))
    return path


def _craft(saved, edit):
    tensors, meta = _parts(saved)
    edit(tensors, meta)
    return _write(saved.parent / "crafted.safetensors", tensors, meta)


def _set(name, fn):
    def edit(tensors, meta):
        tensors[name] = fn(tensors[name])

    return edit


def _batch2_in_layer1(tensors, meta):
    for kind in ("ssm", "conv", "delta_sum"):
        tensors[f"{kind}.1"] = torch.cat([tensors[f"{kind}.1"], tensors[f"{kind}.1"][:1]])


# (id, edit, message) : caught by the file alone, with or without the model
CRAFTED = [
    (
        "ssm int32",
        _set("ssm.0", lambda t: t.to(torch.int32)),
        "layer 0 SSM state is torch.int32, expected torch.float32",
    ),
    ("conv bool", _set("conv.1", lambda t: t > 0), "layer 1 conv window is torch.bool"),
    (
        "conv fp16, model fp32",
        _set("conv.0", lambda t: t.half()),
        "conv window is torch.float16, expected torch.float32",
    ),
    ("ssm fp16", _set("ssm.1", lambda t: t.half()), "SSM state is torch.float16"),
    ("delta_sum fp64", _set("delta_sum.0", lambda t: t.double()), "ΣΔ is torch.float64"),
    ("A fp16", _set("A.0", lambda t: t.half()), "A is torch.float16"),
    ("ssm shape", _set("ssm.1", lambda t: t[..., :-1].contiguous()), "SSM state has shape"),
    ("conv shape", _set("conv.0", lambda t: t[:, :-1].contiguous()), "conv window has shape"),
    ("delta_sum shape", _set("delta_sum.1", lambda t: t[:, :1].contiguous()), "ΣΔ has shape"),
    ("A shape", _set("A.0", lambda t: t.reshape(-1)[:1].contiguous()), "A has shape"),
    ("batch 2 in one layer", _batch2_in_layer1, "batch 2 as in layer 0"),
    ("negative delta_sum", _set("delta_sum.0", lambda t: -t - 0.1), "ΣΔ has negative entries"),
    (
        "nan delta_sum",
        _set("delta_sum.1", lambda t: t.index_fill(1, torch.tensor([0]), float("nan"))),
        "ΣΔ contains NaN",
    ),
    ("positive A", _set("A.1", lambda t: -t), "A must be finite and <= 0"),
    ("nan A", _set("A.0", lambda t: t.index_fill(0, torch.tensor([0]), float("nan"))), "A must be finite and <= 0"),
    ("num_tokens int32", _set("num_tokens", lambda t: t.int()), "num_tokens must be an int64"),
    ("num_tokens negative", _set("num_tokens", lambda t: -t), "negative counts"),
    ("num_tokens vs token_ids", _set("num_tokens", lambda t: t + 1), "num_tokens says"),
    ("token id beyond vocab", _set("token_ids", lambda t: t.index_fill(1, torch.tensor([3]), 10_000)), "outside"),
    ("token_ids right padded", _set("token_ids", lambda t: t.flip(1)), "left padded"),
    ("unknown tensor", lambda t, m: t.update({"extra": torch.zeros(1)}), "unexpected tensors \\['extra'\\]"),
    ("missing tensor", lambda t, m: t.pop("delta_sum.1"), "missing tensors \\['delta_sum.1'\\]"),
    (
        "model_dtype says fp16",
        lambda t, m: m.update(model_dtype="torch.float16"),
        "conv window is torch.float32, expected torch.float16",
    ),
    ("unknown model_dtype", lambda t, m: m.update(model_dtype="torch.int8"), "unknown model dtype"),
    ("num_layers vs config", lambda t, m: m.update(num_layers=1), "config has 2 layers, the metadata says 1"),
    (
        "architecture vs config",
        lambda t, m: m.update(architecture="mamba" if m["architecture"] == "mamba2" else "mamba2"),
        "metadata says",
    ),
    ("fingerprint not a string", lambda t, m: m.update(fingerprint=123), "'fingerprint' must be a str"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED])
def test_crafted_files_are_refused(model, saved, edit, message):
    crafted = _craft(saved, edit)
    with pytest.raises(ValueError, match=message):
        ComposableMambaCache.load(crafted)
    with pytest.raises(ValueError):
        ComposableMambaCache.load(crafted, model=model)


def test_the_untouched_file_loads(model, saved, state):
    # the crafting itself changes nothing: a re-written copy loads and equals the state
    copy_ = _craft(saved, lambda t, m: None)
    for loaded in (ComposableMambaCache.load(copy_), ComposableMambaCache.load(copy_, model=model)):
        for i in range(state.num_layers):
            assert torch.equal(loaded.ssm_states[i], state.ssm_states[i])
            assert torch.equal(loaded.delta_sums[i], state.delta_sums[i])
            assert torch.equal(loaded.A[i], state.A[i])
        assert torch.equal(loaded.token_ids, state.token_ids)


@pytest.mark.parametrize("scale", [2.0, 1.001])
def test_A_that_is_not_the_models_is_refused(model, saved, scale):
    # still finite and <= 0, so only the model can tell
    crafted = _craft(saved, _set("A.1", lambda t: t * scale))
    loaded = ComposableMambaCache.load(crafted)
    with pytest.raises(ValueError, match="layer 1 A is not this model's -exp\\(A_log\\)"):
        ComposableMambaCache.load(crafted, model=model)
    # loaded without the model, then used with it: generate checks A too
    with pytest.raises(ValueError, match="layer 1 A is not this model's"):
        model.generate(random_ids(3, batch=2), past_states=[loaded], max_new_tokens=2, do_sample=False)


def test_metadata_that_is_not_an_object(saved):
    tensors, meta = _parts(saved)
    path = saved.parent / "list.safetensors"
    path.write_bytes(save(tensors, metadata={"hf_statecompose": json.dumps([meta])}))
    with pytest.raises(ValueError, match="not an object"):
        ComposableMambaCache.load(path)


def test_save_refuses_a_state_that_would_not_load(state, tmp_path):
    bad = state.clone()
    bad.delta_sums[0] = -bad.delta_sums[0] - 1
    with pytest.raises(ValueError, match="negative"):
        bad.save(tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


def test_check_state_in_memory(model, state):
    check_state(state, model)
    bad = state.clone()
    bad.set_layer(
        1,
        ssm_state=bad.ssm_states[1][:1],
        conv_state=bad.conv_states[1][:1],
        delta_sum=bad.delta_sums[1][:1],
        A=bad.A[1],
    )
    with pytest.raises(ValueError, match="batch 2 as in layer 0"):
        check_state(bad)
    bad = state.clone()
    bad.A[0] = bad.A[0] * 3
    check_state(bad)  # alone it is a plausible A
    with pytest.raises(ValueError, match="layer 0 A is not this model's"):
        check_state(bad, model)


# ------------------------------------------------------------------ dtype policy: refuse, never convert


def test_fp32_state_into_a_half_model_is_refused(arch, saved, state):
    half = tiny_model(arch, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"re-encode the contexts with the model in torch.float16"):
        ComposableMambaCache.load(saved, model=half)
    with pytest.raises(ValueError, match=r"torch.float16"):
        half.generate(random_ids(3, batch=2), past_states=[state], max_new_tokens=2)


def test_half_state_into_an_fp32_model_is_refused(arch, model, tmp_path):
    half = tiny_model(arch, dtype=torch.float16)
    with torch.no_grad():
        state = ComposableMambaCache.encode(half, random_ids(5))
    path = tmp_path / "half.safetensors"
    state.save(path)
    assert ComposableMambaCache.load(path, model=half).conv_states[0].dtype == torch.float16
    with pytest.raises(ValueError, match=r"re-encode the contexts with the model in torch.float32"):
        ComposableMambaCache.load(path, model=model)
    # converting by hand does not sneak it in either: the fingerprint covers the weights' dtype
    with pytest.raises(ValueError, match="re-encode"):
        model.generate(random_ids(3), past_states=[state.to(dtype=torch.float32)], max_new_tokens=2)


# ------------------------------------------------------------------ the pickle sniff


def _file_with_header_start(state, first: int, second: int | None, tmp_path):
    """A valid state file whose 8-byte header length starts with ``first`` (and ``second``): the header
    is padded through the config's ``_name_or_path`` (what a model path of some length does). Each
    character adds one byte to the header, which safetensors then pads to a multiple of 8."""
    state.config._name_or_path = ""
    base = int.from_bytes(serialization.serialize_state(state)[:8], "little")
    step = 256 if second is None else 65536
    target = first + 256 * (second or 0)
    while target < base:
        target += step
    for length in range(max(0, target - base - 8), target - base + 9):
        state.config._name_or_path = "m" * length
        payload = serialization.serialize_state(state)
        if payload[0] == first and (second is None or payload[1] == second):
            path = tmp_path / f"header-{first:02x}.safetensors"
            path.write_bytes(payload)
            return path
    raise AssertionError("no padding gives that header length")


@pytest.mark.parametrize("second", [None, 0x02, 0x04])
def test_valid_file_starting_like_a_pickle_loads(model, state, tmp_path, second):
    # 0x80 then a protocol number is how a pickle starts; here it is just the header length
    path = _file_with_header_start(state, 0x80, second, tmp_path)
    loaded = ComposableMambaCache.load(path, model=model)
    assert torch.equal(loaded.ssm_states[0], state.ssm_states[0])


def test_real_pickles_and_zips_are_still_refused(state, tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"ssm": state.ssm_states[0]}, legacy, _use_new_zipfile_serialization=False)
    zipped = tmp_path / "zipped.pt"
    torch.save(state.ssm_states[0], zipped)
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps([1, 2, 3], protocol=5))
    for path in (legacy, zipped, raw):
        with pytest.raises(ValueError, match="pickle"):
            ComposableMambaCache.load(path)


def test_truncated_header_is_named_truncated(saved):
    data = saved.read_bytes()
    header_length = int.from_bytes(data[:8], "little")
    saved.write_bytes(data[: 8 + header_length // 2])
    with pytest.raises(ValueError, match="truncated"):
        ComposableMambaCache.load(saved)


# ------------------------------------------------------------------ copies keep their behaviour


@pytest.mark.parametrize(
    "round_trip", [copy.deepcopy, pickle_round_trip, torch_save_round_trip], ids=["deepcopy", "pickle", "torch.save"]
)
def test_copies_compose_and_generate_the_same(model, round_trip):
    with torch.no_grad():
        a = ComposableMambaCache.encode(model, random_ids(7))
        b = ComposableMambaCache.encode(model, random_ids(4))
    a2, b2 = round_trip(a), round_trip(b)
    assert type(a2) is ComposableMambaCache and a2.fingerprint == a.fingerprint and a2.model_dtype == a.model_dtype
    assert torch.equal(a2.token_ids, a.token_ids) and torch.equal(a2.num_tokens, a.num_tokens)
    for method in ("soup", "picaso_r"):
        composed, composed2 = (StateComposer(method).compose(pair) for pair in ([a, b], [a2, b2]))
        for i in range(a.num_layers):
            assert torch.equal(composed.ssm_states[i], composed2.ssm_states[i])
            assert torch.equal(composed.delta_sums[i], composed2.delta_sums[i])
    ids = random_ids(3)
    kwargs = dict(max_new_tokens=4, do_sample=False, composition="picaso_r")
    assert torch.equal(
        model.generate(ids, past_states=[a, b], **kwargs), model.generate(ids, past_states=[a2, b2], **kwargs)
    )
    a2.ssm_states[0].add_(1.0)  # a copy, not a view
    assert not torch.equal(a2.ssm_states[0], a.ssm_states[0])


# ------------------------------------------------------------------ fingerprint cache


def _first_mixer_weight(model):
    return model.backbone.layers[0].mixer.in_proj.weight


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p.data.copy_(p.data * 1.5),  # .data: no _version bump
        lambda p: p.data.__setitem__((0, 0), p.data[0, 0] + 1.0),  # one element through .data
        lambda p: p.data.mul_(-1.0),
        lambda p: setattr(p, "data", p.data.flip(0).contiguous()),  # a new tensor
    ],
    ids=["data.copy_", "data[0,0]", "data.mul_", "data="],
)
def test_fingerprint_follows_changes_through_data(model, change):
    before = model_fingerprint(model)
    change(_first_mixer_weight(model))
    after = model_fingerprint(model)
    assert after != before
    assert after == model_fingerprint(model, cache=False)


def test_fingerprint_follows_load_state_dict_and_in_place_edits(arch, model):
    other = tiny_model(arch, seed=5)
    model_fingerprint(model)
    model.load_state_dict(other.state_dict())
    assert model_fingerprint(model) == model_fingerprint(other) == model_fingerprint(model, cache=False)
    with torch.no_grad():
        model.backbone.layers[1].mixer.A_log.add_(0.25)
    assert model_fingerprint(model) != model_fingerprint(other)
    assert model_fingerprint(model) == model_fingerprint(model, cache=False)


def test_fingerprint_after_a_dtype_round_trip(model):
    before = model_fingerprint(model)
    model.to(torch.float16).to(torch.float32)  # weights rounded to fp16: another model now
    after = model_fingerprint(model)
    assert after == model_fingerprint(model, cache=False)
    assert after != before


def test_fingerprint_cache_is_used_when_nothing_changed(model, monkeypatch):
    from hf_statecompose.state import fingerprint

    model_fingerprint(model)
    calls = []
    original = fingerprint._full_fingerprint
    monkeypatch.setattr(fingerprint, "_full_fingerprint", lambda *a: calls.append(1) or original(*a))
    model_fingerprint(model)
    model_fingerprint(model)
    assert calls == []
    with torch.no_grad():
        _first_mixer_weight(model).data[1, 2] += 0.5
    model_fingerprint(model)
    assert calls == [1]


def test_states_of_old_weights_are_refused_after_a_data_edit(model):
    with torch.no_grad():
        state = ComposableMambaCache.encode(model, random_ids(5))
    model.generate(random_ids(3), past_states=[state], max_new_tokens=1)  # caches the fingerprint
    _first_mixer_weight(model).data.mul_(1.5)
    with pytest.raises(ValueError, match="re-encode the contexts with this model"):
        model.generate(random_ids(3), past_states=[state], max_new_tokens=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fingerprint_follows_data_edits_in_16_bit(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    weight = _first_mixer_weight(model)
    before = model_fingerprint(model)
    weight.data[3, 5] += 0.5  # one element, through .data
    after = model_fingerprint(model)
    assert after != before and after == model_fingerprint(model, cache=False)
    weight.data.copy_(weight.data.flip(1))  # a permutation within every row: row sums unchanged
    assert model_fingerprint(model) != after
    assert model_fingerprint(model) == model_fingerprint(model, cache=False)
