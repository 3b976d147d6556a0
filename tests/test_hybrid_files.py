"""Hybrid states (Mamba layers + attention layers) as files: ``state.save`` / ``ComposableMambaCache.load`` keep
every SSM layer and every attention layer's keys, values and positions, and refuse what today's state files refuse
(crafted shapes, dtypes and positions, NaN, another model's state, truncated or corrupted files)."""

import os

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.state.cache import ComposableMambaCache
from hf_statecompose.state.hybrid_cache import ComposableHybridCache

from architectures import hybrid_params, tiny_hybrid
from helpers import craft, random_ids, tiny_model


@pytest.fixture(scope="module")
def models():
    return {}


def model_of(models, arch, **kw):
    key = (arch, tuple(sorted(kw.items())))
    if key not in models:
        models[key] = tiny_hybrid(arch, **kw)
    return models[key]


def padded_batch(lengths, seed=0):
    """Left-padded ids and mask for contexts of ``lengths``."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = random_ids(n, generator=generator)[0]
        mask[row, width - n :] = 1
    return ids, mask


def assert_same_state(a, b):
    assert type(a) is type(b) and a.fingerprint == b.fingerprint and a.model_dtype == b.model_dtype
    assert a.layer_kinds == b.layer_kinds
    for x, y in zip(a.layers, b.layers):
        for name in ("ssm_state", "conv_state", "delta_sum", "A", "keys", "values", "positions"):
            u, v = getattr(x, name, None), getattr(y, name, None)
            assert (u is None) == (v is None), name
            if u is not None:
                assert u.dtype == v.dtype and torch.equal(u, v), name
    for u, v in ((a.num_tokens, b.num_tokens), (a.token_ids, b.token_ids)):
        assert (u is None and v is None) or torch.equal(u, v)


@pytest.mark.parametrize("arch", hybrid_params())
def test_round_trip_is_exact_and_generates_the_same(arch, models, tmp_path):
    model = model_of(models, arch)
    ids, mask = padded_batch([9, 5])  # a left-padded batch: positions -1 at the padding slots
    state = hsc.encode(model, ids, attention_mask=mask)
    assert isinstance(state, ComposableHybridCache) and state.attention_layers
    path = tmp_path / "s.safetensors"
    state.save(path)
    for loaded in (ComposableMambaCache.load(path, model=model), ComposableHybridCache.load(path)):
        assert_same_state(loaded, state)
    loaded = ComposableMambaCache.load(path, model=model)
    assert loaded.key_mask.tolist() == (mask > 0).tolist()
    query = random_ids(4, generator=torch.Generator().manual_seed(3))
    for row in range(2):
        expected = model.generate(query, past_states=[state[row]], max_new_tokens=5, do_sample=False)
        assert torch.equal(
            model.generate(query, past_states=[loaded[row]], max_new_tokens=5, do_sample=False), expected
        )


def test_composed_states_round_trip(models, tmp_path):
    model = model_of(models, "nemotron_h")
    ids, mask = padded_batch([7, 4], seed=1)
    state = hsc.encode(model, ids, attention_mask=mask)
    for attention in ("concat", "shared", "none"):
        composed = hsc.StateComposer("picaso_r", attention=attention).compose([state[0], state[1]])
        path = tmp_path / f"{attention}.safetensors"
        composed.save(path)
        loaded = ComposableMambaCache.load(path, model=model)
        assert_same_state(loaded, composed)
        if attention != "none":  # (a state with no keys does not run through the model's attention yet)
            query = random_ids(3)
            assert torch.equal(model(query, past_states=[loaded]).logits, model(query, past_states=[composed]).logits)


def test_bf16_keys_are_half_the_bytes_and_load_in_the_model_dtype(models, tmp_path):
    model = model_of(models, "granitemoehybrid")  # RoPE attention
    state = hsc.encode(model, random_ids(24))
    full, half = tmp_path / "full.safetensors", tmp_path / "half.safetensors"
    state.save(full)
    state.save(half, keys_dtype=torch.bfloat16)
    loaded = ComposableMambaCache.load(half, model=model)
    for layer, source in zip(loaded.attention_layers, state.attention_layers):
        assert layer.keys.dtype == torch.float32 and layer.values.dtype == torch.float32
        assert torch.equal(layer.keys, source.keys.to(torch.bfloat16).float())
        assert not torch.equal(layer.keys, source.keys)  # rounded
    keys_bytes = sum(l.keys.numel() + l.values.numel() for l in state.attention_layers) * 2
    assert abs(os.path.getsize(full) - os.path.getsize(half) - keys_bytes) < 64  # (the headers differ a little)
    query = random_ids(5)
    exact = model(query, past_states=[state]).logits
    rounded = model(query, past_states=[loaded]).logits
    assert 0 < (rounded - exact).abs().max() < 1e-2
    # and the model can go on from it (its attention concatenates float32 keys to these)
    model.generate(query, past_states=[loaded], max_new_tokens=3, do_sample=False)


def test_keys_dtype_is_checked(models, tmp_path):
    model = model_of(models, "nemotron_h")
    state = hsc.encode(model, random_ids(6))
    with pytest.raises(ValueError, match=r"keys_dtype must be torch.bfloat16, torch.float16 or the model dtype"):
        state.save(tmp_path / "s.safetensors", keys_dtype=torch.int8)
    with pytest.raises(TypeError, match="keys_dtype must be a torch dtype"):
        state.save(tmp_path / "s.safetensors", keys_dtype="bf16")
    with pytest.raises(ValueError, match="has none"):
        hsc.encode(tiny_model("mamba2"), random_ids(6)).save(tmp_path / "m.safetensors", keys_dtype=torch.bfloat16)
    big = state.clone()
    big.attention_layers[0].keys[0, 0, 0, 0] = 1e6  # beyond float16's 65504
    with pytest.raises(ValueError, match=r"overflow torch.float16"):
        big.save(tmp_path / "s.safetensors", keys_dtype=torch.float16)
    assert not os.path.exists(tmp_path / "s.safetensors")


def _set(name, fn):
    def edit(tensors, meta):
        tensors[name] = fn(tensors[name])

    return edit


def _positions(fn):
    return _set("attn.positions.1", fn)


def _not_left_padded(p):
    p = p.clone()
    p[0, -1] = -1  # a padding slot after real keys
    return p


def _below_minus_one(p):
    p = p.clone()
    p[0, 0] = -5
    return p


def _drop(name):
    def edit(tensors, meta):
        del tensors[name]

    return edit


def _meta(key, value):
    def edit(tensors, meta):
        meta[key] = value

    return edit


def _move_keys(tensors, meta):  # layer 1's keys stored as if layer 0 were the attention layer
    for kind in ("keys", "values", "positions"):
        tensors[f"attn.{kind}.0"] = tensors.pop(f"attn.{kind}.1")


CRAFTED = {
    "keys of another head count": (_set("attn.keys.1", lambda k: k[:, :1]), "keys have shape"),
    "values of another head dim": (_set("attn.values.1", lambda v: v[..., :4]), "values have shape"),
    "keys of another length than the values": (_set("attn.keys.1", lambda k: k[:, :, :3]), r"values have shape"),
    "keys in float64": (
        _set("attn.keys.1", lambda k: k.double()),
        "keys are torch.float64, its metadata records keys_dtype torch.float32",
    ),
    "keys in bfloat16 recorded as float32": (
        _set("attn.values.1", lambda v: v.bfloat16()),
        "values are torch.bfloat16, its metadata records",
    ),
    "NaN in the keys": (
        _set("attn.keys.1", lambda k: k.index_fill(2, torch.tensor([2]), float("nan"))),
        "keys contains NaN",
    ),
    "inf in the values": (
        _set("attn.values.1", lambda v: v.index_fill(2, torch.tensor([0]), float("inf"))),
        "values contains NaN or inf",
    ),
    "float positions": (_positions(lambda p: p.double()), "positions must be an int64 tensor"),
    "positions of another length": (_positions(lambda p: p[:, 1:]), "positions must be an int64 tensor of shape"),
    "positions not left padded": (_positions(_not_left_padded), "not left padded"),
    "positions below -1": (_positions(_below_minus_one), "below -1"),
    "no values": (_drop("attn.values.1"), "missing tensors"),
    "no positions": (_drop("attn.positions.1"), "missing tensors"),
    "keys of an SSM layer": (
        _move_keys,
        r"attention keys for model layers \[0\], (its recorded config|the model) has attention layers \[1\]",
    ),
    "an extra attention layer": (
        lambda t, m: t.update({f"attn.{k}.3": t[f"attn.{k}.1"] for k in ("keys", "values", "positions")}),
        r"model layers \[1, 3\]",
    ),
    "no keys_dtype": (lambda t, m: m.pop("keys_dtype"), "records no keys_dtype"),
    "keys_dtype int8": (_meta("keys_dtype", "torch.int8"), "keys_dtype 'torch.int8' is not the model dtype"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_files_are_refused(case, models, tmp_path):
    model = model_of(models, "nemotron_h")  # layers M * - M: the attention layer is model layer 1
    source = tmp_path / "s.safetensors"
    hsc.encode(model, *padded_batch([6, 4], seed=2)).save(source)
    edit, message = CRAFTED[case]
    path = craft(source, tmp_path / "crafted.safetensors", edit)
    for kwargs in ({}, {"model": model}):
        with pytest.raises(ValueError, match=message):
            ComposableMambaCache.load(path, **kwargs)


def test_positions_that_differ_across_attention_layers_are_refused(tmp_path):
    model = tiny_hybrid("nemotron_h", hybrid_override_pattern="M*M*")
    source = tmp_path / "s.safetensors"
    state = hsc.encode(model, random_ids(5))
    assert state.attention_layer_indices == (1, 3)
    state.save(source)
    path = craft(source, tmp_path / "c.safetensors", _set("attn.positions.3", lambda p: p + 1))
    with pytest.raises(ValueError, match=r"layer 3 \(attention\) positions differ from layer 1's"):
        ComposableMambaCache.load(path, model=model)


def test_a_state_of_another_model_is_refused(models, tmp_path):
    model = model_of(models, "nemotron_h")
    path = tmp_path / "s.safetensors"
    hsc.encode(model, random_ids(5)).save(path)
    with pytest.raises(ValueError, match="states only fit the exact model"):
        ComposableMambaCache.load(path, model=tiny_hybrid("nemotron_h", seed=1))  # other weights
    with pytest.raises(ValueError, match="belongs to another model"):  # attention at another layer
        ComposableMambaCache.load(path, model=tiny_hybrid("nemotron_h", hybrid_override_pattern="MM*-"))
    with pytest.raises(ValueError, match="'nemotron_h' model, this model is 'bamba'"):
        ComposableMambaCache.load(path, model=model_of(models, "bamba"))
    with pytest.raises(ValueError, match="belongs to another model"):
        ComposableMambaCache.load(path, model=tiny_model("mamba2"))


def test_truncated_and_corrupted_files_are_refused(models, tmp_path):
    model = model_of(models, "bamba")
    path = tmp_path / "s.safetensors"
    hsc.encode(model, random_ids(7)).save(path)
    data = path.read_bytes()
    state = ComposableMambaCache.load(path, model=model)
    header = int.from_bytes(data[:8], "little") + 8
    keys = state.attention_layers[0].keys
    # flip one byte inside the keys (the last tensor bytes before the end are somewhere in the data section)
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        assert "attn.keys.1" in handle.keys()
    import json

    offsets = json.loads(data[8:header])["attn.keys.1"]["data_offsets"]
    flipped = bytearray(data)
    flipped[header + offsets[0] + 5] ^= 0x40
    (tmp_path / "flipped.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="does not match its recorded digest"):
        ComposableMambaCache.load(tmp_path / "flipped.safetensors", model=model)
    for cut in (header - 10, header + offsets[0] + 3, len(data) - 1):
        (tmp_path / "cut.safetensors").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated or corrupted"):
            ComposableMambaCache.load(tmp_path / "cut.safetensors", model=model)
    assert keys.numel()
