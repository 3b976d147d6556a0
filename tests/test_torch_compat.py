"""The adapter for torch's internals (hf_statecompose._torch_compat) and what the fingerprint asks of torch.

* each private call the adapter makes is removed in turn (as on a torch without it): the fingerprint cache falls
  back to checking contents and still sees a weight change;
* the weights the forward uses are hashed: a parametrization's Python state changes the fingerprint;
* a ``torch.compile``d model takes ``past_states`` as the eager one does; offloaded weights are refused, naming
  offload.

The test command installs one torch (constraints.txt); these run on it.
"""

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, _torch_compat
from hf_statecompose.state import fingerprint
from hf_statecompose.state.fingerprint import model_fingerprint

from helpers import random_ids, tiny_model


def _weight(model):
    return model.backbone.layers[0].mixer.in_proj.weight


# ------------------------------------------------------------------------------------------ copy-on-write fallback
def test_the_installed_torch_has_copy_on_write():
    """On the torch the test command installs, the cache's sentinel works (the fallback tests below are not the
    only path run)."""
    assert _torch_compat.copy_on_write_available()
    t = torch.randn(64, 64)
    assert not _torch_compat.is_copy_on_write(t)
    assert _torch_compat.make_copy_on_write(t) and _torch_compat.is_copy_on_write(t)
    t.add_(1)
    assert not _torch_compat.is_copy_on_write(t)  # written: materialized


@pytest.mark.parametrize("missing", ["_lazy_clone", "_C._is_cow_tensor", "both"])
def test_without_copy_on_write_the_cache_checks_contents_and_sees_edits(monkeypatch, missing):
    monkeypatch.setattr(fingerprint, "_ARMED_ABOVE", 128)
    if missing in ("_lazy_clone", "both"):
        monkeypatch.delattr(torch, "_lazy_clone")
    if missing in ("_C._is_cow_tensor", "both"):
        monkeypatch.delattr(torch._C, "_is_cow_tensor")
    assert not _torch_compat.copy_on_write_available()
    assert not _torch_compat.make_copy_on_write(torch.randn(64, 64))
    model = tiny_model("mamba2")
    before = model_fingerprint(model)
    checksums = []
    real = fingerprint._content_checksum
    monkeypatch.setattr(fingerprint, "_content_checksum", lambda tensors: checksums.append(1) or real(tensors))
    assert model_fingerprint(model) == before
    assert checksums  # the large weights were checked by their contents: the fallback path
    _weight(model).data[3, 5] += 0.25  # a write through .data: no version bump, only the contents tell
    assert model_fingerprint(model) != before
    assert model_fingerprint(model) == model_fingerprint(model, cache=False)


def test_without_storage_and_version_reads_the_cache_still_sees_edits(monkeypatch):
    """A torch whose storages have no ``_cdata`` and tensors no ``_version``: identity is not read, the rest of the
    check (copy-on-write, exact bytes, checksums) still sees in-place edits and replaced storages."""

    def missing(self):
        raise AttributeError("not on this torch")

    monkeypatch.setattr(fingerprint, "_ARMED_ABOVE", 128)
    monkeypatch.setattr(torch.UntypedStorage, "_cdata", property(missing), raising=False)
    monkeypatch.setattr(torch.Tensor, "_version", property(missing), raising=False)
    assert _torch_compat.storage_id(torch.zeros(1)) is None and _torch_compat.version(torch.zeros(1)) is None
    model = tiny_model("mamba2")
    before = model_fingerprint(model)
    assert model_fingerprint(model) == before
    with torch.no_grad():
        _weight(model)[1, 2] += 0.5  # in place, not through .data
    edited = model_fingerprint(model)
    assert edited != before and edited == model_fingerprint(model, cache=False)
    _weight(model).data = _weight(model).data.flip(0).contiguous()  # a new storage
    assert model_fingerprint(model) != edited
    assert model_fingerprint(model) == model_fingerprint(model, cache=False)


# ------------------------------------------------------------------------------------------ only the adapter
def test_the_fake_tensor_check_goes_through_the_adapter():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(2)
    assert _torch_compat.is_fake_tensor(fake) and hsc.compat.is_tracing(fake)
    assert not _torch_compat.is_fake_tensor(torch.empty(2)) and not hsc.compat.is_tracing(torch.empty(2))


