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

import functools
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


# ------------------------------------------------------------------------------------------ (b) eight calls, four models
def test_eight_overlapping_calls_on_four_architectures_are_each_the_call_run_alone():
    """Two calls on each of a Mamba-2, a Mamba, a Jamba (Mamba + attention hybrid) and a Qwen3-Next (delta-rule
    hybrid) model: all eight are mid-decoding at once (a barrier at their first step), then they return one by one,
    each while the later ones are still decoding (call ``i`` ends only after call ``i - 1`` has returned)."""
    models = {arch: make(arch) for arch in ARCHS}
    before = {arch: snapshot(model) for arch, model in models.items()}
    states = {arch: states_for(arch) for arch in ARCHS}
    plan = []  # (arch, query, keyword arguments), the architectures interleaved
    for k in range(2):
        for a, arch in enumerate(ARCHS):
            kwargs = dict(past_states=states[arch][:: 1 - 2 * k], composition=("picaso_r", "soup")[k])
            plan.append((arch, ids(arch, 3 + k, seed=10 + 2 * a + k), kwargs))
    for arch, query, kwargs in plan[: len(ARCHS)]:
        assert_the_states_matter(models[arch], query, kwargs["past_states"])
    expected = [custom(models[arch], query, **kwargs) for arch, query, kwargs in plan]
    for arch in ARCHS:
        assert_stock(models[arch], before[arch])

    barrier = threading.Barrier(len(plan), timeout=TIMEOUT)
    decoding = [threading.Event() for _ in plan]
    calls: list[Call] = []

    def hook(i):
        def first_step():
            decoding[i].set()
            barrier.wait()

        def second_step():
            if i:
                wait(calls[i - 1].done, f"call {i - 1} to return")

        return Hook(s1=first_step, s2=second_step)

    for i, (arch, query, kwargs) in enumerate(plan):
        calls.append(Call(functools.partial(custom, models[arch], query, [hook(i)], **kwargs), f"call {i} ({arch})"))
    for i, call in enumerate(calls):
        call.start()
        wait(decoding[i], f"call {i} to decode")  # the next one starts while this one decodes
    got = [call.outcome() for call in calls]
    for g, e in zip(got, expected, strict=True):
        assert_same_output(g, e)
    for arch in ARCHS:
        assert_stock(models[arch], before[arch])


# ------------------------------------------------------------------------------------------ (c) calls that raise
def block_count(model):
    block = integration._BLOCKS.get(id(integration._transformers_model(model)))
    return 0 if block is None else block.count


def test_overlapping_calls_that_raise_release_the_model():
    """Calls that raise (bad arguments, a processor that raises mid-decoding, the last call out raising) among
    calls that succeed: these are exact, and the model is stock, with no count left, when the last one returns."""
    arch = "qwen3_next"
    model = make(arch)
    before = snapshot(model)
    states = states_for(arch)
    foreign = [hsc.encode(ARCHITECTURES["mamba2"].make(seed=0), ids("mamba2", 6, seed=3))]  # another model's state
    query_1, query_2, query_r = ids(arch, 3, seed=20), ids(arch, 4, seed=21), ids(arch, 3, seed=22)
    assert_the_states_matter(model, query_1, states)
    expected_1 = custom(model, query_1, past_states=states)
    expected_2 = custom(model, query_2, past_states=states[::-1], composition="soup")
    # a bad argument on the stock model: refused, the model stock
    with pytest.raises(ValueError, match=r"past_states\[0\] is a state of a 'mamba2' model"):
        custom(model, query_1, past_states=foreign)
    assert_stock(model, before)

    class Boom(RuntimeError):
        pass

    def boom():
        raise Boom("a processor raised mid-decoding")

    events = {
        name: threading.Event() for name in ("s1 decoding", "go s1", "s2 decoding", "go s2", "r2 decoding", "go r2")
    }

    def pause(name):  # "x decoding" set, then wait for "go x"
        return lambda: (events[f"{name} decoding"].set(), wait(events[f"go {name}"], f"go {name}"))

    s1 = Call(lambda: custom(model, query_1, [Hook(s1=pause("s1"))], past_states=states), "S1")
    s2 = Call(
        lambda: custom(model, query_2, [Hook(s1=pause("s2"))], past_states=states[::-1], composition="soup"), "S2"
    )
    r1 = Call(lambda: custom(model, query_r, [Hook(s2=boom)], past_states=states), "R1")
    r2 = Call(lambda: custom(model, query_r, [Hook(s1=pause("r2"), s3=boom)], past_states=states), "R2")

    s1.start()
    wait(events["s1 decoding"], "S1 to decode")
    assert block_count(model) >= 1 and hsc.is_enabled(model)
    # bad arguments while S1 decodes: refused, S1's count untouched
    with pytest.raises(ValueError, match=r"past_states\[0\] is a state of a 'mamba2' model"):
        custom(model, query_1, past_states=foreign)
    with pytest.raises(ValueError, match=r"attention='nowhere' is not an attention placement"):
        custom(model, query_1, past_states=states, attention="nowhere")
    with pytest.raises(TypeError):
        custom(model, query_1, past_states=states[0])  # a single state, not a list
    count = block_count(model)
    # a call that raises at its second step while S1 decodes
    r1.start()
    r1.join(TIMEOUT)
    assert not r1.is_alive() and isinstance(r1.error, Boom)
    assert block_count(model) == count and hsc.is_enabled(model)
    s2.start()
    wait(events["s2 decoding"], "S2 to decode")
    r2.start()
    wait(events["r2 decoding"], "R2 to decode")
    events["go s1"].set()
    got_1 = s1.outcome()
    events["go s2"].set()
    got_2 = s2.outcome()
    assert hsc.is_enabled(model) and block_count(model) >= 1  # R2 still decodes
    events["go r2"].set()  # R2 raises at its third step, the last call out
    r2.join(TIMEOUT)
    assert not r2.is_alive() and isinstance(r2.error, Boom)
    assert_same_output(got_1, expected_1)
    assert_same_output(got_2, expected_2)
    assert block_count(model) == 0
    assert_stock(model, before)


