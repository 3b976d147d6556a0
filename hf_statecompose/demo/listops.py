"""ListOps, generated as the Long Range Arena defines it, for causal language models.

The generator follows ``lra_benchmarks/data/listops.py`` of google-research/long-range-arena (Tay et
al., 2021), with a seeded ``random.Random`` instead of the global one:

* a node at depth ``d < max_depth`` is an operator with probability 0.25 (LRA's ``VALUE_P``), else a
  digit 0–9; at ``max_depth`` it is always a digit; the root has depth 1;
* an operator node draws its argument count uniformly from ``2 … max_args``, generates its arguments
  (left to right), then draws its operator uniformly from ``MAX, MIN, MED, SM`` (the draw order of LRA);
* operators: ``MAX`` and ``MIN``; ``SM`` = sum mod 10; ``MED`` = ``int(numpy.median(args))``, which
  for an even argument count is the **floor of the mean of the two middle values** (``[MED 1 4 ]`` is
  2, neither the lower-middle 1 nor the upper-middle 4); for an odd count, the middle value;
* the length of an expression is its token count, LRA's ``length`` (operators, digits and ``]``; LRA's
  parentheses are an artefact of its string format that its input pipelines strip); trees whose
  length is outside ``[min_length, max_length]`` are drawn again (LRA: ``min_length < length <
  max_length``; here both bounds are inclusive), and LRA keeps unique expressions only (here: the
  recipe excludes held-out expressions from training).

As a causal LM task an example is ``expression = answer``: the expression tokens, the answer marker
``=``, then the answer digit; the loss and the accuracy are taken on the answer token only (labels
are -100 elsewhere). That turns the 10-way classification into next-token prediction, so the same
``*ForCausalLM`` classes train on it unchanged; accuracy is the argmax over the 10 digit tokens' logits
at the ``=`` position. The vocabulary is fixed (17 tokens, :data:`VOCAB`: pad, 4 operators, `]`, 10 digits, `=`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

MAX, MIN, MED, SUM_MOD = "[MAX", "[MIN", "[MED", "[SM"
OPERATORS = (MAX, MIN, MED, SUM_MOD)
END = "]"
DIGITS = tuple(str(d) for d in range(10))
ANSWER_MARKER = "="
PAD = "<pad>"
VOCAB = (PAD, *OPERATORS, END, *DIGITS, ANSWER_MARKER)
TOKEN_IDS = {token: index for index, token in enumerate(VOCAB)}
PAD_ID = TOKEN_IDS[PAD]
DIGIT_IDS = tuple(TOKEN_IDS[d] for d in DIGITS)
ANSWER_MARKER_ID = TOKEN_IDS[ANSWER_MARKER]
OPERATOR_PROBABILITY = 0.25  # LRA: r = random(); r > VALUE_P (0.25) -> a digit

# a tree is a digit or (operator, [arguments])
Tree = int | tuple


@dataclass(frozen=True)
class ListOpsConfig:
    """Shape of the generated expressions. LRA: ``max_depth=10, max_args=10, min_length=500,
    max_length=2000`` (:data:`LRA_CONFIG`)."""

    max_depth: int = 10
    max_args: int = 10
    min_length: int = 500
    max_length: int = 2000

    def __post_init__(self):
        if self.max_depth < 2 or self.max_args < 2:
            raise ValueError(
                f"max_depth and max_args must be >= 2 (an operator needs depth 2 and 2 arguments), got {self}"
            )
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"need 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}")


LRA_CONFIG = ListOpsConfig()


@dataclass(frozen=True)
class ListOpsExample:
    tokens: tuple[str, ...]  # the expression, e.g. ("[MAX", "2", "9", "]")
    answer: int

    def text(self) -> str:
        """``"[MAX 2 9 ] = 9"``."""
        return " ".join((*self.tokens, ANSWER_MARKER, str(self.answer)))


def generate_tree(rng: random.Random, depth: int, max_depth: int, max_args: int) -> tuple[Tree, int]:
    """LRA's ``generate_tree``: ``(tree, length in tokens)``, the same random draws in the same order."""
    r = rng.random() if depth < max_depth else 1.0
    if r > OPERATOR_PROBABILITY:
        return rng.choice(range(10)), 1
    length = 2  # the operator and its "]"
    arguments = []
    for _ in range(rng.randint(2, max_args)):
        subtree, sub_length = generate_tree(rng, depth + 1, max_depth, max_args)
        arguments.append(subtree)
        length += sub_length
    return (rng.choice(OPERATORS), arguments), length


def apply_operator(operator: str, values: list[int]) -> int:
    if operator == MAX:
        return max(values)
    if operator == MIN:
        return min(values)
    if operator == SUM_MOD:
        return sum(values) % 10
    if operator == MED:
        # int(numpy.median(values)) without numpy: even count -> floor((a + b) / 2) of the middle two
        ordered, half = sorted(values), len(values) // 2
        return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) // 2
    raise ValueError(f"unknown ListOps operator {operator!r}; the operators are {OPERATORS}")


