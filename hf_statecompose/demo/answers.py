"""The demo's questions answered three ways, measured: from composed stored states, with no context, and by
re-reading the retrieved passages' tokens (concatenated contexts + query); and why a wrong answer is wrong.

Used by the main job (``python -m hf_statecompose.demo``, ``run.py``) and its accuracy grid
(``python -m hf_statecompose.demo --grid``).

A bundled question (``questions.jsonl``) is ``"Town relation"`` (``"Sollo river"``) and its answer the value
(``" North."``), stated only in one synthetic passage (two facts about two fictional towns,
``"Sollo river North.\\nSuve river Grey.\\n"``). An answer is the generated text up to its first full stop
(``" North."``); it is right when it equals the expected one.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

from ..composition import StateComposer
from ..pipeline import context_order

MAX_NEW_TOKENS = 4  # every bundled answer (" North.", " 1880.") fits in 4 tokens
_FACT = re.compile(r"(\S+) (\S+) (\S+\.)")  # "Tari river Iron."


@dataclass(frozen=True)
class Fact:
    """One ``"Town relation Value."`` line of a retrieved passage; ``rank`` is the passage's (1 = best)."""

    town: str
    relation: str
    value: str  # with its leading space and full stop, like the expected answers: " Iron."
    rank: int

    def __str__(self) -> str:
        return f"{self.town} {self.relation}{self.value}"


def facts(text: str, rank: int = 0) -> list[Fact]:
    """The facts stated in a passage (none in a Wikipedia paragraph)."""
    out = []
    for line in text.splitlines():
        match = _FACT.fullmatch(line.strip())
        if match:
            out.append(Fact(match.group(1), match.group(2), " " + match.group(3), rank))
    return out


def answer_of(generated: str) -> str:
    """The answer in a generation: the text up to and with its first full stop."""
    return generated.split(".")[0] + "."


@dataclass
class Run:
    """One way of answering one question: the generated text, and how long it took (seconds)."""

    text: str
    state_s: float  # to obtain the conditioning state: composing the stored states / re-reading the passages
    total_s: float  # the whole answer: one generate call (which composes the states / reads the passages first)

    @property
    def answer(self) -> str:
        return answer_of(self.text)


@dataclass
class Answered:
    """A question, what the store returned for it (best first) and its runs: ``runs["none"]``,
    ``runs["concat", k]`` and ``runs[method, k]``."""

    question: dict
    retrieved: list
    runs: dict = field(default_factory=dict)

    def right(self, key) -> bool:
        return self.runs[key].answer == self.question["answer"]

    def gold_rank(self, k: int) -> int | None:
        """The rank (1 = best) of the passage stating the answer among the first ``k`` retrieved, or None."""
        fact = self.question["query"] + self.question["answer"]
        for rank, entry in enumerate(self.retrieved[:k], 1):
            if fact in entry.text.splitlines():
                return rank
        return None


@dataclass
class Diagnosis:
    """Why a wrong answer is wrong, computed from the retrieved passages: ``kind`` is

    * ``"same relation"``: the answer is the value of another town's fact with the question's relation, in a
      retrieved passage (``fact``; ``same_passage`` when it sits next to the right fact);
    * ``"other relation"``: the value of a retrieved fact with another relation (``fact``);
    * ``"not retrieved"``: no retrieved passage states the answer;
    * ``"no context"``: the answer is the one given without any context;
    * ``"elsewhere"``: none of these (a value from no retrieved passage, or a garbled one).
    """

    kind: str
    answer: str
    fact: Fact | None = None
    same_passage: bool = False
    gold_rank: int | None = None

    def __str__(self) -> str:
        where = f"retrieved [{self.fact.rank}]" if self.fact else ""
        missed = "; the passage stating the answer was not retrieved" if self.gold_rank is None else ""
        if self.kind == "same relation":
            assert self.fact is not None
            beside = ", beside the right fact" if self.same_passage else ""
            return (
                f"{self.answer!r} is {self.fact.town}'s {self.fact.relation} ({str(self.fact)!r}, {where}{beside}):"
                f" another town, same relation{missed}"
            )
        if self.kind == "other relation":
            assert self.fact is not None
            return f"{self.answer!r} is the value of {str(self.fact)!r} ({where}), another relation"
        if self.kind == "not retrieved":
            return f"no retrieved passage states the answer; {self.answer!r} is a guess"
        if self.kind == "no context":
            return (
                f"{self.answer!r} is also the answer without context: the right passage (retrieved"
                f" [{self.gold_rank}]) was not used"
            )
        return f"{self.answer!r} is in no retrieved passage, though the right one is (retrieved [{self.gold_rank}])"


