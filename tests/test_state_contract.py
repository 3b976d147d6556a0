"""The contract every architecture's state meets, written once and run for each architecture of
:mod:`architectures` (Mamba, Mamba-2, FalconMamba, SeRpEnt, COFFEE and the six hybrids).

A state of a context, passed as ``past_states=[state]`` with a query, gives what the model gives on context +
query (forward logits within the architecture's tolerance under every method, greedy, sampled and beam tokens
identical), after showing that the context changes that output; the rows of a left-padded batch and per-row state
lists are the rows alone; a state continued as the model's cache is the concatenation's; compositions follow the
float64 reference, nest as the maths says and run as the state they compose; a file round trip (safetensors +
JSON), deepcopy / pickle / torch.save and a StateStore keep the states; states of another model, config or
architecture, crafted files, NaN, wrong shapes and dtypes are refused with a ValueError naming the problem.
Architecture-specific behaviour (mixer maths, SeRpEnt resampling, COFFEE gates, hybrid attention placement and
keys) stays in the per-architecture test files."""

import copy
import itertools
import pickle

import pytest
import torch
from safetensors.torch import load_file

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer, compat
from hf_statecompose.composition.composer import METHODS, MODEL_FREE_METHODS
from hf_statecompose.ops.compose.reference import compose_ssm_ref
from hf_statecompose.ops.delta_rule import compose_in_order_reference, mean_over_orders_reference, rotations
from hf_statecompose.state.architectures import architecture, has_transitions
from hf_statecompose.state.validation import check_state

from architectures import ARCHITECTURES
from helpers import VOCAB as STORE_VOCAB
from helpers import (
    craft,
    load_saved,
    pickle_round_trip,
    relative_error,
    tiny_model,
    torch_save_round_trip,
    trusted_loads,
)  # fmt: skip

NEW = 6  # generated tokens
MATTERS = 1e-3  # the context moves the next-token logits by more than this (relative): >= 10x every tolerance


def ids(arch, length, batch=1, seed=0):
    """Random ids in [3, vocab): no pad, eos or bos."""
    return torch.randint(3, arch.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def positions(arch, query, start):
    """The position ids of ``query`` after ``start`` cached tokens, for a forward from a cache passed as the model's
    own: stock Bamba continuing from a cache without ``position_ids`` restarts RoPE at 0 (past_states needs none)."""
    return (
        {"position_ids": torch.arange(start, start + query.shape[1]).expand(len(query), -1)}
        if arch.has_attention
        else {}
    )


def composer_of(method, n):
    weights = [0.2, 0.5, 0.3] if n == 3 else [1.0]
    return StateComposer(method, weights=weights) if method == "weighted" else StateComposer(method)


def state_tensors(state) -> dict:
    """Every tensor a state holds (each layer's attributes, token counts and ids), by name: read from the layers,
    not from the file format, so that a save that drops or alters a tensor shows up."""
    out = {}
    for i, layer in enumerate(state.layers):
        for name, value in vars(layer).items():  # (transformers' layers hold the SSM state and conv window in
            items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
            for key, item in [(None, value), *items]:  # per-state dicts / lists: their entries too)
                if isinstance(item, torch.Tensor):
                    out[f"{i}.{name}" if key is None else f"{i}.{name}.{key}"] = item
    for name in ("num_tokens", "token_ids"):
        if getattr(state, name) is not None:
            out[name] = getattr(state, name)
    return out


def assert_same_state(actual, expected, rtol=0.0, atol=0.0):
    """Same class, architecture, fingerprint and tensor names; tensors equal (bit for bit by default, dtypes too)."""
    assert type(actual) is type(expected) and actual.architecture == expected.architecture
    assert actual.fingerprint == expected.fingerprint and actual.num_layers == expected.num_layers
    a, b = state_tensors(actual), state_tensors(expected)
    assert sorted(a) == sorted(b)
    for name in b:
        if rtol == atol == 0.0:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
        else:
            torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=name)


