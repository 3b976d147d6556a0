"""The architecture table (``hf_statecompose/state/architectures.py``): one row per architecture, and everything that
lists or dispatches on architectures derived from it.

* a toy row (``toy_architecture.py``: its own config, model and mixer classes, Mamba's maths) registered at test time
  is known to ``enable``, ``encode``, composition, state files, the guard, the refusals and the docs' table, with no
  other edit; unregistered, it is refused again;
* ``register`` refuses a malformed row, naming the problem;
* the docs carry the table-derived support table (README.md, docs/index.md) and the hybrids guide lists exactly the
  hybrid rows;
* with the package imported (and a model enabled), transformers' deprecation warnings for ``cache_params`` point at
  the caller's line, not at the guard's or ``enable``'s wrapper.
"""

import dataclasses
import pathlib
import re
import types
import warnings

import pytest
import torch
from toy_architecture import NAME, TOY_ROW, ToyMambaForCausalLM, ToyMambaModel, toy_model

import hf_statecompose as hsc
from hf_statecompose import _guard, compat
from hf_statecompose.state import architectures
from hf_statecompose.state.architectures import ARCHITECTURES, register, support_table, unregister

from helpers import tiny_model

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def toy_registered():
    register(TOY_ROW)
    try:
        yield TOY_ROW
    finally:
        unregister(NAME)


def test_an_unregistered_architecture_is_refused_listing_the_table():
    model = toy_model()
    with pytest.raises(TypeError, match=r"supports the model types 'mamba', .*'falcon_h1'.*got model_type 'toy_mamba'"):
        hsc.enable(model)
    assert "toy_mamba" not in support_table()


@torch.no_grad()
def test_a_toy_row_is_known_everywhere_with_no_other_edit(toy_registered, tmp_path):
    model = toy_model()
    # the guard: the toy's own classes refuse past_states until enabled (derived from the row's model_classes)
    assert _guard.GUARDED[TOY_ROW.model_module] == TOY_ROW.model_classes
    for cls in (ToyMambaModel, ToyMambaForCausalLM):
        assert getattr(cls.__dict__["forward"], "_hf_statecompose_guard", False), cls
    ids, query = torch.randint(3, 64, (1, 7)), torch.randint(3, 64, (1, 3))
    with pytest.raises(ValueError, match=r"ToyMambaForCausalLM\.forward\(\) got past_states.*enable"):
        model(input_ids=query, past_states=[object()])

    # enable swaps the toy's stock mixer (the row's mixer_class) for the state-aware one running the row's forward
    hsc.enable(model)
    assert all(type(block.mixer).__name__ == "ComposableToyMambaMixer" for block in model.backbone.layers)

    # encode, state files, composition: one state + query = context + query; two states compose
    state = hsc.encode(model, ids)
    assert state.architecture == NAME
    path = tmp_path / "toy.safetensors"
    state.save(path)
    loaded = type(state).load(path, model=model)
    expected = model(torch.cat([ids, query], 1)).logits[:, -3:]
    for past in (state, loaded):
        assert torch.allclose(model(input_ids=query, past_states=[past]).logits, expected, atol=1e-4)
    other = hsc.encode(model, torch.randint(3, 64, (1, 5)))
    composed = model(input_ids=query, past_states=[state, other], composition="soup").logits
    assert torch.isfinite(composed).all() and not torch.allclose(composed, expected, atol=1e-3)

    # the refusals list it among the supported, and the docs' table has it
    unsupported = types.SimpleNamespace(config=types.SimpleNamespace(model_type="not_a_model"))
    with pytest.raises(TypeError, match=r"'toy_mamba'; got model_type 'not_a_model'"):
        hsc.enable(unsupported)
    with pytest.raises(ValueError, match=r"unknown architecture 'nope'.*'toy_mamba'"):
        architectures.architecture("nope")
    assert "ToyMamba (`toy_mamba`)" in support_table().splitlines()[2]


def test_unregistering_forgets_the_row():
    register(TOY_ROW)
    assert unregister(NAME) is TOY_ROW
    assert NAME not in ARCHITECTURES and "toy_mamba" not in support_table()
    with pytest.raises(TypeError, match="got model_type 'toy_mamba'"):
        hsc.enable(toy_model())
    with pytest.raises(ValueError, match="no architecture 'toy_mamba' is registered"):
        unregister(NAME)


