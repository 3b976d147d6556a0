"""ListOps as Long Range Arena generates it: operator semantics, determinism, length bounds, labels."""

import random

import pytest

from hf_statecompose.demo import listops as L

SMALL = L.ListOpsConfig(max_depth=6, max_args=10, min_length=32, max_length=128)


@pytest.mark.parametrize(
    "expression, value",
    [
        ("7", 7),
        ("[MAX 2 9 4 ]", 9),
        ("[MIN 2 9 4 ]", 2),
        ("[SM 2 9 4 ]", 5),  # 15 mod 10
        ("[SM 0 0 ]", 0),
        ("[MED 3 1 2 ]", 2),  # odd count: the middle value
        ("[MED 1 4 ]", 2),  # even count: int(numpy.median) = floor(2.5), neither 1 nor 4
        ("[MED 1 2 ]", 1),  # floor(1.5)
        ("[MED 9 0 7 2 ]", 4),  # middle two 2, 7 -> floor(4.5)
        ("[MED 5 5 ]", 5),
        ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
        ("[SM [MAX 3 8 ] [MIN 4 7 ] [MED 1 9 ] ]", 7),  # 8 + 4 + 5 = 17
        ("[MIN [SM 9 9 ] [MAX [MED 0 2 6 ] 1 ] ]", 2),  # min(8, max(2, 1))
    ],
)
def test_operator_semantics_on_hand_made_expressions(expression, value):
    assert L.evaluate_expression(expression) == value


def test_median_equals_numpy_median_truncated_as_lra():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for _ in range(500):
        values = [rng.randrange(10) for _ in range(rng.randint(2, 10))]
        assert L.apply_operator(L.MED, values) == int(np.median(values))


@pytest.mark.parametrize("bad", ["[MAX 1 2", "[MAX ]", "[MAX 1 ] 2", "[FIRST 1 ]", "]"])
def test_parse_refuses_malformed_expressions(bad):
    with pytest.raises(ValueError):
        L.parse(bad)


def test_generated_expressions_parse_back_to_their_answers_and_respect_length_bounds():
    batch = L.examples(3, 300, SMALL)
    for example in batch:
        assert SMALL.min_length <= len(example.tokens) <= SMALL.max_length
        assert L.evaluate_expression(example.tokens) == example.answer
        assert set(example.tokens) <= set(L.VOCAB) - {L.PAD, L.ANSWER_MARKER}
    assert max(len(e.tokens) for e in batch) > 96 and min(len(e.tokens) for e in batch) < 48  # spans the range


def test_lengths_count_tokens_as_lra_does():
    rng = random.Random(5)
    for _ in range(200):
        tree, length = L.generate_tree(rng, 1, 5, 6)
        assert length == len(L.to_tokens(tree))


def test_deterministic_per_seed_and_different_across_seeds():
    assert L.examples(1, 50, SMALL) == L.examples(1, 50, SMALL)
    assert L.examples(1, 50, SMALL) != L.examples(2, 50, SMALL)


def test_exclude_skips_held_out_expressions():
    held_out = L.examples(7, 20, SMALL)
    excluded = frozenset(e.tokens for e in held_out)
    assert not excluded & {e.tokens for e in L.examples(7, 40, SMALL, exclude=excluded)}


def test_labels_are_not_degenerate():
    batch = L.examples(11, 2000, SMALL)
    answers = {e.answer for e in batch}
    _majority, frequency = L.majority_baseline(batch)
    assert answers == set(range(10))
    assert frequency < 0.2  # measured: 0.153 (answer 0); 9 and 0 are the most frequent (MAX / MIN)


def test_encoding_puts_the_only_label_on_the_answer_and_collate_left_pads():
    torch = pytest.importorskip("torch")
    short, long = L.ListOpsExample(("[MAX", "2", "9", "]"), 9), L.ListOpsExample(("[SM", "2", "9", "4", "]"), 5)
    ids, labels = L.encode_example(short)
    assert [L.VOCAB[i] for i in ids] == ["[MAX", "2", "9", "]", "=", "9"]
    assert labels == [-100] * 5 + [L.TOKEN_IDS["9"]]
    input_ids, mask, batch_labels = L.collate([short, long])
    assert input_ids.shape == (2, 7) and input_ids[0, 0] == L.PAD_ID and mask[0].tolist() == [0] + [1] * 6
    assert torch.equal(input_ids[:, -2], torch.full((2,), L.ANSWER_MARKER_ID))
    assert (batch_labels != -100).sum() == 2 and batch_labels[1, -1] == L.TOKEN_IDS["5"]


def test_hf_tokenizer_matches_the_fixed_vocabulary():
    pytest.importorskip("transformers")
    tokenizer = L.hf_tokenizer()
    example = L.ListOpsExample(("[MED", "1", "4", "]"), 2)
    assert tokenizer(example.text()).input_ids == L.encode_example(example)[0]
    assert len(tokenizer) == len(L.VOCAB) == 17


def test_config_rejects_impossible_bounds():
    with pytest.raises(ValueError):
        L.ListOpsConfig(min_length=10, max_length=5)