def assert_same_layers(actual, expected):
    """Same class and token count; every SSM layer's state, conv window and ΣΔ close (float32 rounding)."""
    assert type(actual) is type(expected) and actual.num_tokens.tolist() == expected.num_tokens.tolist()
    for v in range(expected.num_layers):
        for name in ("ssm_state", "conv_state", "delta_sum"):
            a, b = getattr(actual.state_layers[v], name), getattr(expected.state_layers[v], name)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"layer {v} {name}")


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request):
    return ARCHITECTURES[request.param]


@pytest.fixture(scope="module")
def model(arch):
    return arch.make()


@pytest.fixture(scope="module")
def context(arch):
    return ids(arch, 13, seed=1)


@pytest.fixture(scope="module")
def state(model, context):
    with torch.no_grad():
        return hsc.encode(model, context)


def greedy(model, input_ids, **kwargs):
    return model.generate(input_ids, max_new_tokens=NEW, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, **kwargs)  # fmt: skip


# ---------------------------------------------------------------------------------- state + query = context + query
@torch.no_grad()
def test_the_context_changes_the_output(arch, model, state, context):
    """Shown first: without its context the query gives other next-token logits, so the checks below that a state
    reproduces the concatenation say that the state carried the context."""
    assert hsc.is_enabled(model) and state.architecture == model.config.model_type
    assert state.num_tokens.tolist() == [13] and torch.equal(state.token_ids, context)
    query = ids(arch, 5, seed=2)
    full = model(torch.cat([context, query], 1)).logits[:, -1]
    assert relative_error(model(query).logits[:, -1], full) > MATTERS
    check_state(state, model)


@pytest.mark.parametrize("query_length", [1, 6, 40])  # (40: several chunks of the chunked scans, chunk size 16)
@torch.no_grad()
def test_one_state_reproduces_context_plus_query(arch, model, state, context, query_length):
    query = ids(arch, query_length, seed=3)
    expected = model(torch.cat([context, query], 1)).logits[:, -query_length:]
    for method in METHODS:  # one state composes to itself under each (the model-based ones re-encode its tokens)
        logits = model(query, past_states=[state], composition=composer_of(method, 1)).logits
        assert relative_error(logits, expected) < arch.tol, method


@torch.no_grad()
def test_greedy_generate_equals_the_concatenation(arch, model, state, context):
    query = ids(arch, 4, seed=4)
    full = torch.cat([context, query], 1)
    expected = greedy(model, full)
    ours = greedy(model, query, past_states=[state])
    assert torch.equal(ours.sequences[:, query.shape[1] :], expected.sequences[:, full.shape[1] :])
    for step, (a, e) in enumerate(zip(ours.scores, expected.scores, strict=True)):
        assert relative_error(a, e) < 1e-4, step  # (hybrids: the stock one-token steps, test_hybrid_exactness.py)
    assert relative_error(greedy(model, query).scores[0], expected.scores[0]) > MATTERS  # the context matters here too


@torch.no_grad()
def test_beam_search_equals_the_concatenation(arch, model, state, context):
    if not arch.supports_beams:
        pytest.skip(f"{arch.name}: no beam search with past_states")
    query = ids(arch, 4, seed=5)
    full = torch.cat([context, query], 1)
    kwargs = dict(max_new_tokens=NEW, num_beams=3, num_return_sequences=2, do_sample=False,
                  output_scores=True, return_dict_in_generate=True)  # fmt: skip
    out, expected = model.generate(query, past_states=[state], **kwargs), model.generate(full, **kwargs)
    assert out.sequences.shape[0] == 2
    assert torch.equal(out.sequences[:, query.shape[1] :], expected.sequences[:, full.shape[1] :])
    assert relative_error(out.sequences_scores, expected.sequences_scores) < 1e-4


@torch.no_grad()
def test_sampling_with_the_same_seed_equals_the_concatenation(arch, model, state, context):
    """Several return sequences, sampled from the full distribution (top_k=0): the same tokens and scores."""
    query = ids(arch, 4, seed=8)
    full = torch.cat([context, query], 1)
    kwargs = dict(max_new_tokens=NEW, do_sample=True, top_k=0, num_return_sequences=2, output_scores=True,
                  return_dict_in_generate=True)  # fmt: skip
    torch.manual_seed(7)
    expected = model.generate(full, **kwargs)
    torch.manual_seed(7)
    out = model.generate(query, past_states=[state], **kwargs)
    assert torch.equal(out.sequences[:, query.shape[1] :], expected.sequences[:, full.shape[1] :])
    for step, (a, e) in enumerate(zip(out.scores, expected.scores, strict=True)):
        assert relative_error(a, e) < 1e-4, step


