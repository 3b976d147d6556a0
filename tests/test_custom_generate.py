"""The repository's ``custom_generate/`` folder, run as transformers runs it: ``model.generate(q,
custom_generate=<repository>, trust_remote_code=True, past_states=[...], composition=...)`` on a stock, never-enabled
model loads ``custom_generate/generate.py`` (copied into ``HF_MODULES_CACHE``, a temporary folder here), checks
``custom_generate/requirements.txt`` and generates what the enabled model generates, token for token, leaving the
model as it was.

Each architecture first shows that its context changes the output (generate without states != with them)."""

import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers.dynamic_module_utils as dynamic_module_utils
from packaging.requirements import Requirement
from transformers import GPT2Config, GPT2LMHeadModel

import hf_statecompose as hsc

from architectures import ARCHITECTURES

REPOSITORY = Path(__file__).resolve().parents[1]  # holds custom_generate/ (generate.py, requirements.txt)
NEW = 8
# the tiny Mamba / Mamba-2 read their states only with a larger init and larger steps (tests/test_generate.py)
CONTEXT_MATTERS = dict(initializer_range=0.5, time_step_min=0.01, time_step_max=0.5)
ARCHS = {"mamba": CONTEXT_MATTERS, "mamba2": CONTEXT_MATTERS, "nemotron_h": {}}  # NemotronH: Mamba-2 + attention


@pytest.fixture(autouse=True)
def modules_cache(tmp_path, monkeypatch):
    """transformers copies generate.py into HF_MODULES_CACHE and imports it from there: a fresh folder per test
    (transformers read the variable when imported: its module's constant is patched too), sys.path restored."""
    folder = tmp_path / "hf_modules"
    monkeypatch.setenv("HF_MODULES_CACHE", str(folder))
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(folder))
    monkeypatch.setattr(sys, "path", list(sys.path))  # transformers appends the folder to it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


def make(arch, enable=True, seed=0):
    """A tiny random ``arch`` model (the same weights for the same seed), enabled or stock (never enabled)."""
    model = ARCHITECTURES[arch].make(seed=seed, **ARCHS.get(arch, {}))
    model.generation_config.eos_token_id = None  # fixed-length generations
    return model if enable else hsc.disable(model)


def ids(arch, length, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, ARCHITECTURES[arch].vocab, (1, length), generator=generator)


def custom(model, query, **kwargs):
    """``model.generate`` through this repository's custom_generate folder."""
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("do_sample", False)
    return model.generate(query, custom_generate=str(REPOSITORY), trust_remote_code=True, **kwargs)


def snapshot(model):
    """What ``enable`` changes, as a comparable value: every module's class and instance attribute names."""
    return [(name, type(module), sorted(vars(module))) for name, module in model.named_modules()]


@pytest.fixture(scope="module", params=list(ARCHS))
def case(request):
    arch = request.param
    enabled = make(arch)
    contexts = [ids(arch, 16, seed=1), ids(arch, 12, seed=2)]
    states = [hsc.encode(enabled, context) for context in contexts]
    return arch, enabled, contexts, states, ids(arch, 4, seed=3)


# ------------------------------------------------------------------------------------------ exact
def test_the_contexts_change_the_output(case):
    arch, enabled, _, states, query = case
    plain = make(arch, enable=False).generate(query, max_new_tokens=NEW, do_sample=False)
    for past_states, composition in [(states, "picaso_r"), (states, "soup"), (states[:1], "picaso_r")]:
        composed = enabled.generate(
            query, past_states=past_states, composition=composition, max_new_tokens=NEW, do_sample=False
        )
        assert not torch.equal(plain, composed), (len(past_states), composition)


@pytest.mark.parametrize("composition, attention", [("picaso_r", None), ("soup", "shared")])
def test_custom_generate_equals_the_enabled_path(case, composition, attention, modules_cache):
    arch, enabled, _, states, query = case
    if not ARCHITECTURES[arch].has_attention:
        attention = None  # (keys to place only in a hybrid's states)
    stock = make(arch, enable=False)
    expected = enabled.generate(
        query, past_states=states, composition=composition, attention=attention, max_new_tokens=NEW, do_sample=False
    )
    got = custom(stock, query, past_states=states, composition=composition, attention=attention)
    assert torch.equal(got, expected)
    assert not hsc.is_enabled(stock)
    # transformers ran the copy in HF_MODULES_CACHE (the temporary folder), not a file of this repository
    assert list(modules_cache.rglob("custom_generate/generate.py"))
    # a StateComposer works as well
    composer = hsc.StateComposer("picaso_s")
    assert torch.equal(
        custom(stock, query, past_states=states, composition=composer),
        enabled.generate(query, past_states=states, composition=composer, max_new_tokens=NEW, do_sample=False),
    )


