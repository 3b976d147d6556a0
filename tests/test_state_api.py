"""One state API for the composer, each ΣΔ rule once, one verdict per call (issue 29, items 2 and 10).

* ``hf_statecompose/composition/`` builds states through the states' public constructors (``empty_like``,
  ``filled_like``, ``shallow_copy``, ``finish_composition``): no ``obj._private`` access there;
* the composed ΣΔ is the method registry's rule (``CompositionMethod.delta_sum``) on the native and the torch
  path alike, for the built-in methods and for a registered one;
* ``generate`` / ``forward`` with ``past_states`` check each state once per call (one verdict, passed on to the
  composer), never the composed state again, and still refuse a bad state;
* a state read from a store carries the store's verdict (bound to its tensors): its first use does not scan its
  values again, and an edit voids the verdict (the edited state is checked, and refused, as any other).
"""

import ast
import collections
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer
from hf_statecompose.composition import composer as composer_module
from hf_statecompose.generation import integration
from hf_statecompose.ops.compose import methods as registry
from hf_statecompose.ops.compose import native as compose_native
from hf_statecompose.state import validation

from helpers import random_ids, tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer

COMPOSITION = Path(hsc.__file__).parent / "composition"


def private_accesses(source: str) -> list[str]:
    """``obj._name`` accesses in ``source`` on anything but ``self`` / ``cls`` (dunders allowed)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not (node.attr.startswith("__") and node.attr.endswith("__"))
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_composition_uses_only_the_public_state_api():
    # the check itself finds what the composer used to call
    assert private_accesses("out = first._empty_like()\nout._finish_composition(states)\nx = s._map_rows(f)") == [
        "first._empty_like (line 1)",
        "out._finish_composition (line 2)",
        "s._map_rows (line 3)",
    ]
    for path in sorted(COMPOSITION.glob("*.py")):
        assert private_accesses(path.read_text()) == [], path.name
    assert not hasattr(composer_module, "_compose_delta_sums")  # the ΣΔ rules live in the registry only


@pytest.fixture(scope="module")
def model():
    return tiny_model("mamba")


def encode_states(model, count=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return [ComposableMambaCache.encode(model, random_ids(4 + k, generator=g)) for k in range(count)]


def test_filled_like_and_shallow_copy(model):
    state = encode_states(model, 1)[0]
    built = state.filled_like(state.ssm_states, state.conv_states, state.delta_sums)
    assert type(built) is type(state) and built.fingerprint == state.fingerprint and built.num_tokens is None
    for i in range(state.num_layers):
        assert built.ssm_states[i] is state.ssm_states[i]  # taken as they are
        assert torch.equal(built.A[i], state.A[i]) and built.A[i].data_ptr() != state.A[i].data_ptr()  # A copied
    with pytest.raises(ValueError, match="one SSM state, conv window, ΣΔ and A per state layer"):
        state.filled_like(state.ssm_states[:1], state.conv_states, state.delta_sums)
    empty = state.empty_like()
    assert type(empty) is type(state) and not empty.is_filled() and empty.num_layers == state.num_layers
    shared = state.shallow_copy()
    assert shared is not state and all(
        a is b for a, b in zip(list(shared.ssm_states) + list(shared.A), list(state.ssm_states) + list(state.A))
    )
    state.finish_composition  # noqa: B018  # the public hook (SeRpEnt overrides it)
    assert ComposableMambaCache._empty_like is ComposableMambaCache.empty_like  # the old name still works


def soup_total():
    return registry.CompositionMethod(
        name="soup_total_test",
        summary="test: the mean of the states with the total ΣΔ",
        weights="hf_statecompose.ops.compose.weights:soup_weights",
        fixed_weights="uniform",
        delta_sum="total",
        conv="mean",
    )


@pytest.mark.parametrize("path", ["native", "torch"])
def test_composed_delta_sum_is_the_registry_rule(model, monkeypatch, path):
    """Every model-free method (and a registered one, whose rule differs from its weights') composes ΣΔ as
    Σ_k c_k ΣΔ_k with the registry's coefficients c = delta_sum_weights(n, w), on both composition paths."""
    if path == "torch":
        monkeypatch.setattr(compose_native, "enabled", lambda: False)
    elif not compose_native.enabled():
        pytest.skip("no C compiler: the native kernel is not built")
    states = encode_states(model, 3, seed=4)
    method = registry.register(soup_total())
    try:
        for name in [*registry.model_free_names()]:
            spec = registry.METHODS[name]
            w = [0.2, 0.3, 0.5] if spec.user_weights else None
            composed = StateComposer(name, weights=w).compose(states)
            c = spec.delta_sum_weights(3, w)
            for i in range(states[0].num_layers):
                expected = sum(ck * s.delta_sums[i] for ck, s in zip(c, states))
                torch.testing.assert_close(composed.delta_sums[i], expected, rtol=1e-6, atol=1e-7)
        # the registered method: the states' mean, but the total ΣΔ (not the mean that its weights would give)
        composed = StateComposer(method.name).compose(states)
        soup = StateComposer("soup").compose(states)
        torch.testing.assert_close(composed.ssm_states[0], soup.ssm_states[0])
        torch.testing.assert_close(composed.delta_sums[0], 3 * soup.delta_sums[0], rtol=1e-6, atol=1e-7)
    finally:
        registry.unregister(method.name)


class Counter:
    """Wraps validation functions where the package calls them and counts the calls per state object."""

    def __init__(self, monkeypatch):
        self.calls = collections.defaultdict(collections.Counter)  # function -> Counter(id(state))
        for module, name in (
            (validation, "check_state_once"),
            (validation, "check_state"),
            (validation, "check_against_model"),
            (composer_module, "check_state_once"),
            (integration, "check_against_model"),
        ):
            original = getattr(module, name)

            def counted(state, *args, _original=original, _name=name, **kwargs):
                self.calls[_name][id(state)] += 1
                return _original(state, *args, **kwargs)

            monkeypatch.setattr(module, name, counted)

    def reset(self):
        self.calls.clear()


@pytest.mark.parametrize("entry", ["generate", "forward"])
def test_one_verdict_per_call_and_bad_states_still_refused(model, monkeypatch, entry):
    states = encode_states(model, 3, seed=1)
    query = random_ids(3, generator=torch.Generator().manual_seed(9))
    counter = Counter(monkeypatch)

    def call(past_states):
        with torch.no_grad():
            if entry == "generate":
                return model.generate(query, past_states=past_states, max_new_tokens=2, do_sample=False)
            return model(input_ids=query, past_states=past_states).logits

    first = call(states)
    ids = {id(s) for s in states}
    # each state: one check against the model, one contents verdict (a full check: never checked before)
    assert dict(counter.calls["check_against_model"]) == dict.fromkeys(ids, 1)
    assert dict(counter.calls["check_state_once"]) == dict.fromkeys(ids, 1)
    assert dict(counter.calls["check_state"]) == dict.fromkeys(ids, 1)
    counter.reset()
    assert torch.equal(call(states), first)
    # again: one verdict per state per call (remembered: no second check of the contents), the composed state never
    # checked, the composer checks nothing again
    assert dict(counter.calls["check_against_model"]) == dict.fromkeys(ids, 1)
    assert not counter.calls["check_state"] and not counter.calls["check_state_once"]
    # per-row lists: still one verdict per state
    counter.reset()
    call([states[:2]])
    assert dict(counter.calls["check_against_model"]) == dict.fromkeys({id(s) for s in states[:2]}, 1)
    assert not counter.calls["check_state"] and not counter.calls["check_state_once"]
    # a bad state is still refused, before and after it was once accepted
    bad = states[1].clone()
    bad.ssm_states[0][0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"past_states\[1\]: layer 0 SSM state contains NaN"):
        call([states[0], bad])
    states[2].delta_sums[1].neg_().sub_(1.0)  # in place, after its verdict: the verdict is void
    with pytest.raises(ValueError, match=r"past_states\[2\]: layer 1 ΣΔ has negative entries"):
        call(states)


def test_direct_compose_still_checks_each_state(model, monkeypatch):
    states = encode_states(model, 2, seed=2)
    counter = Counter(monkeypatch)
    StateComposer("soup").compose(states)
    assert dict(counter.calls["check_state_once"]) == {id(s): 1 for s in states}
    bad = states[0].clone()
    bad.conv_states[1][0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"states\[0\]: layer 1 conv window contains NaN or inf"):
        StateComposer("soup").compose([bad, states[1]])


def test_store_states_carry_the_store_verdict(tmp_path, monkeypatch):
    """States read from a store were checked by the store; their first use does not scan their values again
    (check_state is not called by generate), an edit voids the verdict, and checks of the rest still run."""
    model = tiny_model("mamba2")
    store = hsc.StateStore(tmp_path / "s", model, CharTokenizer(), retriever=BagOfWords())
    with torch.no_grad():
        ids = store.add(TEXTS[:3], show_progress=False)
    states = store.get(ids)
    counter = Counter(monkeypatch)
    query = torch.tensor([CharTokenizer()("what makes bronze?")["input_ids"]])
    with torch.no_grad():
        out = model.generate(query, past_states=states, max_new_tokens=2, do_sample=False)
    assert not counter.calls["check_state"] and not counter.calls["check_state_once"]  # the store's verdict held
    assert dict(counter.calls["check_against_model"]) == {id(s): 1 for s in states}
    # the same as states checked from scratch
    fresh = [s.clone() for s in states]
    with torch.no_grad():
        assert torch.equal(model.generate(query, past_states=fresh, max_new_tokens=2, do_sample=False), out)
    assert all(counter.calls["check_state"][id(s)] == 1 for s in fresh)
    # an edit of a store state in place voids the verdict: checked in full, refused
    states[0].ssm_states[1].mul_(float("nan"))
    with pytest.raises(ValueError, match=r"past_states\[0\]: layer 1 SSM state contains NaN"):
        model.generate(query, past_states=states, max_new_tokens=2, do_sample=False)
    # values_checked skips only the value scans the store made: the other checks still refuse
    odd = store.get(ids[1])
    odd.token_ids = odd.token_ids + 1000
    with pytest.raises(ValueError, match="token_ids hold ids outside"):
        validation.check_state(odd, where="odd", values_checked=("ssm_state", "conv_state", "delta_sum"))


def test_a_store_whose_A_is_not_the_models_is_refused(tmp_path, monkeypatch):
    """The store compares the A it builds states from with the model (once per A list), as check_against_model
    did per state: an A that is finite and negative but not this model's (a crafted shard) is refused."""
    from hf_statecompose.store import folder

    model = tiny_model("mamba2")
    store = hsc.StateStore(tmp_path / "s", model, CharTokenizer(), retriever=BagOfWords())
    with torch.no_grad():
        ids = store.add(TEXTS[:2], show_progress=False)
    original = folder.FolderStateStore._shard_A
    scaled = {}

    def crafted(self, handle, sid, expected):
        A = original(self, handle, sid, expected)
        return scaled.setdefault(id(A), [a * 1.5 for a in A])

    monkeypatch.setattr(folder.FolderStateStore, "_shard_A", crafted)
    fresh = hsc.StateStore(tmp_path / "s", model, CharTokenizer(), retriever=BagOfWords())
    with pytest.raises(ValueError, match="A is not this model's"):
        fresh.get(ids)
    monkeypatch.setattr(folder.FolderStateStore, "_shard_A", original)
    assert len(hsc.StateStore(tmp_path / "s", model, CharTokenizer(), retriever=BagOfWords()).get(ids)) == 2