@torch.no_grad()
def test_generate_does_not_mutate_the_state(arch, model, state):
    before = copy.deepcopy(state)
    model.generate(ids(arch, 3), past_states=[state], max_new_tokens=4, do_sample=False)
    model.generate(ids(arch, 3), past_states=[state, state], max_new_tokens=4, num_beams=2, do_sample=False)
    assert_same_state(state, before)


@torch.no_grad()
def test_left_padded_batch_rows_equal_each_row_alone(arch, model):
    """Left-padded contexts (encode) and left-padded queries (forward): every row's state is its context's state
    encoded alone, and every row's logits are its context + query's."""
    contexts = [ids(arch, n, seed=10 + n)[0] for n in (5, 11, 8)]
    queries = [ids(arch, n, seed=20 + n)[0] for n in (3, 1, 6)]

    def pad(rows):
        width = max(map(len, rows))
        out, mask = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            out[r, width - len(row) :], mask[r, width - len(row) :] = row, 1
        return out, mask

    (c_ids, c_mask), (q_ids, q_mask) = pad(contexts), pad(queries)
    states = hsc.encode(model, c_ids, attention_mask=c_mask)
    assert states.num_tokens.tolist() == [5, 11, 8]
    logits = model(q_ids, attention_mask=q_mask, past_states=[states]).logits
    out = model.generate(q_ids, attention_mask=q_mask, past_states=[states], max_new_tokens=NEW, do_sample=False)
    for r, (c, q) in enumerate(zip(contexts, queries, strict=True)):
        alone = hsc.encode(model, c[None])
        for v in range(alone.num_layers):
            for name in ("ssm_state", "conv_state", "delta_sum"):
                a, b = getattr(states.select(r).state_layers[v], name), getattr(alone.state_layers[v], name)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"row {r} layer {v} {name}")
        expected = model(torch.cat([c, q])[None]).logits[0, -len(q) :]
        assert relative_error(logits[r, -len(q) :], expected) < arch.tol, r
        whole = torch.cat([c, q])[None]
        tokens = model.generate(whole, max_new_tokens=NEW, do_sample=False)[0, whole.shape[1] :]
        assert torch.equal(out[r, q_ids.shape[1] :], tokens), r


@torch.no_grad()
def test_per_row_state_lists_equal_each_row_alone(arch, model):
    """``past_states=[[s1], [s2, s3]]``: each query row runs from its own list (row 0 = its concatenation)."""
    c1, c2, c3 = (ids(arch, n, seed=30 + n) for n in (9, 4, 7))
    s1, s2, s3 = (hsc.encode(model, c) for c in (c1, c2, c3))
    queries = ids(arch, 3, batch=2, seed=40)
    logits = model(queries, past_states=[[s1], [s2, s3]]).logits
    assert relative_error(logits[:1], model(torch.cat([c1, queries[:1]], 1)).logits[:, -3:]) < arch.tol
    assert relative_error(logits[1:], model(queries[1:], past_states=[s2, s3]).logits) < arch.tol
    assert relative_error(logits[0, -1], logits[1, -1]) > MATTERS  # the rows' contexts differ, so do their logits


@torch.no_grad()
def test_continuing_a_state_equals_encoding_the_concatenation(arch, model):
    """encode(c1), then a forward of c2 from it as the model's cache, is encode(c1 + c2): every SSM layer's state,
    conv window and ΣΔ (accumulated over both forwards), and the token count."""
    c1, c2 = ids(arch, 7, batch=2, seed=50), ids(arch, 10, batch=2, seed=51)
    continued = hsc.encode(model, c1).clone()
    model(c2, use_cache=True, **compat.cache_kwargs(continued, hybrid=arch.has_attention), **positions(arch, c2, 7))
    whole = hsc.encode(model, torch.cat([c1, c2], 1))
    assert continued.num_tokens.tolist() == [17, 17] and continued.token_ids is None
    for v in range(whole.num_layers):
        for name in ("ssm_state", "conv_state", "delta_sum"):
            a, b = getattr(continued.state_layers[v], name), getattr(whole.state_layers[v], name)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"layer {v} {name}")