@pytest.mark.parametrize(
    "change, problem",
    [
        (dict(name="mamba"), r"'mamba' is already registered \(Mamba"),
        (dict(name="toy mamba"), "name must be a model_type"),
        (dict(display_name=""), "display_name must be a non-empty string"),
        (dict(model_module="toy architecture"), "model_module must be a dotted module name"),
        (dict(model_classes=()), "model_classes must be a non-empty tuple"),
        (dict(model_classes=["ToyMambaModel"]), "model_classes must be a non-empty tuple"),
        (dict(mixer_forward=None), "mixer_class and mixer_forward come together"),
        (
            dict(mixer_forward="hf_statecompose.models.mamba.mamba_mixer_forward"),
            "mixer_forward must be 'module:function'",
        ),
        (dict(state_shapes=None), "state_shapes and decay_shapes must be functions"),
    ],
)
def test_register_refuses_a_malformed_row(change, problem):
    before = dict(ARCHITECTURES)
    with pytest.raises(ValueError, match=problem):
        register(dataclasses.replace(TOY_ROW, **change))
    assert ARCHITECTURES == before
    with pytest.raises(ValueError, match="a row is an Architecture, got dict"):
        register({"name": NAME})


# ---------------------------------------------------------------------------------------------- the docs
def _table_after(text: str, header: str) -> str:
    start = text.index(header)
    end = text.find("\n\n", start)
    return text[start : end if end >= 0 else None].strip()


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_docs_support_table_is_the_architecture_tables(page):
    text = (ROOT / page).read_text()
    assert _table_after(text, "| model (`model_type`) |") == support_table(), (
        f"{page}'s support table differs from hf_statecompose.state.architectures.support_table(): paste it"
    )


def test_the_support_table_has_every_row_once():
    table = support_table()
    for row in ARCHITECTURES.values():
        assert table.count(f"(`{row.name}`") == 1, row.name


def test_the_hybrids_guide_lists_exactly_the_hybrid_rows():
    table = _table_after((ROOT / "docs/guides/hybrids.md").read_text(), "| `model_type` |")
    listed = [re.match(r"\| `([a-z0-9_]+)`", line).group(1) for line in table.splitlines()[2:]]
    assert sorted(listed) == sorted(row.name for row in ARCHITECTURES.values() if row.is_hybrid)


# ---------------------------------------------------------------------------------------------- warnings' stack level
def _cache_params_warnings(call) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [w for w in caught if "cache_params" in str(w.message) and issubclass(w.category, FutureWarning)]


needs_deprecation = pytest.mark.skipif(
    not compat.cache_is_renamed(),
    reason="transformers < 5.24 takes cache_params as it is: no deprecation warning to point anywhere",
)


@needs_deprecation
@torch.no_grad()
@pytest.mark.parametrize("enabled", [False, True], ids=["guarded stock model", "enabled model"])
def test_deprecation_warnings_point_at_the_callers_line(enabled):
    model = tiny_model("mamba", layers=1)
    if not enabled:
        hsc.disable(model)
    assert hsc.is_enabled(model) is enabled
    ids = torch.randint(3, 99, (1, 4))
    found = _cache_params_warnings(lambda: model.forward(ids, cache_params=None, use_cache=False))
    assert len(found) == 1 and found[0].filename == __file__, [(w.filename, w.lineno) for w in found]
    # through module.__call__ it points where the stock model's does: at torch's __call__, not at this package
    found = _cache_params_warnings(lambda: model(ids, cache_params=None, use_cache=False))
    assert len(found) == 1 and "hf_statecompose" not in found[0].filename, found[0].filename


@needs_deprecation
@torch.no_grad()
def test_a_wrapper_outside_the_deprecation_would_be_caught():
    """The check above can fail: a wrapper put around (not inside) the stock method's deprecation wrapper makes the
    warning point at the wrapper's file."""
    from transformers import MambaForCausalLM

    model = tiny_model("mamba", layers=1)
    hsc.disable(model)
    stock = MambaForCausalLM.forward

    def outside(self, *args, **kwargs):
        return stock(self, *args, **kwargs)

    ids = torch.randint(3, 99, (1, 4))
    found = _cache_params_warnings(lambda: outside(model, ids, cache_params=None, use_cache=False))
    assert len(found) == 1 and found[0].filename == __file__ and found[0].lineno == outside.__code__.co_firstlineno + 1
    inside = compat.wrap_inside_deprecations(stock, lambda inner: inner)
    assert inside is not stock and inside.__wrapped__ is compat.without_deprecations(stock)
    found = _cache_params_warnings(lambda: inside(model, ids, cache_params=None, use_cache=False))
    assert len(found) == 1 and found[0].lineno != outside.__code__.co_firstlineno + 1