def evaluate(tree: Tree) -> int:
    if isinstance(tree, int):
        return tree
    operator, arguments = tree
    return apply_operator(operator, [evaluate(argument) for argument in arguments])


def to_tokens(tree: Tree) -> list[str]:
    if isinstance(tree, int):
        return [str(tree)]
    operator, arguments = tree
    out = [operator]
    for argument in arguments:
        out += to_tokens(argument)
    return out + [END]


def parse(expression: str | list[str] | tuple[str, ...]) -> Tree:
    """The tree of ``"[MAX 2 9 [MIN 4 7 ] 0 ]"`` (or of its token list); raises ``ValueError`` on
    anything that is not one well-formed expression."""
    tokens = expression.split() if isinstance(expression, str) else list(expression)
    position = 0

    def node() -> Tree:
        nonlocal position
        if position >= len(tokens):
            raise ValueError(f"ListOps expression ends early: {' '.join(tokens)!r}")
        token = tokens[position]
        position += 1
        if token in DIGITS:
            return int(token)
        if token not in OPERATORS:
            raise ValueError(f"unexpected token {token!r} at {position - 1} in {' '.join(tokens)!r}")
        arguments = []
        while position < len(tokens) and tokens[position] != END:
            arguments.append(node())
        if position >= len(tokens) or not arguments:
            raise ValueError(f"operator {token} without arguments or without its ']' in {' '.join(tokens)!r}")
        position += 1
        return token, arguments

    tree = node()
    if position != len(tokens):
        raise ValueError(f"trailing tokens after the expression in {' '.join(tokens)!r}")
    return tree


def evaluate_expression(expression: str | list[str] | tuple[str, ...]) -> int:
    """``evaluate_expression("[MED 1 4 ]") == 2``."""
    return evaluate(parse(expression))


def sample(rng: random.Random, config: ListOpsConfig) -> ListOpsExample:
    """One expression whose length is within the config's bounds (rejection sampling, as LRA)."""
    while True:
        tree, length = generate_tree(rng, 1, config.max_depth, config.max_args)
        if config.min_length <= length <= config.max_length:
            return ListOpsExample(tuple(to_tokens(tree)), evaluate(tree))


def examples(seed: int, count: int, config: ListOpsConfig, exclude: frozenset = frozenset()) -> list[ListOpsExample]:
    """``count`` examples drawn from ``random.Random(seed)``, skipping expressions in ``exclude``."""
    return list(stream(seed, config, exclude, count))


def stream(
    seed: int, config: ListOpsConfig, exclude: frozenset = frozenset(), count: int | None = None
) -> Iterator[ListOpsExample]:
    """Examples from ``random.Random(seed)`` (deterministic per seed), ``count`` of them or endless;
    expressions in ``exclude`` (token tuples, e.g. a held-out set's) are skipped."""
    rng, made = random.Random(seed), 0
    while count is None or made < count:
        example = sample(rng, config)
        if example.tokens in exclude:
            continue
        made += 1
        yield example


# ------------------------------------------------------------------------------------------ tokens
def encode_example(example: ListOpsExample) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of ``expression = answer``; the labels are -100 except on the answer
    (transformers' causal LMs shift them: the answer is predicted at the ``=`` position)."""
    ids = [TOKEN_IDS[t] for t in example.tokens] + [ANSWER_MARKER_ID, TOKEN_IDS[str(example.answer)]]
    return ids, [-100] * (len(ids) - 1) + [ids[-1]]


def collate(batch: list[ListOpsExample]):
    """Left-padded ``(input_ids, attention_mask, labels)`` tensors ``[B, T]``: every row ends with its
    answer, so the answer is always predicted at position ``T - 2``."""
    import torch

    encoded = [encode_example(e) for e in batch]
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(encoded):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        labels[row, width - len(ids) :] = torch.tensor(row_labels)
        mask[row, width - len(ids) :] = 1
    return input_ids, mask, labels


def hf_tokenizer():
    """A ``PreTrainedTokenizerFast`` over :data:`VOCAB` (whitespace-separated tokens, ids as here), to
    save beside a ListOps checkpoint: ``tok("[MAX 2 9 ] =").input_ids``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(vocab=dict(TOKEN_IDS), unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, unk_token=PAD, padding_side="left")


def majority_baseline(batch: list[ListOpsExample]) -> tuple[int, float]:
    """``(most frequent answer, its frequency)``: the accuracy of always answering it."""
    counts = [0] * 10
    for example in batch:
        counts[example.answer] += 1
    best = max(range(10), key=counts.__getitem__)
    return best, counts[best] / max(1, len(batch))