@torch.no_grad()
def test_composition_of_one_state_is_the_state(arch, model, state):
    """Every model-free method maps [state] to the state (ΣΔ and the SSM states as they were)."""
    for method in MODEL_FREE_METHODS:
        composer = StateComposer(method, weights=[1.0]) if method == "weighted" else StateComposer(method)
        composed = composer.compose([state])
        assert composed.num_tokens.tolist() == state.num_tokens.tolist(), method
        for v in range(state.num_layers):
            for name in ("ssm_state", "conv_state", "delta_sum"):
                a, b = getattr(composed.state_layers[v], name), getattr(state.state_layers[v], name)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{method} layer {v} {name}")


@pytest.fixture(scope="module")
def states(arch, model):
    with torch.no_grad():
        return [hsc.encode(model, ids(arch, n, seed=60 + n)) for n in (9, 14, 6)]


@torch.no_grad()
def test_every_method_runs_from_its_composed_state(arch, model, states):
    """forward / generate(past_states=states, composition=method) run from the state that
    ``StateComposer(method).compose(states, model=model)`` gives, fed as the model's cache, for every method; that
    state changes the logits (vs no context) and each method's differs from every other's, so an ignored method
    or a lost state fails."""
    query = ids(arch, 5, seed=80)
    plain = model(query).logits[:, -1]
    next_logits = {}
    for method in METHODS:
        composer = composer_of(method, 3)
        composed = composer.compose(states, model=model)
        expected = model(
            query,
            use_cache=True,
            **compat.cache_kwargs(composed.clone(), hybrid=arch.has_attention),
            **positions(arch, query, 29),
        ).logits
        logits = model(query, past_states=states, composition=composer).logits
        assert relative_error(logits, expected) < arch.tol, method
        assert relative_error(plain, expected[:, -1]) > MATTERS, method
        out = model.generate(query, past_states=states, composition=composer, max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 9), method
        if not arch.has_attention:  # (generate reads a cache with keys as holding the prompt's: it feeds no tokens)
            from_cache = model.generate(
                query,
                max_new_tokens=4,
                do_sample=False,
                **compat.cache_kwargs(composed.clone(), hybrid=arch.has_attention),
            )
            assert torch.equal(out, from_cache), method
        next_logits[method] = logits[:, -1]
    # (the tiny Bamba, GraniteMoeHybrid and Falcon-H1 forget a context within a few tokens, decays down to 1e-20:
    # soup and PICASO-S then agree to 1e-7 on their logits)
    for a, b in itertools.combinations(METHODS if not arch.has_attention else (), 2):
        assert relative_error(next_logits[a], next_logits[b]) > 1e-6, (a, b)  # (float32 rounding: 1e-7)


@torch.no_grad()
def test_composition_equals_the_float64_reference(arch, states):
    """Every model-free method, every SSM layer: the composed state is the plain float64 reference's composition
    (ops/compose/reference.py) of the states with their decays, ΣΔ the total (soup: the mean, weighted: the
    weighted sum), ``A`` the states'; a soup differs from each input (composition did something)."""
    weights = [0.2, 0.5, 0.3]
    if has_transitions(architecture(states[0].architecture)):
        return _check_delta_rule_compositions(states, weights)
    for method in MODEL_FREE_METHODS:
        composed = composer_of(method, 3).compose(states)
        assert composed.num_tokens.tolist() == [9 + 14 + 6], method
        w = torch.tensor(weights, dtype=torch.float64) if method == "weighted" else None
        for v in range(composed.num_layers):
            deltas = torch.stack([s.delta_sums[v] for s in states])
            ssm = [s.ssm_states[v].double() for s in states]
            expected = compose_ssm_ref(ssm, deltas.double(), states[0].A[v].double(), method, weights=w)
            torch.testing.assert_close(composed.ssm_states[v].double(), expected, rtol=1e-5, atol=1e-6, msg=method)
            if method == "weighted":
                total = (w.float().view(-1, *[1] * (deltas.dim() - 1)) * deltas).sum(0)
            else:
                total = deltas.mean(0) if method == "soup" else deltas.sum(0)
            torch.testing.assert_close(composed.delta_sums[v], total, msg=method)
            assert torch.equal(composed.A[v], states[0].A[v]), method
        if method == "soup":  # (CASO and PICASO of states that decay fast are close to the last state)
            assert all(relative_error(composed.ssm_states[0], s.ssm_states[0]) > 1e-3 for s in states)


