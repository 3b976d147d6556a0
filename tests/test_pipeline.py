"""generate_with_retrieval, continuation_losses and leave-one-out attribution, on tiny random models."""

import pytest
import torch

import hf_statecompose as hsc

from helpers import random_ids
from store_helpers import TEXTS, BagOfWords, CharTokenizer


@pytest.fixture
def store(tmp_path, model):
    store = hsc.StateStore(tmp_path / "s", model, CharTokenizer(), retriever=BagOfWords())
    store.add(TEXTS, show_progress=False)
    return store


def ids_of(text):
    return torch.tensor([CharTokenizer()(text)["input_ids"]])


def test_one_retrieved_context_generates_exactly_what_the_concatenation_does(model, store):
    query = "which town is known for wool?"
    result = hsc.generate_with_retrieval(model, CharTokenizer(), query, store, k=1, max_new_tokens=8, do_sample=False)
    assert [e.text for e in result.retrieved] == [TEXTS[3]]
    full = model.generate(torch.cat([ids_of(TEXTS[3]), ids_of(query)], 1), max_new_tokens=8, do_sample=False)
    assert torch.equal(result.sequences[0, -8:], full[0, -8:])
    assert result.sequences.shape[1] == ids_of(query).shape[1] + 8  # query + new tokens, as generate returns
    none = hsc.generate_with_retrieval(model, CharTokenizer(), query, store, k=0, max_new_tokens=8, do_sample=False)
    assert none.retrieved == [] and torch.equal(
        none.sequences, model.generate(ids_of(query), max_new_tokens=8, do_sample=False)
    )


def test_contexts_are_composed_most_relevant_last(model, store):
    query = "which town is known for wool?"
    result = hsc.generate_with_retrieval(
        model, CharTokenizer(), query, store, k=3, composition="caso", max_new_tokens=6, do_sample=False
    )
    states = [e.state for e in result.retrieved]
    expected = model.generate(
        ids_of(query), past_states=states[::-1], composition="caso", max_new_tokens=6, do_sample=False
    )
    assert torch.equal(result.sequences, expected)
    with pytest.raises(ValueError, match="query"):
        hsc.generate_with_retrieval(model, CharTokenizer(), "", store)


def test_continuation_losses_match_full_forwards(model):
    g = torch.Generator().manual_seed(3)
    context, query, continuation = random_ids(20, generator=g), random_ids(7, generator=g), random_ids(9, generator=g)
    state = hsc.ComposableMambaCache.encode(model, context)
    other = hsc.ComposableMambaCache.encode(model, random_ids(11, generator=g))
    losses = hsc.continuation_losses(model, [state, None, other], query, continuation)

    def reference(prefix):
        ids = torch.cat([prefix, query, continuation], 1)
        logits = model(input_ids=ids).logits[0, -continuation.shape[1] - 1 : -1].double()
        return torch.nn.functional.cross_entropy(logits, continuation[0]).item()

    assert losses[0].item() == pytest.approx(reference(context), rel=1e-5)
    assert losses[1].item() == pytest.approx(reference(context[:, :0]), rel=1e-6)
    assert losses[2].item() == pytest.approx(
        hsc.continuation_losses(model, [other], query, continuation)[0].item(), rel=1e-6
    )
    with pytest.raises(ValueError, match="tokens"):
        hsc.continuation_losses(model, [None], query, continuation[:, :0])


@pytest.mark.parametrize("method", ["picaso_r", "soup"])
def test_leave_one_out_equals_brute_force(model, method):
    g = torch.Generator().manual_seed(4)
    states = [hsc.ComposableMambaCache.encode(model, random_ids(12 + i, generator=g)) for i in range(4)]
    query, continuation = random_ids(6, generator=g), random_ids(8, generator=g)
    result = hsc.leave_one_out(model, states, query, continuation, composition=method)
    composer = hsc.StateComposer(method)

    def loss(subset):
        ids = torch.cat([query, continuation], 1)
        logits = (
            model(input_ids=ids, past_states=[composer.compose(subset)]).logits[0, query.shape[1] - 1 : -1].double()
        )
        return torch.nn.functional.cross_entropy(logits, continuation[0]).item()

    assert result.loss_all == pytest.approx(loss(states), rel=1e-5)
    for i in range(4):
        expected = loss(states[:i] + states[i + 1 :])
        assert result.loss_without[i] == pytest.approx(expected, rel=1e-5)
        assert result.scores[i] == pytest.approx(expected - result.loss_all, abs=1e-5)
    assert sorted(result.ranking(), key=lambda i: -result.scores[i]) == result.ranking()
    single = hsc.leave_one_out(model, states[:1], query, continuation)
    assert single.loss_without[0] == pytest.approx(
        hsc.continuation_losses(model, [None], query, continuation)[0].item()
    )
    with pytest.raises(ValueError, match="at least one"):
        hsc.leave_one_out(model, [], query, continuation)
