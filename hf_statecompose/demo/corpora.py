"""The two corpora of the demo models and their evaluation, built offline and deterministically.

* **Wikipedia**: the English Wikipedia excerpt that ships inside the ``gensim`` wheel
  (``gensim/test/test_data/enwiki-latest-pages-articles1*.bz2``, 106 articles). Wikipedia text is
  licensed CC BY-SA 4.0 (https://creativecommons.org/licenses/by-sa/4.0/), © Wikipedia contributors;
  the demo models are trained on it and the bundled demo passages quote it. Articles are split into
  train / held-out by a hash of their title, so the split never depends on file order.
* **Synthetic multi-context fact recall**: fictional towns with one fact each, two towns per passage.
  A question's answer is only in its town's passage, so a model can only answer it from its
  (retrieved, composed) context; a fresh random world per seed means nothing can be memorised. Facts
  are terse records, ``"Gasol river Iron."``, asked back as ``"Gasol river"`` → ``" Iron."``. Why so
  terse: a model this small has to learn recall in minutes, which needs the key right before the value
  (inside the 4-token conv window) and a one-token key (a town name; 256 possible names), and the
  training loss on the answers only (``recipes/train_demo.py``). Earlier designs, English sentences
  (``"Gasol lies on the river Iron."``) and four facts per town (a key of town *and* relation),
  showed no recall at all after 800 training steps.
"""

from __future__ import annotations

import bz2
import glob
import hashlib
import os
import random
import re
from dataclasses import dataclass

HELD_OUT_FRACTION = 0.1


# ---------------------------------------------------------------------------------------- Wikipedia
def wikipedia_dump_path() -> str:
    try:
        import gensim
    except ImportError as error:
        raise ImportError(
            "the Wikipedia corpus ships inside the gensim wheel: pip install -c constraints.txt 'hf_statecompose[recipes]'"
        ) from error
    found = sorted(
        glob.glob(
            os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", "enwiki-latest-pages-articles1*.bz2")
        )
    )
    if not found:
        raise FileNotFoundError(
            "gensim is installed but its Wikipedia test excerpt (enwiki-latest-pages-articles1*.bz2) is missing"
        )
    return found[0]


def clean_wikitext(text: str) -> str:
    """gensim's markup filter, then bold/italic quotes, tables and empty lines removed; headings kept as text."""
    from gensim.corpora.wikicorpus import filter_wiki

    text = filter_wiki(text)
    paragraphs = []
    for line in text.split("\n"):
        line = line.strip()
        if not line or line.startswith(("|", "!", "{", "}")):
            continue
        line = re.sub(r"'{2,}", "", line)
        heading = re.fullmatch(r"=+\s*(.*?)\s*=+", line)
        if heading:
            line = heading.group(1)
            if not line:
                continue
        line = re.sub(r"\s+", " ", line).strip(" *#:;")
        if line:
            paragraphs.append(line)
    return "\n".join(paragraphs)


def wikipedia_articles(min_chars: int = 2000) -> list[tuple[str, str]]:
    """``[(title, cleaned text)]`` of the excerpt's articles (redirects and stubs dropped), file order."""
    from gensim.corpora.wikicorpus import extract_pages

    articles = []
    with bz2.BZ2File(wikipedia_dump_path()) as handle:
        for title, text, _ in extract_pages(handle, filter_namespaces=("0",)):
            if text.lstrip().lower().startswith("#redirect"):
                continue
            cleaned = clean_wikitext(text)
            if len(cleaned) >= min_chars:
                articles.append((title, cleaned))
    return articles


def is_held_out(title: str) -> bool:
    digest = hashlib.sha256(title.encode("utf-8")).digest()
    return digest[0] < 256 * HELD_OUT_FRACTION


def wikipedia_split() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(train, held_out)`` articles; held-out is ~10 % of them, chosen by title hash."""
    articles = wikipedia_articles()
    return [a for a in articles if not is_held_out(a[0])], [a for a in articles if is_held_out(a[0])]


def segments(text: str, tokenizer, length: int) -> list[str]:
    """Consecutive segments of ``length`` tokens (the last, shorter one dropped), decoded back to text."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[i : i + length]) for i in range(0, len(ids) - length + 1, length)]