def _check_delta_rule_compositions(states, weights):
    """Delta-rule states compose as affine maps S -> M S + S_C (ops/delta_rule/reference.py): caso the fold in list
    order, picaso_r the mean over the rotations, picaso_s over all orders, soup / weighted the weighted mean of the
    maps; every SSM layer's state and transition against the float64 reference, ΣΔ as for Mamba layers."""
    references = {
        "caso": lambda s, m: compose_in_order_reference(s, m),
        "picaso_r": lambda s, m: mean_over_orders_reference(s, m, orders=rotations(len(s))),
        "picaso_s": lambda s, m: mean_over_orders_reference(s, m),
    }
    for method in MODEL_FREE_METHODS:
        composed = composer_of(method, 3).compose(states)
        assert composed.num_tokens.tolist() == [9 + 14 + 6], method
        w = torch.tensor(weights if method == "weighted" else [1 / 3] * 3, dtype=torch.float64)
        for v in range(composed.num_layers):
            ssm = [s.ssm_states[v].double() for s in states]
            transitions = [s.transitions[v].double() for s in states]
            if method in references:
                state, transition = references[method](ssm, transitions)
            else:
                state = sum(wk * s for wk, s in zip(w, ssm))
                transition = sum(wk * m for wk, m in zip(w, transitions))
            torch.testing.assert_close(composed.ssm_states[v].double(), state, rtol=1e-5, atol=1e-6, msg=method)
            torch.testing.assert_close(composed.transitions[v].double(), transition, rtol=1e-5, atol=1e-6, msg=method)
            deltas = torch.stack([s.delta_sums[v] for s in states])
            total = (
                deltas.sum(0)
                if method in references
                else (w.float().view(-1, *[1] * (deltas.dim() - 1)) * deltas).sum(0)
            )
            torch.testing.assert_close(composed.delta_sums[v], total, msg=method)
        # the context persists: caso differs from the last state (the earlier contexts reach it through M)
        if method == "caso":
            assert relative_error(composed.ssm_states[0], states[-1].ssm_states[0]) > 1e-2


@torch.no_grad()
def test_nested_compositions_agree_where_the_maths_says(arch, states):
    """CASO is associative, nested weighted compositions multiply their weights, nested soups of equal sizes
    are the flat soup."""
    a, b, c = states
    d = a.clone()
    caso = StateComposer("caso")
    assert_same_layers(caso.compose([caso.compose([a, b]), caso.compose([c, d])]), caso.compose([a, b, c, d]))
    p, q = 0.3, 0.6
    inner = StateComposer("weighted", weights=[p, 1 - p]).compose([a, b])
    nested = StateComposer("weighted", weights=[q, 1 - q]).compose([inner, c])
    assert_same_layers(nested, StateComposer("weighted", weights=[q * p, q * (1 - p), 1 - q]).compose([a, b, c]))
    soup = StateComposer("soup")
    assert_same_layers(soup.compose([soup.compose([a, b]), soup.compose([c, a])]), soup.compose([a, b, c, a]))


@torch.no_grad()
def test_concat_re_encodes_the_concatenation(arch, model, states):
    tokens = torch.cat([s.token_ids for s in states], 1)
    assert_same_layers(StateComposer("concat").compose(states, model=model), hsc.encode(model, tokens))


