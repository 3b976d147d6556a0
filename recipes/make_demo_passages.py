"""Write the demo's bundled passages: hf_statecompose/demo/data/passages.jsonl.

    python recipes/make_demo_passages.py

* 12 synthetic passages (24 fictional towns, seed 7, one fact each, two towns per passage) with the
  questions they answer (hf_statecompose/demo/data/questions.jsonl);
* 60 paragraphs of the held-out Wikipedia articles of the gensim excerpt (never trained on), cut to
  at most 600 characters at a sentence end. Text © Wikipedia contributors, CC BY-SA 4.0.
"""

import json
import re
from pathlib import Path

from hf_statecompose.demo.corpora import recall_world, wikipedia_split

OUT = Path(__file__).resolve().parents[1] / "hf_statecompose" / "demo" / "data"


def cut(paragraph: str, limit: int = 600) -> str:
    if len(paragraph) <= limit:
        return paragraph
    sentences = re.split(r"(?<=[.!?]) ", paragraph)
    out = ""
    for sentence in sentences:
        if len(out) + len(sentence) + 1 > limit:
            break
        out = f"{out} {sentence}".strip()
    return out or paragraph[:limit]


def main():
    world = recall_world(7, towns=24)
    rows = [{"text": p, "source": "synthetic", "license": "CC0 (generated)"} for p in world.passages]
    _, held_out = wikipedia_split()
    per_article = 60 // len(held_out) + 1
    wiki = []
    for title, text in held_out:
        paragraphs = [p for p in text.split("\n") if len(p) >= 200][:per_article]
        wiki += [
            {"text": cut(p), "source": f"Wikipedia: {title}", "license": "CC BY-SA 4.0, © Wikipedia contributors"}
            for p in paragraphs
        ]
    rows += wiki[:60]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "passages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    questions = [
        {"query": q.query, "answer": q.answer, "town": q.town, "relation": q.relation} for q in world.questions
    ]
    (OUT / "questions.jsonl").write_text("".join(json.dumps(q) + "\n" for q in questions))
    print(f"wrote {len(rows)} passages and {len(questions)} questions to {OUT}")


if __name__ == "__main__":
    main()
