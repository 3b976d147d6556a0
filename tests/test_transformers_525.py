"""What transformers 5.25 changed under the package, checked on whichever release the session installed (5.23 in the
lowest session, 5.25 in the newest, 5.24 in the targeted one):

* **Token counts.** 5.25 asks a cache's layer 0 how many tokens it has seen (``Cache.get_seq_length()``), a recurrent
  layer in most hybrids, whose counter (``cumulative_length_linear``) it advances itself. A user's own decoding loop
  fed the cache that ``model(q, past_states=[s], use_cache=True)`` returns must equal the same loop on the stock model
  after a forward over context + query: the next tokens' rotary positions start from that count.
* **Assisted generation.** 5.25 no longer refuses it for stateful models and rolls the verifier's state back with
  ``crop`` from a history of recurrent states; the state path keeps none, so it is refused in one line, before any
  token, on every architecture (never a bare ``IndexError``, never other tokens).
* **Cache names.** A forward given a cache under a name the installed release's model does not take (``cache_params``
  where it takes ``cache``, ...) is, for stock, an unknown keyword it passes on and never reads; the enabled model does
  the same: same logits, same warnings or error, the stray cache untouched.
"""

import copy
import inspect
import warnings

import pytest
import torch
from packaging.version import Version

import hf_statecompose as hsc
from hf_statecompose import compat

from architectures import ARCHITECTURES

NAMES = list(ARCHITECTURES)
CONTEXT, QUERY, STEPS = 7, 3, 4
# relative, one-token steps of the state path against stock's (the hybrids' TOL_STEPS in test_hybrid_exactness.py)
TOL_STEPS = 1e-4
# the models transformers ships (SeRpEnt and COFFEE are this package's own: they take their cache under both names)
TRANSFORMERS_NAMES = [name for name in NAMES if name not in ("serpent_mamba", "coffee")]


@pytest.fixture(scope="module", params=NAMES)
def arch(request):
    return ARCHITECTURES[request.param]


@pytest.fixture(scope="module")
def model(arch):
    return arch.make(seed=0)


def _inputs(arch, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(3, arch.vocab, (1, CONTEXT), generator=generator)
    query = torch.randint(3, arch.vocab, (1, QUERY), generator=generator)
    return context, query


def _cache_name(model) -> str:
    """The name the installed release's forward takes the cache under."""
    return compat.cache_parameter(type(model).forward)


def _loop(model, cache, token, steps: int = STEPS):
    """A user's decoding loop: greedy one-token steps, the cache passed back each time (no positions, no mask)."""
    logits = []
    for _ in range(steps):
        out = model(token, **{_cache_name(model): cache}, use_cache=True)
        cache = compat.output_cache(out)
        logits.append(out.logits[:, -1])
        token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1), cache