# ------------------------------------------------------------------------------------------ parametrizations
class _Scale(torch.nn.Module):
    """A parametrization with Python state: the weight the forward uses is ``s`` times the stored one."""

    def __init__(self):
        super().__init__()
        self.s = 1.0

    def forward(self, x):
        return x * self.s


def _parametrized(arch="mamba", armed=False, monkeypatch=None):
    if armed:
        monkeypatch.setattr(fingerprint, "_ARMED_ABOVE", 128)
    model = tiny_model(arch)
    scale = _Scale()
    torch.nn.utils.parametrize.register_parametrization(model.backbone.layers[0].mixer.in_proj, "weight", scale)
    return model, scale


@pytest.mark.parametrize("armed", [False, True], ids=["small", "armed"])
def test_a_parametrization_s_python_state_changes_the_fingerprint(monkeypatch, armed):
    model, scale = _parametrized(armed=armed, monkeypatch=monkeypatch)
    with torch.no_grad():
        state = ComposableMambaCache.encode(model, random_ids(6))
    ids = random_ids(3)
    model(ids, past_states=[state])  # the same parametrization: accepted
    model(ids, past_states=[state])
    scale.s = 3.0  # no tensor changed: the weight the forward uses did
    with pytest.raises(ValueError, match="re-encode the contexts with this model"):
        model(ids, past_states=[state])
    assert model_fingerprint(model) == model_fingerprint(model, cache=False) != state.fingerprint
    scale.s = 1.0
    model(ids, past_states=[state])  # back to the weights it was encoded with: accepted again


def test_the_fingerprint_hashes_the_weight_the_forward_uses():
    """The weight computed through the parametrization is hashed, not the stored tensor
    (``parametrizations.weight.original``): the same weight in use, however it is split between the stored tensor
    and the parametrization's state, gives the same fingerprint."""
    model, scale = _parametrized()
    other, _ = _parametrized()
    names = [name for name, _ in fingerprint._state_shaping_tensors(model)]
    assert "layers.0.mixer.in_proj.weight" in names and not any("parametrizations" in name for name in names)
    assert model_fingerprint(model) == model_fingerprint(other)
    scale.s = 2.0
    assert model_fingerprint(model) != model_fingerprint(other)
    with torch.no_grad():
        other.backbone.layers[0].mixer.in_proj.parametrizations.weight.original.mul_(2)
    assert model_fingerprint(model) == model_fingerprint(other) == model_fingerprint(other, cache=False)


# ------------------------------------------------------------------------------------------ torch.compile
def test_a_compiled_model_takes_past_states_as_the_eager_one():
    """``torch.compile(model)`` (backend "eager": fast; dynamo traces the same code for every backend): the
    fingerprint runs eagerly on the real weights (graph break) and is the wrapped model's."""
    model = tiny_model("mamba")
    with torch.no_grad():
        states = [ComposableMambaCache.encode(model, random_ids(n)) for n in (5, 7)]
    ids = random_ids(4)
    compiled = torch.compile(model, backend="eager")
    assert model_fingerprint(compiled) == model_fingerprint(model)
    with torch.no_grad():
        expected = model(ids, past_states=states).logits
        torch.testing.assert_close(compiled(ids, past_states=states).logits, expected, rtol=1e-5, atol=1e-5)
    eager = model.generate(ids, past_states=states, max_new_tokens=4, do_sample=False)
    assert torch.equal(compiled.generate(ids, past_states=states, max_new_tokens=4, do_sample=False), eager)
    _weight(model).data.mul_(2)  # still refused after a weight change
    with pytest.raises(ValueError, match="re-encode the contexts with this model"):
        compiled(ids, past_states=states)


# ------------------------------------------------------------------------------------------ offloaded weights
def test_offloaded_weights_are_refused_naming_offload():
    from accelerate import cpu_offload

    model = tiny_model("mamba")
    with torch.no_grad():
        state = ComposableMambaCache.encode(model, random_ids(6))
    ids = random_ids(3)
    model(ids, past_states=[state])  # before offload: accepted
    cpu_offload(model, execution_device=torch.device("cpu"))
    model(ids)  # the offloaded model runs (accelerate's hooks load the weights at each forward)
    with pytest.raises(ValueError, match=r"meta device.*offload.*does not encode or compose states with offloaded"):
        model(ids, past_states=[state])
    with pytest.raises(ValueError, match=r"meta device.*offload"):
        ComposableMambaCache.encode(model, random_ids(4))