def diagnose(item: Answered, key) -> Diagnosis:
    """Why ``item.runs[key]`` (a composed or concatenated run at some k) is wrong."""
    k = key[1]
    answer = item.runs[key].answer
    q = item.question
    relation = q["query"].split()[-1]
    gold = item.gold_rank(k)
    found = [f for rank, e in enumerate(item.retrieved[:k], 1) for f in facts(e.text, rank) if f.value == answer]
    others = [f for f in found if f.town != q["town"]]
    same = [f for f in others if f.relation == relation]
    if same:
        fact = min(same, key=lambda f: f.rank)
        return Diagnosis("same relation", answer, fact, same_passage=fact.rank == gold, gold_rank=gold)
    if gold is None:
        return Diagnosis("not retrieved", answer)
    if others:
        return Diagnosis("other relation", answer, min(others, key=lambda f: f.rank), gold_rank=gold)
    if "none" in item.runs and answer == item.runs["none"].answer:
        return Diagnosis("no context", answer, gold_rank=gold)
    return Diagnosis("elsewhere", answer, gold_rank=gold)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


@torch.no_grad()
def answer_questions(model, tokenizer, store, questions, ks, methods, log=None) -> list[Answered]:
    """Answer every question with no context, and for every ``k`` in ``ks`` by re-reading the top-k retrieved
    passages (``concat``: their tokens, least relevant first, then the query; one stock ``generate``) and from
    their stored states composed by each of ``methods`` (``generate(query, past_states=..., composition=...)``).
    Each run's ``state_s`` is timed apart (``compose`` / the stock model's forward over the concatenated passages),
    ``total_s`` is the ``generate`` call. Retrieval runs once per question (``max(ks)`` passages)."""
    device = next(model.parameters()).device
    composers = {m: StateComposer(m) for m in methods}
    options = {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}

    def generate(ids, **extra):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **options, **extra)
        return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    def concat(query_ids, entries):
        contexts = torch.cat([s.token_ids.to(device) for s in context_order(entries)], 1)
        _, state_s = _timed(lambda: model(input_ids=contexts))  # the re-reading alone: the stock model's forward
        text, total_s = _timed(lambda: generate(torch.cat([contexts, query_ids], 1)))
        return Run(text, state_s, total_s)

    def composed(query_ids, entries, method):
        states = context_order(entries)
        _, state_s = _timed(lambda: composers[method].compose(states, model=model))  # the composition alone
        text, total_s = _timed(lambda: generate(query_ids, past_states=states, composition=composers[method]))
        return Run(text, state_s, total_s)

    out = []
    for number, q in enumerate(questions):
        query_ids = tokenizer(q["query"], return_tensors="pt").input_ids.to(device)
        item = Answered(q, store.retrieve(q["query"], max(ks)))
        if number == 0:  # warm-up: the first call of each path pays one-off costs
            generate(query_ids)
            concat(query_ids, item.retrieved[: max(ks)])
            for method in methods:
                composed(query_ids, item.retrieved[: max(ks)], method)
        text, seconds = _timed(lambda: generate(query_ids))  # noqa: B023 - _timed calls it at once
        item.runs["none"] = Run(text, 0.0, seconds)
        for k in ks:
            item.runs["concat", k] = concat(query_ids, item.retrieved[:k])
            for method in methods:
                item.runs[method, k] = composed(query_ids, item.retrieved[:k], method)
        out.append(item)
        if log is not None and (number + 1) % 8 == 0:
            log(f"  {number + 1}/{len(questions)} questions")
    return out


def right_count(items: list[Answered], key) -> int:
    return sum(item.right(key) for item in items)


def mean_ms(items: list[Answered], key, what: str = "total_s") -> float:
    return 1e3 * sum(getattr(item.runs[key], what) for item in items) / len(items)