def _relative(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


@torch.no_grad()
def test_a_decoding_loop_from_past_states_equals_stocks_after_context_and_query(arch, model):
    context, query = _inputs(arch)
    full = model(torch.cat([context, query], 1), use_cache=True)  # stock path: no past_states
    out = model(query, past_states=[hsc.encode(model, context)], use_cache=True)
    ours = compat.output_cache(out)
    # before any step (the loop advances the stock cache in place): the same count as stock's
    _assert_count(ours, compat.output_cache(full), CONTEXT + QUERY)
    first = full.logits[:, -1:].argmax(-1)
    expected, stock_cache = _loop(model, compat.output_cache(full), first)
    # the context matters: the same loop after the query alone takes other logits
    alone, _ = _loop(model, compat.output_cache(model(query, use_cache=True)), first)
    assert _relative(alone, expected) > 1e-2
    got, ours = _loop(model, ours, first)
    assert _relative(got, expected) < TOL_STEPS
    # after the loop both caches report the same count, at the cache and on every layer that counts tokens
    _assert_count(ours, stock_cache, CONTEXT + QUERY + STEPS)
    counted = [i for i, layer in enumerate(stock_cache.layers) if _counts_tokens(layer)]
    for i in counted:
        assert int(ours.layers[i].get_seq_length()) == int(stock_cache.layers[i].get_seq_length()), i


def _assert_count(ours, stock_cache, expected: int) -> None:
    """Ours counts ``expected`` tokens, and so does stock's cache (where it counts: every release for a hybrid, from
    5.25 for a model without attention layers)."""
    assert ours.get_seq_length() == expected
    assert _stock_count(stock_cache) in (
        (expected,) if Version(compat.transformers_version()) >= Version("5.25") else (expected, -1)
    )


def _stock_count(cache) -> int:
    """What a stock cache answers to ``get_seq_length()`` (a tensor on 5.25's recurrent layers). A pure Mamba cache of
    transformers < 5.25 counts nothing and says so (a ValueError): the tokens are then the package's own count."""
    try:
        return int(cache.get_seq_length())
    except ValueError:
        assert not any(_counts_tokens(layer) for layer in cache.layers)
        return -1


def _counts_tokens(layer) -> bool:
    """Whether a stock cache layer answers ``get_seq_length`` (every layer on 5.25; attention layers before)."""
    method = getattr(layer, "get_seq_length", None)
    return method is not None and not getattr(method, "__isabstractmethod__", False)


@torch.no_grad()
def test_states_and_generated_caches_report_their_tokens(arch, model):
    context, query = _inputs(arch)
    state = hsc.encode(model, context)
    assert state.get_seq_length() == CONTEXT
    out = model.generate(query, past_states=[state], max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    stock = model.generate(
        torch.cat([context, query], 1), max_new_tokens=3, do_sample=False, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences[:, QUERY:], stock.sequences[:, CONTEXT + QUERY :])
    ours, theirs = compat.output_cache(out), compat.output_cache(stock)
    _assert_count(ours, theirs, CONTEXT + QUERY + 2)  # the last generated token is not fed
    # a composed state counts the tokens of all its contexts
    two = hsc.StateComposer("soup").compose([state, hsc.encode(model, query)], model=model)
    assert two.get_seq_length() == CONTEXT + QUERY


ASSISTED = {
    "assistant_model": lambda model: dict(assistant_model=model),
    "prompt_lookup_num_tokens": lambda model: dict(prompt_lookup_num_tokens=2),
}


@pytest.mark.parametrize("how", list(ASSISTED))
@torch.no_grad()
def test_assisted_generation_from_states_is_refused_in_one_line(arch, model, how):
    context, query = _inputs(arch)
    state = hsc.encode(model, context)
    with pytest.raises(ValueError, match=r"^assisted generation .* cannot start from past_states: .*rolls the state"):
        model.generate(query, past_states=[state], max_new_tokens=3, do_sample=False, **ASSISTED[how](model))
    # also when the generation config asks for it
    config = copy.deepcopy(model.generation_config)
    config.prompt_lookup_num_tokens = 2
    with pytest.raises(ValueError, match=r"^assisted generation"):
        model.generate(query, past_states=[state], generation_config=config, max_new_tokens=3, do_sample=False)
    # a user's own rollback of a state
    with pytest.raises(ValueError, match="cannot be cropped"):
        state.clone().crop(CONTEXT - 1)
    assert not state.is_croppable


@pytest.mark.parametrize("arch_name", ["serpent_mamba", "coffee"])
@torch.no_grad()
def test_our_own_models_refuse_assisted_generation_without_states(arch_name):
    """SeRpEnt and COFFEE always run on this package's cache; their `_is_stateful` did the refusing before 5.25."""
    arch = ARCHITECTURES[arch_name]
    model = arch.make(seed=0)
    _, query = _inputs(arch)
    for how in ASSISTED.values():
        with pytest.raises(ValueError, match=r"^assisted generation .* cannot start from a .*state cache"):
            model.generate(query, max_new_tokens=3, do_sample=False, **how(model))


# ----------------------------------------------------------------------------------------------- cache names
def _stray_names(model) -> list[str]:
    """The names the installed release's forward does not take a cache under (not its own, not one its deprecation
    wrappers rename to it)."""
    taken = compat.cache_names_taken(model._hsc_stock_class.forward)
    return [name for name in compat.CACHE_NAMES if name not in taken]


def _snapshot(cache) -> list[torch.Tensor]:
    tensors = []
    for layer in cache.layers:
        for value in vars(layer).values():
            if torch.is_tensor(value):
                tensors.append(value.clone())
    return tensors


def _outcome(model, query, name, cache, use_cache):
    """What a forward with ``cache`` under ``name`` gives: ``("ok", logits, warning categories)`` or
    ``("error", exception type)``; and whether ``cache`` was left as it was."""
    before = _snapshot(cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = model(query, **{name: cache}, use_cache=use_cache)
            result = ("ok", out.logits, sorted({w.category.__name__ for w in caught}))
        except Exception as error:  # noqa: BLE001 - the outcome compared is the exception's type
            result = ("error", type(error).__name__)
    after = _snapshot(cache)
    untouched = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    return result, untouched


@pytest.mark.parametrize("use_cache", [False, True])
@pytest.mark.parametrize("arch_name", TRANSFORMERS_NAMES)
@torch.no_grad()
def test_a_cache_under_a_name_the_release_does_not_take_is_what_it_is_for_stock(arch_name, use_cache):
    arch = ARCHITECTURES[arch_name]
    enabled = arch.make(seed=0)
    stock = hsc.disable(copy.deepcopy(enabled))
    assert not hsc.is_enabled(stock)
    context, query = _inputs(arch)
    for name in _stray_names(enabled):
        for which in ("state", "stock cache"):
            # a composable state (what the enabled mixers run on when it is their cache) or a stock cache
            make = (
                (lambda: hsc.encode(enabled, context))
                if which == "state"
                else (lambda: compat.output_cache(stock(context, use_cache=True)))
            )
            theirs, stock_untouched = _outcome(stock, query, name, make(), use_cache)
            ours, our_untouched = _outcome(enabled, query, name, make(), use_cache)
            assert ours[0] == theirs[0], (name, which, ours, theirs)
            if theirs[0] == "ok":
                assert torch.equal(ours[1], theirs[1]), (name, which)
                assert ours[2] == theirs[2], (name, which)
            else:
                assert ours[1] == theirs[1], (name, which)
            assert our_untouched == stock_untouched, (name, which)


def test_the_cache_parameter_is_the_stock_forwards_own_name():
    for arch_name in TRANSFORMERS_NAMES:
        model = ARCHITECTURES[arch_name].make(seed=0)
        stock = model._hsc_stock_class
        parameters = inspect.signature(compat.without_deprecations(stock.forward)).parameters
        name = compat.cache_parameter(stock.forward)
        assert name in parameters and name in compat.CACHE_NAMES, arch_name
        if compat.cache_is_renamed():
            assert name == "cache", arch_name
        assert compat.cache_names_taken(stock.forward)[0] == name
    # 5.24 renamed the Mamba family's `cache_params`: its forward still takes it, with a FutureWarning
    mamba = ARCHITECTURES["mamba"].make(seed=0)._hsc_stock_class.forward
    expected = ("cache", "cache_params") if compat.cache_is_renamed() else ("cache_params",)
    assert compat.cache_names_taken(mamba) == expected


@pytest.mark.parametrize("arch_name", TRANSFORMERS_NAMES)
@torch.no_grad()
def test_past_states_with_a_cache_under_any_name_the_forward_takes_is_refused(arch_name):
    """Every name the release's forward reads a cache under (its own and the deprecated ones it renames): with
    past_states, which one would win is not the user's to guess (stock's wrapper would keep `cache`)."""
    arch = ARCHITECTURES[arch_name]
    model = arch.make(seed=0)
    context, query = _inputs(arch)
    state = hsc.encode(model, context)
    names = compat.cache_names_taken(model._hsc_stock_class.forward)
    assert names
    for name in names:
        # named as passed, or by its new name where the deprecation wrapper renamed it first (with its FutureWarning)
        with pytest.raises(ValueError, match=rf"pass either past_states or a cache \(({name}|{names[0]})=\), not both"):
            model(query, past_states=[state], **{name: state.clone()})