# ------------------------------------------------------------------------------------------ files and copies
@torch.no_grad()
def test_save_load_round_trip_is_bit_for_bit(arch, model, state, tmp_path):
    path = tmp_path / "state.safetensors"
    state.save(path)
    assert all(t.numel() == 0 or torch.isfinite(t.float()).all() for t in load_file(path).values())
    query = ids(arch, 4, seed=6)
    expected = model.generate(query, past_states=[state], max_new_tokens=NEW, do_sample=False)
    for loaded in (ComposableMambaCache.load(path, model=model), type(state).load(path)):
        assert_same_state(loaded, state)
        assert loaded.model_dtype == state.model_dtype
        assert torch.equal(model.generate(query, past_states=[loaded], max_new_tokens=NEW, do_sample=False), expected)


@torch.no_grad()
def test_state_survives_deepcopy_pickle_and_torch_save(arch, model, state):
    import io

    query = ids(arch, 3, seed=7)
    expected = model(query, past_states=[state]).logits
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(state), pickle_round_trip(state), load_saved(buffer), state.clone(), state.to("cpu")):
        assert_same_state(copied, state)
        assert torch.equal(model(query, past_states=[copied]).logits, expected)


@torch.no_grad()
def test_enabled_model_survives_deepcopy_pickle_and_torch_save(arch, model, state, monkeypatch):
    """Each copy stays enabled and generates what the model does from the same states; in a fresh process (no
    enabled class made yet) unpickling makes the enabled class from the stock one."""
    from hf_statecompose.generation import integration

    query = ids(arch, 3, seed=9)
    expected = model.generate(query, past_states=[state], max_new_tokens=NEW, do_sample=False)
    for copied in (copy.deepcopy(model), pickle_round_trip(model), torch_save_round_trip(model)):
        assert hsc.is_enabled(copied) and hsc.get_backend(copied) == hsc.get_backend(model)
        assert torch.equal(copied.generate(query, past_states=[state], max_new_tokens=NEW, do_sample=False), expected)
    data = pickle.dumps(model)
    monkeypatch.setattr(integration, "_ENABLED_CLASSES", {})
    loaded = trusted_loads(data)
    assert type(loaded) is not type(model) and hsc.is_enabled(loaded)
    assert torch.equal(loaded.generate(query, past_states=[state], max_new_tokens=NEW, do_sample=False), expected)


def test_a_state_store_keeps_the_states(arch, tmp_path):
    """A StateStore (folder format) of this architecture: each entry is its text's state encoded alone (the store
    encodes padded batches), generates what that state does, survives delete + compact + reopen; a store of
    another model is refused."""
    from store_helpers import BagOfWords, CharTokenizer

    model, tokenizer = arch.make(vocab_size=STORE_VOCAB), CharTokenizer()
    texts = ["the cat sat on the mat", "dogs bark loudly at night", "a short one", "cats and dogs"]
    store = hsc.StateStore(tmp_path / "s", model, tokenizer, retriever=BagOfWords())
    keys = store.add(texts, show_progress=False, batch_size=3)
    with torch.no_grad():
        alone = [hsc.encode(model, torch.tensor([tokenizer(t)["input_ids"]])) for t in texts]
    for got, expected in zip(store.get(keys), alone, strict=True):
        assert_same_layers(got, expected)
    query = ids(arch, 4, seed=93)
    expected = model.generate(query, past_states=alone[:2], max_new_tokens=NEW, do_sample=False)
    assert torch.equal(
        model.generate(query, past_states=store.get(keys[:2]), max_new_tokens=NEW, do_sample=False), expected
    )
    assert store.retrieve("the cat", k=1)[0].text == texts[0]
    store.delete(keys[1])
    store.compact()
    again = hsc.StateStore(tmp_path / "s", model, tokenizer, retriever=BagOfWords())
    assert set(again.ids()) == {keys[0], keys[2], keys[3]}
    assert_same_layers(again.get(keys[3]), alone[3])
    with pytest.raises(ValueError, match="another model"):
        hsc.StateStore(tmp_path / "s", arch.make(seed=3, vocab_size=STORE_VOCAB), tokenizer, retriever=BagOfWords())


