"""Overlapping ``custom_generate`` calls on one stock (never-enabled) model (finding F7 of the adversarial trial).

The repository's ``custom_generate/generate.py`` enables a stock model for its call only (:func:`hf_statecompose.enabled`).
Calls that overlap share that: the model stays enabled until the last of them returns, and each call is exactly the
same call run alone (its tokens and every tensor of the cache it returns, the delta-rule layers' transitions
included); afterwards the model is stock again (every module's class, the backend). A call that raises releases its
share as well.

The overlaps are forced, not hoped for: each call gets a logits processor (it returns the scores as they are) that
waits on ``threading.Event`` / ``threading.Barrier`` objects (with timeouts) at chosen decoding steps, so that a call
is known to be mid-decoding while another starts, ends or raises. Threads start one after another once the previous
one is decoding: transformers' loading of the custom_generate module (``ast.parse``, CPython's gh-106905 in two
threads at once) then never runs in two threads at the same time.

Each test first shows that the states change the output (generation with them differs from generation without)."""

import sys
import threading
from pathlib import Path

import pytest
import torch
import transformers.dynamic_module_utils as dynamic_module_utils
from transformers import LogitsProcessor, LogitsProcessorList

import hf_statecompose as hsc
from hf_statecompose.generation import integration

from architectures import ARCHITECTURES

REPOSITORY = Path(__file__).resolve().parents[1]  # holds custom_generate/
NEW = 6
TIMEOUT = 120.0  # seconds any wait may take before the test fails (instead of hanging)
# the tiny Mamba / Mamba-2 read their states only with a larger init and larger steps (tests/test_generate.py)
CONTEXT_MATTERS = dict(initializer_range=0.5, time_step_min=0.01, time_step_max=0.5)
OVERRIDES = {"mamba": CONTEXT_MATTERS, "mamba2": CONTEXT_MATTERS}
# Mamba-2, Mamba, a Mamba hybrid (Jamba: Mamba + attention + MoE layers), a delta-rule hybrid (Qwen3-Next)
ARCHS = ("mamba2", "mamba", "jamba", "qwen3_next")


@pytest.fixture(autouse=True)
def modules_cache(tmp_path, monkeypatch):
    """transformers copies generate.py into HF_MODULES_CACHE and imports it from there: a fresh folder per test."""
    folder = tmp_path / "hf_modules"
    monkeypatch.setenv("HF_MODULES_CACHE", str(folder))
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(folder))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return folder


# ------------------------------------------------------------------------------------------ models and calls
def make(arch, seed=0):
    """A tiny random stock (never-enabled) ``arch`` model, fixed-length generations."""
    model = hsc.disable(ARCHITECTURES[arch].make(seed=seed, **OVERRIDES.get(arch, {})))
    model.generation_config.eos_token_id = None
    return model


def ids(arch, length, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, ARCHITECTURES[arch].vocab, (1, length), generator=generator)


def states_for(arch, seeds=(1, 2)):
    """States of two contexts, encoded by an enabled twin of :func:`make`'s model (the same weights)."""
    twin = ARCHITECTURES[arch].make(seed=0, **OVERRIDES.get(arch, {}))
    return [hsc.encode(twin, ids(arch, 10, seed)) for seed in seeds]


def custom(model, query, processors=(), **kwargs):
    """``model.generate`` through this repository's custom_generate folder, returning the dict (tokens, cache)."""
    kwargs.setdefault("max_new_tokens", NEW)
    return model.generate(
        query,
        custom_generate=str(REPOSITORY),
        trust_remote_code=True,
        do_sample=False,
        return_dict_in_generate=True,
        logits_processor=LogitsProcessorList(processors),
        **kwargs,
    )


class Hook(LogitsProcessor):
    """Runs ``at[step]()`` at decoding step ``step`` (1: the first new token) and returns the scores as they are."""

    def __init__(self, **at):
        self.at = {int(step.lstrip("s")): action for step, action in at.items()}
        self.step = 0

    def __call__(self, input_ids, scores):
        self.step += 1
        action = self.at.get(self.step)
        if action is not None:
            action()
        return scores


def wait(event, what):
    if not event.wait(TIMEOUT):
        raise TimeoutError(f"waited {TIMEOUT} s for {what}")