# ------------------------------------------------------------------------------------------ the lookup race, user models
def test_a_generate_looked_up_while_enabled_runs_enabled_after_the_block_ended():
    """The race of a call that looked up the enabled ``generate`` / ``forward`` just before the block that enabled
    the model ended: it finds the model stock at its entry, enables it for itself, and gives it back."""
    arch = "qwen3_next"
    model = make(arch)
    before = snapshot(model)
    states, query = states_for(arch), ids(arch, 3, seed=30)
    assert_the_states_matter(model, query, states)
    expected = custom(model, query, past_states=states)
    with hsc.enabled(model):
        logits = model(query, past_states=states).logits
        generate, forward = model.generate, model.forward  # bound while the model is enabled
    assert_stock(model, before)
    got = generate(query, past_states=states, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert_same_output(got, expected)
    assert_stock(model, before)
    assert torch.equal(forward(query, past_states=states).logits, logits)
    assert_stock(model, before)


def test_a_model_its_user_enabled_stays_enabled_under_overlapping_calls():
    arch = "mamba2"
    model = ARCHITECTURES[arch].make(seed=0, **CONTEXT_MATTERS)
    model.generation_config.eos_token_id = None
    hsc.set_backend(model, "torch")
    before = snapshot(model)
    states, query_a, query_b = states_for(arch), ids(arch, 3, seed=40), ids(arch, 4, seed=41)
    expected_a, expected_b = custom(model, query_a, past_states=states), custom(model, query_b, past_states=states)
    a_decoding, b_decoding = threading.Event(), threading.Event()
    a = Call(
        lambda: custom(
            model, query_a, [Hook(s2=lambda: (a_decoding.set(), wait(b_decoding, "B")))], past_states=states
        ),
        "A",
    )
    b = Call(
        lambda: custom(model, query_b, [Hook(s1=lambda: (b_decoding.set(), wait(a.done, "A")))], past_states=states),
        "B",
    )
    a.start()
    wait(a_decoding, "A to decode")
    b.start()
    assert_same_output(a.outcome(), expected_a)
    assert_same_output(b.outcome(), expected_b)
    assert hsc.is_enabled(model) and hsc.get_backend(model) == "torch" and snapshot(model) == before
    assert block_count(model) == 0


# ------------------------------------------------------------------------------------------ hsc.enabled itself
def test_enabled_is_reentrant_shared_across_threads_and_left_on_errors():
    model = make("mamba")
    before = snapshot(model)
    with hsc.enabled(model) as same:
        assert same is model and hsc.is_enabled(model) and block_count(model) == 1
        with hsc.enabled(model):
            assert block_count(model) == 2
        assert hsc.is_enabled(model) and block_count(model) == 1
        # a block in another thread that outlives this one
        entered, leave = threading.Event(), threading.Event()

        def other():
            with hsc.enabled(model):
                entered.set()
                wait(leave, "the main block to end")

        thread = Call(other, "other")
        thread.start()
        wait(entered, "the other block")
        assert block_count(model) == 2
    assert hsc.is_enabled(model) and block_count(model) == 1  # the other thread's block still holds it
    leave.set()
    thread.outcome()
    assert_stock(model, before)
    with pytest.raises(KeyError), hsc.enabled(model):
        raise KeyError("inside the block")
    assert_stock(model, before)
    # a stock model whose mixers hsc.encode swapped, with a backend chosen: given back so
    with hsc.enabled(model):
        pass
    hsc.encode(model, ids("mamba", 5, seed=50))
    hsc.set_backend(model, "torch")
    swapped = snapshot(model)
    with hsc.enabled(model):
        assert hsc.is_enabled(model)
    assert snapshot(model) == swapped and not hsc.is_enabled(model) and hsc.get_backend(model) == "torch"
    # a model its user enabled: used as it is, no count
    user = ARCHITECTURES["mamba"].make(seed=0)
    with hsc.enabled(user):
        assert block_count(user) == 0
    assert hsc.is_enabled(user)


def test_enabled_refuses_an_unsupported_model_and_leaves_it_as_it_was():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=99)).eval()
    before = snapshot(gpt2)
    with pytest.raises(TypeError, match=r"hf_statecompose supports .*got model_type 'gpt2'"), hsc.enabled(gpt2):
        pass
    assert snapshot(gpt2) == before and block_count(gpt2) == 0