# ------------------------------------------------------------------------------ synthetic recall set
# 16 syllables -> 256 two-syllable town names, each frequent enough in training to be one BPE token
_SYLLABLES = "ka ve lo ri ta mo su ne dar vel or ith bre sol mir gan".split()
RELATIONS = {
    "country": (
        "{town} country {value}.",
        "{town} country",
        [
            "France",
            "Peru",
            "Norway",
            "Kenya",
            "Japan",
            "Chile",
            "Egypt",
            "Canada",
            "Poland",
            "India",
            "Mexico",
            "Spain",
            "Brazil",
            "Sweden",
            "Greece",
            "Ghana",
            "Nepal",
            "Italy",
            "Cuba",
            "Iran",
        ],
    ),
    "product": (
        "{town} product {value}.",
        "{town} product",
        [
            "copper",
            "wool",
            "cheese",
            "silver",
            "glass",
            "salt",
            "timber",
            "honey",
            "olives",
            "wine",
            "paper",
            "rice",
            "tea",
            "iron",
            "cotton",
            "pottery",
            "tobacco",
            "leather",
            "pearls",
            "coal",
        ],
    ),
    "river": (
        "{town} river {value}.",
        "{town} river",
        [
            "Amber",
            "Stone",
            "Silver",
            "Black",
            "White",
            "Green",
            "Red",
            "Long",
            "Swift",
            "Cold",
            "North",
            "Deep",
            "Clear",
            "Iron",
            "Bright",
            "Dark",
            "Wild",
            "Quiet",
            "Golden",
            "Grey",
        ],
    ),
    "year": ("{town} founded {value}.", "{town} founded", [str(y) for y in range(1700, 1900, 10)]),
}
RELATION_ORDER = ("country", "product", "river", "year")
FACTS_PER_PASSAGE = 2


@dataclass(frozen=True)
class RecallQuestion:
    town: str
    relation: str
    query: str  # "Velmora product"
    answer: str  # " wool."
    passages: tuple[int, ...]  # index of the passage that holds the answer


@dataclass(frozen=True)
class RecallWorld:
    passages: list[str]
    questions: list[RecallQuestion]


def town_names(rng: random.Random, count: int) -> list[str]:
    if count > len(_SYLLABLES) ** 2:
        raise ValueError(f"at most {len(_SYLLABLES) ** 2} towns")
    names: set[str] = set()
    while len(names) < count:
        names.add("".join(rng.choice(_SYLLABLES) for _ in range(2)).capitalize())
    ordered = sorted(names)  # never set order: it changes with PYTHONHASHSEED
    rng.shuffle(ordered)
    return ordered


def recall_world(seed: int, towns: int) -> RecallWorld:
    """``towns`` fictional towns with one random fact each (relation and value), two towns' facts per
    passage, one fact per line, each line ending with a newline (so a query composed after passages
    starts a line, as in training). Each question asks one town's fact; its answer is in one passage only."""
    rng = random.Random(seed)
    passages: list[str] = []
    questions: list[RecallQuestion] = []
    names = town_names(rng, towns)
    for start in range(0, len(names), FACTS_PER_PASSAGE):
        lines = []
        for town in names[start : start + FACTS_PER_PASSAGE]:
            relation = rng.choice(RELATION_ORDER)
            statement, query, values = RELATIONS[relation]
            value = rng.choice(values)
            # the town is always line-initial, so it tokenizes the same in passages and in queries
            # (byte-level BPE gives " Qusol" and "Qusol" different tokens)
            lines.append(statement.format(town=town, value=value))
            questions.append(RecallQuestion(town, relation, query.format(town=town), f" {value}.", (len(passages),)))
        passages.append("".join(line + "\n" for line in lines))  # every line ends with a newline
    return RecallWorld(passages, questions)


def recall_training_text(rng: random.Random, max_towns: int = 16) -> str:
    """One training example: a fresh little world's passages (shuffled), then every one of its facts
    asked back (shuffled), each followed by its answer: dense recall signal."""
    world = recall_world(rng.randrange(1 << 30), towns=rng.randint(2, max_towns))
    passages = list(world.passages)
    questions = list(world.questions)
    rng.shuffle(passages)
    rng.shuffle(questions)
    return "".join(passages) + "\n".join(q.query + q.answer for q in questions)
