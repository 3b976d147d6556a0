"""Generate the data of the bundled lm-eval tasks (``hf_statecompose/lmeval/tasks/*.jsonl``), deterministically.

    python recipes/make_lm_eval_tasks.py            # rewrites the four .jsonl files next to the task YAMLs

* ``wikipedia.jsonl`` (task ``statecompose_wikipedia``, loglikelihood): segments of 128 tokens (demo
  tokenizer) of three held-out Wikipedia articles; a doc is a sampled segment: ``query`` = its first 64
  tokens decoded, ``continuation`` = the rest decoded, ``exclude_passages`` = [the segment itself] (it
  holds the answer; the model skips it when retrieving). Every segment of those articles is a passage.
* ``wikipedia_rolling.jsonl`` (task ``statecompose_wikipedia_rolling``, loglikelihood_rolling): the
  other held-out articles, cut at paragraph boundaries into documents of ~1500-2500 characters (four
  per article at most). None of this text is a passage.
* ``recall_mc.jsonl`` (task ``statecompose_recall_mc``, multiple_choice): every question of the
  synthetic recall world ``recall_world(2026, towns=60)`` (the one ``hf_statecompose.demo.eval`` uses); the
  choices are the right value and three other values of the same relation, shuffled. Every passage of
  the world is a passage.
* ``passages.jsonl``: the passages of both (``{"text", "source", ...}``), what ``passages=bundled`` indexes.

Wikipedia text: CC BY-SA 4.0, (c) Wikipedia contributors (the excerpt shipped in the gensim wheel).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parents[1] / "hf_statecompose" / "lmeval" / "tasks"
WIKI_ARTICLES = ("America the Beautiful", "Amateur astronomy", "Algae")  # 24 + 42 + 76 segments
WIKI_DOCS = 90
SEGMENT, HALF = 128, 64
ROLLING_DOCS_PER_ARTICLE = 4
WORLD_SEED, WORLD_TOWNS = 2026, 60
WIKI_LICENSE = "CC BY-SA 4.0, (c) Wikipedia contributors"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text(
        "".join(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n" for row in rows), encoding="utf-8"
    )


def rolling_documents(text: str, low: int = 1500, high: int = 2500) -> list[str]:
    docs, current = [], []
    for paragraph in text.split("\n"):
        current.append(paragraph)
        size = len("\n".join(current))
        if size >= low:
            joined = "\n".join(current)
            docs.append(joined if size <= high else joined[:high].rsplit(" ", 1)[0])
            current = []
    return docs


def main(argv=None) -> None:
    from transformers import AutoTokenizer

    from hf_statecompose.demo import DEMO_DIR
    from hf_statecompose.demo.corpora import RELATIONS, recall_world, segments, wikipedia_split

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(TASKS_DIR))
    out = Path(parser.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_DIR / "mamba2", local_files_only=True)
    _, held_out = wikipedia_split()
    by_title = dict(held_out)
    missing = [t for t in WIKI_ARTICLES if t not in by_title]
    if missing:
        raise SystemExit(f"held-out articles missing from the split: {missing}")

    passages, wiki_segments = [], []
    for title in WIKI_ARTICLES:
        for number, segment in enumerate(segments(by_title[title], tokenizer, SEGMENT)):
            wiki_segments.append(segment)
            passages.append(
                {"text": segment, "source": "wikipedia", "title": title, "segment": number, "license": WIKI_LICENSE}
            )
    rng = random.Random(0)
    wiki_docs = []
    for index in sorted(rng.sample(range(len(wiki_segments)), WIKI_DOCS)):
        ids = tokenizer(wiki_segments[index], add_special_tokens=False)["input_ids"]
        query, continuation = tokenizer.decode(ids[:HALF]), tokenizer.decode(ids[HALF:])
        if query + continuation != wiki_segments[index]:
            raise SystemExit(f"segment {index}: query + continuation does not decode back to the segment")
        wiki_docs.append(
            {
                "id": f"wiki-{index}",
                "title": passages[index]["title"],
                "query": query,
                "continuation": continuation,
                "exclude_passages": [wiki_segments[index]],
            }
        )

    rolling = []
    for title, text in held_out:
        if title in WIKI_ARTICLES:
            continue
        for number, doc in enumerate(rolling_documents(text)[:ROLLING_DOCS_PER_ARTICLE]):
            rolling.append({"id": f"{title}-{number}", "title": title, "text": doc})

    world = recall_world(WORLD_SEED, towns=WORLD_TOWNS)
    for number, text in enumerate(world.passages):
        passages.append(
            {
                "text": text,
                "source": "recall",
                "world_seed": WORLD_SEED,
                "passage": number,
                "license": "CC0 (generated)",
            }
        )
    rng = random.Random(WORLD_SEED)
    mc = []
    for q in world.questions:
        right = q.answer.strip(" .")
        others = rng.sample([v for v in RELATIONS[q.relation][2] if v != right], 3)
        values = [right] + others
        rng.shuffle(values)
        mc.append(
            {
                "id": f"recall-{q.town}",
                "query": q.query,
                "choices": [f" {v}." for v in values],
                "gold": values.index(right),
                "relation": q.relation,
                "answer_passage": q.passages[0],
            }
        )

    write_jsonl(out / "passages.jsonl", passages)
    write_jsonl(out / "wikipedia.jsonl", wiki_docs)
    write_jsonl(out / "wikipedia_rolling.jsonl", rolling)
    write_jsonl(out / "recall_mc.jsonl", mc)
    for name in ("passages", "wikipedia", "wikipedia_rolling", "recall_mc"):
        path = out / f"{name}.jsonl"
        print(f"{path}: {sum(1 for _ in path.open())} rows, {path.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