def test_one_state_and_the_query_generate_what_the_context_and_the_query_generate(case):
    arch, _, contexts, states, query = case
    stock = make(arch, enable=False)
    one = custom(stock, query, past_states=states[:1])
    full = stock.generate(torch.cat([contexts[0], query], 1), max_new_tokens=NEW, do_sample=False)
    assert torch.equal(one[:, -NEW:], full[:, -NEW:])
    assert torch.equal(one[:, : query.shape[1]], query)  # the query as passed plus the new tokens


# ------------------------------------------------------------------------------------------ the model stays as it was
def test_the_stock_model_is_left_as_it_was(case):
    arch, _, _, states, query = case
    stock = make(arch, enable=False)
    before, stock_class = snapshot(stock), type(stock)
    plain = stock.generate(query, max_new_tokens=NEW, do_sample=False)
    custom(stock, query, past_states=states)
    assert type(stock) is stock_class and not hsc.is_enabled(stock) and hsc.get_backend(stock) is None
    assert snapshot(stock) == before
    assert torch.equal(stock.generate(query, max_new_tokens=NEW, do_sample=False), plain)
    with torch.no_grad():
        torch.testing.assert_close(stock(query).logits, make(arch, enable=False)(query).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"past_states needs hf_statecompose\.enable\(model\) first"):
        stock.generate(query, past_states=states, max_new_tokens=2)  # the guard still refuses a plain call
    # a model that encoded the contexts itself (hsc.encode swaps its mixers, sets their backend), backend chosen
    own = [hsc.encode(stock, ids(arch, 6, seed=20))]
    hsc.set_backend(stock, "torch")
    before = snapshot(stock)
    custom(stock, query, past_states=own)
    assert snapshot(stock) == before and not hsc.is_enabled(stock) and hsc.get_backend(stock) == "torch"


def test_an_enabled_model_stays_enabled_with_its_backend():
    enabled = make("mamba2")
    hsc.set_backend(enabled, "torch")
    states, query = [hsc.encode(enabled, ids("mamba2", 9, seed=4))], ids("mamba2", 3, seed=5)
    expected = enabled.generate(query, past_states=states, max_new_tokens=NEW, do_sample=False)
    # the enabled generate composes the states and hands transformers the cache: custom_generate runs from it
    assert torch.equal(custom(enabled, query, past_states=states), expected)
    assert hsc.is_enabled(enabled) and hsc.get_backend(enabled) == "torch"


def test_concurrent_calls_on_one_stock_model():
    stock, reference = make("mamba", enable=False), make("mamba")
    states = [hsc.encode(reference, ids("mamba", 9, seed=6))]
    queries = [ids("mamba", 3, seed=7 + i) for i in range(4)]
    expected = [reference.generate(q, past_states=states, max_new_tokens=NEW, do_sample=False) for q in queries]
    got, errors = [None] * len(queries), []

    def run(i):
        for attempt in range(2):
            try:
                got[i] = custom(stock, queries[i], past_states=states)
                return
            except SystemError as error:
                # CPython's gh-106905 (seen on 3.11.7): ast.parse in two threads at once, here transformers'
                # check of the custom_generate module's imports, may raise this; the call itself is retried
                if "AST constructor recursion depth mismatch" not in str(error) or attempt:
                    errors.append(error)
                    return
            except Exception as error:  # noqa: BLE001 - reported by the assertion below
                errors.append(error)
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(queries))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and all(torch.equal(g, e) for g, e in zip(got, expected))
    assert not hsc.is_enabled(stock)


def test_the_package_s_own_models_through_custom_generate():
    """COFFEE (this package's model) refuses past_states before enable as the stock classes do, and lets a
    custom_generate call through in the same way."""
    enabled = make("coffee")
    stock = hsc.disable(make("coffee"))
    states, query = [hsc.encode(enabled, ids("coffee", 9, seed=8))], ids("coffee", 3, seed=9)
    expected = enabled.generate(query, past_states=states, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(custom(stock, query, past_states=states), expected)
    assert not hsc.is_enabled(stock)
    with pytest.raises(ValueError, match=r"enable\(model\) first"):
        stock.generate(query, past_states=states, max_new_tokens=2)


# ------------------------------------------------------------------------------------------ clear errors
def _no_kwargs_traceback(error) -> None:
    assert "model_kwargs" not in str(error) and "not used by the model" not in str(error)


def test_missing_past_states_is_refused():
    stock = make("mamba2", enable=False)
    with pytest.raises(ValueError, match=r"custom_generate=hf_statecompose.*pass past_states=\[state, \.\.\.\]") as e:
        custom(stock, ids("mamba2", 3, seed=10))
    _no_kwargs_traceback(e.value)
    assert not hsc.is_enabled(stock)


def test_an_unsupported_model_is_refused_with_the_supported_list():
    states = [hsc.encode(make("mamba2"), ids("mamba2", 5, seed=11))]
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=99, bos_token_id=2, eos_token_id=1)
    ).eval()
    with pytest.raises(
        TypeError, match=r"hf_statecompose supports the model types 'mamba'.*got model_type 'gpt2'"
    ) as e:
        custom(gpt2, ids("mamba2", 3, seed=12), past_states=states)
    _no_kwargs_traceback(e.value)
    assert type(gpt2) is GPT2LMHeadModel


