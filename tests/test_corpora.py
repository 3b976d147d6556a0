"""The demo corpora: deterministic Wikipedia split and synthetic recall worlds."""

from hf_statecompose.demo.corpora import RELATIONS, clean_wikitext, recall_training_text, recall_world, wikipedia_split


def test_recall_world_answers_are_only_in_their_passages():
    world = recall_world(3, towns=20)
    assert len(world.passages) == 10 and len(world.questions) == 20
    assert all(p.count("\n") == 2 and p.endswith("\n") for p in world.passages)  # two facts, one per line
    assert len({q.town for q in world.questions}) == 20
    assert recall_world(3, towns=20) == world  # deterministic, and across processes (no set order):
    assert recall_world(0, towns=2).passages == ["Bresol founded 1790.\nVedar founded 1810.\n"]
    for q in world.questions:
        statement = q.query + q.answer
        holders = [i for i, p in enumerate(world.passages) if statement[:-1] in p]
        assert holders == list(q.passages)
        assert q.answer.strip(" .") in RELATIONS[q.relation][2]


def test_recall_training_text_asks_back_every_fact_after_the_passages():
    import random

    lines = recall_training_text(random.Random(0)).split("\n")
    facts, questions = lines[: len(lines) // 2], lines[len(lines) // 2 :]
    assert len(facts) >= 2 and sorted(facts) == sorted(questions)


def test_wikipedia_split_is_disjoint_deterministic_and_clean():
    train, held_out = wikipedia_split()
    titles = [t for t, _ in train] + [t for t, _ in held_out]
    assert len(titles) == len(set(titles)) and len(titles) > 90
    assert 4 <= len(held_out) <= 20
    assert wikipedia_split()[1] == held_out
    for _, text in held_out:
        assert "'''" not in text and "[[" not in text and "{{" not in text
    assert clean_wikitext("== History ==\n'''Bold''' text.") == "History\nBold text."