# ------------------------------------------------------------------------------------------ refusals
@torch.no_grad()
def test_a_state_of_another_model_is_refused(arch, model, state, tmp_path):
    other = arch.make(seed=1)  # same config, other weights
    query = ids(arch, 3)
    with pytest.raises(ValueError, match="re-encode"):
        other(query, past_states=[state])
    with pytest.raises(ValueError, match="re-encode"):
        StateComposer("concat").compose([state], model=other)
    with pytest.raises(ValueError, match=r"shape|another model"):  # other shapes: a smaller state size
        arch.make(**arch.smaller_state)(query, past_states=[state])
    if not arch.has_attention:  # (a hybrid's layer pattern fixes its depth)
        with pytest.raises(ValueError, match="layers"):
            arch.make(num_hidden_layers=3)(query, past_states=[state])
    path = tmp_path / "state.safetensors"
    state.save(path)
    with pytest.raises(ValueError, match=r"re-encode|another model|only fit"):
        ComposableMambaCache.load(path, model=other)


@torch.no_grad()
def test_a_state_of_another_architecture_is_refused(arch, model, state, tmp_path):
    """Both ways, in memory and as files: this architecture's state to a Mamba model (a Mamba-2 model for Mamba)
    and back; FalconMamba's states have a Mamba state's shapes, so only the architecture tells them apart."""
    other_name = "mamba2" if arch.name == "mamba" else "mamba"
    other = tiny_model(other_name)
    other_state = hsc.encode(other, torch.randint(3, 60, (1, 6)))
    with pytest.raises(ValueError, match=f"{arch.name}|another model|different model"):
        other(torch.randint(3, 60, (1, 3)), past_states=[state])
    with pytest.raises(ValueError, match=f"{other_name}|another model|different model"):
        model(ids(arch, 3), past_states=[other_state])
    with pytest.raises(ValueError, match="different model"):
        StateComposer("soup").compose([state, other_state])
    path, other_path = tmp_path / "state.safetensors", tmp_path / "other.safetensors"
    state.save(path)
    other_state.save(other_path)
    with pytest.raises(ValueError, match=r"re-encode|another model"):
        ComposableMambaCache.load(path, model=other)
    with pytest.raises(ValueError, match=r"re-encode|another model"):
        ComposableMambaCache.load(other_path, model=model)


def _edit_first_ssm(state, fn):
    bad = state.clone()
    layer = bad.state_layers[0]
    layer.ssm_state = fn(layer.ssm_state)
    return bad


BAD_STATES = {
    "nan": (lambda t: t * float("nan"), "layer 0 SSM state contains NaN"),
    "dtype": (lambda t: t.half(), r"layer 0 SSM state is torch.float16, expected torch.float32"),
    "shape": (lambda t: t[..., :-1], "layer 0 SSM state has per-row shape"),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
@torch.no_grad()
def test_bad_in_memory_states_are_refused(arch, model, state, case):
    edit, message = BAD_STATES[case]
    bad = _edit_first_ssm(state, edit)
    with pytest.raises(ValueError, match=message):
        model(ids(arch, 2), past_states=[bad])
    with pytest.raises(ValueError):
        check_state(bad, model)


CRAFTED = {
    "missing layer": (lambda t, m: t.pop("ssm.0"), r"missing tensors \['ssm.0'\]"),
    "nan": (lambda t, m: t.update({"ssm.0": t["ssm.0"] * float("nan")}), "NaN"),
    "dtype": (lambda t, m: t.update({"ssm.0": t["ssm.0"].double()}), "float64"),
    "shape": (lambda t, m: t.update({"ssm.0": t["ssm.0"][..., :-1].contiguous()}), "shape"),
    "layers": (lambda t, m: m.update(num_layers=m["num_layers"] + 1), "layers"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_files_are_refused(arch, model, state, case, tmp_path):
    """A state file edited by hand (digest recomputed, so that only the schema checks can refuse it)."""
    edit, message = CRAFTED[case]
    state.save(tmp_path / "state.safetensors")
    path = craft(tmp_path / "state.safetensors", tmp_path / "crafted.safetensors", edit)
    for kwargs in ({}, {"model": model}):
        with pytest.raises(ValueError, match=message):
            ComposableMambaCache.load(path, **kwargs)