def test_states_of_another_model_are_refused_and_the_model_left_stock():
    states = [hsc.encode(make("mamba2"), ids("mamba2", 5, seed=13))]
    stock = make("mamba", enable=False)
    before = snapshot(stock)
    with pytest.raises(ValueError, match=r"past_states\[0\] is a state of a 'mamba2' model.*this model is 'mamba'"):
        custom(stock, ids("mamba", 3, seed=14), past_states=states)
    assert not hsc.is_enabled(stock) and snapshot(stock) == before
    other_weights = make("mamba2", enable=False, seed=1)  # the same architecture, other weights
    with pytest.raises(ValueError, match=r"past_states\[0\] was encoded by .*states only fit the exact model"):
        custom(other_weights, ids("mamba2", 3, seed=15), past_states=states)
    assert not hsc.is_enabled(other_weights)


def test_the_guard_lets_only_custom_generate_calls_through():
    stock = make("mamba", enable=False)
    states, query = [hsc.encode(make("mamba"), ids("mamba", 5, seed=16))], ids("mamba", 3, seed=17)
    with pytest.raises(ValueError, match=r"MambaForCausalLM\.forward\(\) got past_states"):
        stock(query, past_states=states, custom_generate=str(REPOSITORY))  # forward: no custom_generate there

    def takes_no_states(model, **kwargs):  # a custom_generate callable: past_states stay model kwargs, refused
        return model.generate(**kwargs)

    with pytest.raises(ValueError, match=r"past_states"):
        stock.generate(query, past_states=states, custom_generate=takes_no_states, max_new_tokens=2)


# ------------------------------------------------------------------------------------------ requirements
def _requirements():
    lines = (REPOSITORY / "custom_generate" / "requirements.txt").read_text(encoding="utf-8").splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def test_requirements_name_only_this_package_in_a_range_holding_its_version():
    requirements = _requirements()
    assert {r.name for r in requirements} == {"hf_statecompose"}
    # one bound a line: transformers' check reads only the first bound of a line ("a>=1,<2" checks a>=1)
    assert all(len(r.specifier) == 1 for r in requirements)
    assert all(r.specifier.contains(hsc.__version__) for r in requirements)
    assert not any(r.specifier.contains("0.3.0") for r in requirements if str(r.specifier).startswith("<"))


def test_transformers_checks_the_requirements(tmp_path):
    folder = tmp_path / "repo"
    shutil.copytree(REPOSITORY / "custom_generate", folder / "custom_generate")
    (folder / "custom_generate" / "requirements.txt").write_text("hf_statecompose<0.1\n", encoding="utf-8")
    stock = make("mamba", enable=False)
    states = [hsc.encode(make("mamba"), ids("mamba", 5, seed=18))]
    with pytest.raises(ImportError, match=r"(?s)Missing requirements.*hf_statecompose<0.1 \(installed: "):
        stock.generate(
            ids("mamba", 3, seed=19), custom_generate=str(folder), trust_remote_code=True, past_states=states
        )


def test_the_hub_card():
    """custom_generate/README.md is the Hub repository's card: transformers' custom_generate metadata, the example."""
    card = (REPOSITORY / "custom_generate" / "README.md").read_text(encoding="utf-8")
    front = card.split("---\n")[1]
    assert "library_name: transformers\n" in front and "  - custom_generate\n" in front
    assert "trust_remote_code=True" in card and "past_states=states" in card
    for requirement in _requirements():
        assert str(requirement.specifier) in card
    # every architecture of the table (the delta-rule hybrids included), by its model_type
    from hf_statecompose.state.architectures import ARCHITECTURES as TABLE

    missing = [name for name in TABLE if f"(`{name}`)" not in card]
    assert not missing, f"custom_generate/README.md lacks {missing}"


def test_an_installed_release_without_enabled_is_refused_in_one_line(monkeypatch):
    """generate.py calls hf_statecompose.enabled, which 0.2.0 lacks: such an install gets an ImportError naming the fix
    (not an AttributeError from inside the call), and the model is left as it was."""
    model = make("mamba2", enable=False)
    before = snapshot(model)
    state = hsc.encode(hsc.enable(make("mamba2", enable=False)), ids("mamba2", 6, seed=1))
    # the package generate.py imports (sys.modules': another test may have re-imported it since this module's `hsc`);
    # a lazy attribute: shadowed, as if absent
    monkeypatch.setattr(sys.modules["hf_statecompose"], "enabled", None, raising=False)
    with pytest.raises(ImportError, match=r"needs hf_statecompose.enabled .*pip install -U hf_statecompose"):
        custom(model, ids("mamba2", 3, seed=2), past_states=[state])
    assert snapshot(model) == before