class Call(threading.Thread):
    """One call in a thread of its own: its result or its error, and ``done`` set when it has returned."""

    def __init__(self, fn, name):
        super().__init__(name=name, daemon=True)
        self.fn, self.result, self.error, self.done = fn, None, None, threading.Event()

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as error:  # noqa: BLE001 - checked by the test
            self.error = error
        finally:
            self.done.set()

    def outcome(self):
        self.join(TIMEOUT)
        assert not self.is_alive(), f"{self.name} did not return in {TIMEOUT} s"
        if self.error is not None:
            raise AssertionError(f"{self.name} raised {self.error!r}") from self.error
        return self.result


# ------------------------------------------------------------------------------------------ comparisons
def snapshot(model):
    """What enabling changes, as a comparable value: every module's class and instance attribute names."""
    return [(name, type(module), sorted(vars(module))) for name, module in model.named_modules()]


def assert_stock(model, before):
    assert not hsc.is_enabled(model) and hsc.get_backend(model) is None
    assert snapshot(model) == before
    assert id(integration._transformers_model(model)) not in getattr(integration, "_BLOCKS", {})


def assert_same_value(got, expected, where):
    if torch.is_tensor(expected):
        assert torch.is_tensor(got), where
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and got.keys() == expected.keys(), where
        for key in expected:
            assert_same_value(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for k, (g, e) in enumerate(zip(got, expected)):
            assert_same_value(g, e, f"{where}[{k}]")
    else:
        assert got == expected, where


def assert_same_output(got, expected):
    """The same tokens and the same returned cache: every attribute of every layer (SSM states, conv windows, ΣΔ,
    ``A``, a delta-rule layer's transition, attention keys / values / positions) and the token counts, exactly."""
    assert torch.equal(got.sequences, expected.sequences)
    cache, reference = got.past_key_values, expected.past_key_values
    assert type(cache) is type(reference) and len(cache.layers) == len(reference.layers)
    for i, (layer, expected_layer) in enumerate(zip(cache.layers, reference.layers)):
        assert type(layer) is type(expected_layer), i
        assert sorted(vars(layer)) == sorted(vars(expected_layer)), i
        for name, value in vars(expected_layer).items():
            assert_same_value(getattr(layer, name), value, f"layers[{i}].{name}")
    for name in ("num_tokens", "token_ids"):
        assert_same_value(getattr(cache, name), getattr(reference, name), name)


def assert_the_states_matter(model, query, states):
    """Generation with the states differs from generation without (so that no comparison passes vacuously)."""
    plain = model.generate(query, max_new_tokens=NEW, do_sample=False)
    with_states = custom(model, query, past_states=states).sequences
    assert not torch.equal(plain, with_states)


# ------------------------------------------------------------------------------------------ (a) two calls
@pytest.mark.parametrize("arch", ["mamba2", "qwen3_next"])
def test_a_call_that_ends_while_another_decodes_leaves_it_enabled(arch):
    """A is mid-decoding when B starts; A returns while B is still decoding: B is the same call run alone."""
    model = make(arch)
    before = snapshot(model)
    states = states_for(arch)
    query_a, query_b = ids(arch, 3, seed=5), ids(arch, 4, seed=6)
    assert_the_states_matter(model, query_b, states)
    expected_a = custom(model, query_a, past_states=states)
    expected_b = custom(model, query_b, past_states=states[::-1], composition="soup")
    assert_stock(model, before)

    a_decoding, b_decoding = threading.Event(), threading.Event()

    def a_waits_for_b():
        a_decoding.set()
        wait(b_decoding, "B to decode")

    a = Call(lambda: custom(model, query_a, [Hook(s2=a_waits_for_b)], past_states=states), "A")
    b = Call(
        lambda: custom(
            model,
            query_b,
            [Hook(s1=lambda: (b_decoding.set(), wait(a.done, "A to return")))],
            past_states=states[::-1],
            composition="soup",
        ),
        "B",
    )
    a.start()
    wait(a_decoding, "A to decode")
    b.start()  # while A is mid-decoding (it waits for B's first step)
    got_a = a.outcome()  # A returned while B waits at its first step
    assert not b.done.is_set()
    got_b = b.outcome()
    assert_same_output(got_a, expected_a)
    assert_same_output(got_b, expected_b)
    assert_stock(model, before)
