"""The embedded demo models (real trained weights), the CLI, the evaluation and attribution on them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.demo import DEMO_DIR
from hf_statecompose.demo.corpora import recall_world

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["mamba2", "mamba"])
def demo(request):
    return hsc.load_demo(request.param)


def test_checkpoints_are_small_safetensors_with_model_cards():
    for arch in ("mamba2", "mamba"):
        folder = DEMO_DIR / arch
        assert (folder / "model.safetensors").stat().st_size <= 20 * 2**20
        assert not [p for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]
        card = (ROOT / "model_cards" / f"demo-{arch}.md").read_text()
        assert card == (folder / "README.md").read_text()
        assert "CC BY-SA 4.0" in card and "gensim" in card
    with pytest.raises(ValueError, match="arch"):
        hsc.load_demo("gpt2")


def _recall_losses(model, tok, world, with_context: bool):
    out = []
    for q in world.questions:
        state = None
        if with_context:
            ids = torch.tensor([tok(world.passages[q.passages[0]])["input_ids"]])
            state = hsc.ComposableMambaCache.encode(model, ids)
        out.append(
            hsc.continuation_losses(
                model, [state], torch.tensor(tok(q.query)["input_ids"]), torch.tensor(tok(q.answer)["input_ids"])
            )[0].item()
        )
    return sum(out) / len(out)


def test_demo_models_answer_from_their_context(demo):
    """The point of the demo models: the answer's passage, given as a state, cuts the answer's loss."""
    model, tok = demo
    world = recall_world(99, towns=8)  # a world never seen in training
    without, with_context = _recall_losses(model, tok, world, False), _recall_losses(model, tok, world, True)
    assert with_context < 0.5 * without, (with_context, without)


def test_leave_one_out_finds_the_passage_that_holds_the_answer(demo):
    model, tok = demo
    world = recall_world(5, towns=16)
    states = [hsc.ComposableMambaCache.encode(model, torch.tensor([tok(p)["input_ids"]])) for p in world.passages]
    found = 0
    questions = world.questions[::2]
    for q in questions:
        gold = q.passages[0]
        others = [i for i in range(len(world.passages)) if i != gold][gold % 4 : gold % 4 + 3]
        contexts = others[:2] + [gold] + others[2:]
        result = hsc.leave_one_out(
            model, [states[i] for i in contexts], tok(q.query)["input_ids"], tok(q.answer)["input_ids"]
        )
        found += contexts[result.ranking()[0]] == gold
    assert found >= 0.75 * len(questions), f"{found}/{len(questions)}"


def test_cli_build_query_stats_delete_compact(tmp_path, capsys):
    from hf_statecompose.cli import main

    rows = [
        json.loads(line)
        for line in (ROOT / "hf_statecompose" / "demo" / "data" / "passages.jsonl").read_text().splitlines()
    ]
    source = tmp_path / "passages.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows[:12] + rows[12:18]))
    store = str(tmp_path / "store")
    assert main(["build", store, str(source), "--model", "demo", "--batch-size", "8"]) == 0
    assert '"entries": 18' in capsys.readouterr().out
    questions = [
        json.loads(line)
        for line in (ROOT / "hf_statecompose" / "demo" / "data" / "questions.jsonl").read_text().splitlines()
    ][:8]
    right = 0
    for question in questions:
        assert main(["query", store, question["query"], "-k", "1", "--max-new-tokens", "4", "--json"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert question["town"] in answer["retrieved"][0]["text"]  # MiniLM finds the town's passage
        right += answer["generated"].startswith(question["answer"])  # and the model reads it from the state
    # chance is 1 in 20 values; the demo Mamba-2 answers 70-90% of unseen questions from their passage
    # (5/8 here: it confuses two towns whose facts share a relation, and years)
    assert right >= 4, f"{right}/8"
    assert main(["query", store, questions[0]["query"], "-k", "3", "--composition", "soup"]) == 0
    assert capsys.readouterr().out.count("\n[") == 2  # three retrieved lines
    main(["stats", store])
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 18 and stats["storage_dtype"] == "fp32"
    assert main(["delete", store, answer["retrieved"][0]["id"]]) == 0
    main(["compact", store])
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["removed_entries"] == 1
    with pytest.raises(SystemExit):
        main(["query", str(tmp_path / "nowhere"), "hello"])
    plain = tmp_path / "passages.txt"
    plain.write_text("First passage.\n\nSecond\npassage.\n")
    assert main(["build", str(tmp_path / "plain"), str(plain), "--storage-dtype", "bf16"]) == 0
    assert '"storage_dtype": "bf16"' in capsys.readouterr().out


def test_module_and_console_entry_points_run():
    done = subprocess.run(
        [sys.executable, "-m", "hf_statecompose", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "build" in done.stdout and "query" in done.stdout


def test_evaluation_protocol_on_recall(tmp_path):
    from hf_statecompose.demo.eval import EVALUATED_METHODS as METHODS
    from hf_statecompose.demo.eval import evaluate, plot, table

    model, tok = hsc.load_demo("mamba2")
    result = evaluate(model, tok, "recall", queries=4, k_max=3, log=lambda *a: None)
    assert result["samples"] == 4 and result["k"] == [0, 1, 2, 3]
    assert set(result["loss"]) == {"baseline", *METHODS}
    assert result["seconds"]["picaso_r"][0] is None and result["seconds"]["picaso_r"][1] > 0
    # one context: every method is that context's state, so every loss is the same
    at_one = [result["loss"][m][1] for m in METHODS]
    assert max(at_one) - min(at_one) < 1e-5
    assert result["retrieval_hit_rate"][3] >= 0.75  # MiniLM finds the town's passage
    assert all(v == result["loss"]["baseline"][0] for v in result["loss"]["baseline"])
    result["model"] = "demo-mamba2"
    plot([result], tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 10_000
    assert "PICASO-R" in table([result])


# ------------------------------------------------------------------------------------ the main job
@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    """One store of the bundled passages for the demo-runs below (the demo builds it on its first run)."""
    return str(tmp_path_factory.mktemp("demo") / "store")


def _lines_after(printed: str, header: str) -> list[str]:
    """The indented lines that follow the line starting with ``header`` (stripped)."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    out = []
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        out.append(line.strip())
    return out


def test_the_main_job_reports_what_it_measured(demo_store, capsys):
    """`python -m hf_statecompose.demo`, defaults (Mamba-2, every question, k = DEFAULT_K, PICASO-R): what the model
    can and cannot do, right answers and a diagnosis of each wrong one, the table of composed states vs concatenated
    contexts vs no context; every figure recomputed here through the library's ordinary path."""
    import re

    from hf_statecompose.demo.run import DEFAULT_K, bundled, main
    from hf_statecompose.pipeline import generate_with_retrieval

    main(["--store", demo_store])
    printed = capsys.readouterr().out
    k, n = DEFAULT_K["mamba2"], len(bundled("questions.jsonl"))
    assert "model: demo mamba2" in printed and "\n  can: " in printed and "\n  cannot: write English" in printed
    assert "what it cannot do: write." in printed  # the Wikipedia continuation is labelled as such
    assert "one stored state + query == generate(context + query): True" in printed

    # the table: three rows, each "right/n"
    table = {
        label: int(re.search(rf"^  {re.escape(label)}\s+(\d+)/{n} ", printed, re.M).group(1))
        for label in (
            f"composed states (picaso_r, k={k})" if k > 1 else "one stored state (k=1)",
            f"concatenated contexts (k={k})",
            "no context",
        )
    }
    composed, concat, none = table.values()
    # the same counts through generate_with_retrieval (the composed states) and plain generate (concatenated tokens)
    model, tok = hsc.load_demo("mamba2")
    store = hsc.StateStore(demo_store, model, tok)
    right = {"composed": 0, "none": 0, "concat": 0}
    for q in bundled("questions.jsonl"):
        with_states = generate_with_retrieval(model, tok, q["query"], store, k=k, max_new_tokens=4, do_sample=False)
        without = generate_with_retrieval(model, tok, q["query"], store, k=0, max_new_tokens=4, do_sample=False)
        ids = torch.cat(
            [e.state.token_ids for e in reversed(with_states.retrieved)]
            + [tok(q["query"], return_tensors="pt").input_ids],
            1,
        )
        reread = tok.decode(model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :])
        right["composed"] += with_states.text.split(".")[0] + "." == q["answer"]
        right["none"] += without.text.split(".")[0] + "." == q["answer"]
        right["concat"] += reread.split(".")[0] + "." == q["answer"]
    assert (composed, concat, none) == (right["composed"], right["concat"], right["none"])
    assert composed > none + n // 3  # the composed states carry the answers (the context changes the output)

    # right and wrong answers: the counts agree with the table, and every wrong one is listed with a diagnosis
    assert f"right: {composed}/{n}" in printed
    if composed < n:
        wrong = _lines_after(printed, f"wrong: {n - composed}/{n}")
        assert len(wrong) == n - composed
        # a diagnosis that names another retrieved town with the same relation: that fact is in that retrieved passage
        pattern = re.compile(r"^'(\S+) (\S+)' -> '(.+?)' .*?'(\S+) (\S+) (\S+)', retrieved \[(\d)\].*same relation")
        named = 0
        for line in wrong:
            match = pattern.match(line)
            if not match:
                continue
            town, relation, answer, other, other_relation, value, rank = match.groups()
            assert other != town and other_relation == relation and answer == f" {value}"
            passage = store.retrieve(f"{town} {relation}", k)[int(rank) - 1].text
            assert f"{other} {relation} {value}" in passage.splitlines()
            named += 1
        assert f"{named} of the {n - composed} wrong answers are another retrieved town's value" in printed


def test_the_grid(demo_store, capsys, tmp_path):
    """`--grid`: right answers per k and method; at k = 1 every method is the one stored state, which generates what
    the passage's tokens + query generate (concat), so the row agrees; no context is the same at every k."""
    from hf_statecompose.demo.run import GRID_KS, GRID_METHODS, main

    main(["--grid", "--questions", "6", "--store", demo_store, "--out", str(tmp_path / "grid.json")])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "/6 |" in line]
    assert [row.split("|")[1].strip() for row in rows] == [str(k) for k in GRID_KS]
    cells = [[cell.strip() for cell in row.split("|")[2:-1]] for row in rows]
    assert all(len(row) == 3 + len(GRID_METHODS) for row in cells)
    assert len({row[1] for row in cells}) == 1  # no context
    assert len(set(cells[0][2:])) == 1, cells[0]  # k = 1: concat and every method
    written = json.loads((tmp_path / "grid.json").read_text())
    assert written["questions"] == 6 and written["k"] == list(GRID_KS)
    assert [f"{r}/6" for r in written["right"]["picaso_r"]] == [row[-1] for row in cells]


def test_diagnoses_are_computed_from_the_retrieved_passages():
    from types import SimpleNamespace

    from hf_statecompose.demo.answers import Answered, Run, diagnose

    def item(passages, answer, without=" Oslo."):
        question = {"query": "Sollo river", "answer": " North.", "town": "Sollo", "relation": "river"}
        out = Answered(question, [SimpleNamespace(text=p) for p in passages])
        out.runs["none"] = Run(without, 0.0, 0.0)
        out.runs["picaso_r", len(passages)] = Run(answer + "\nE", 0.0, 0.0)
        return out

    right, other = "Sollo river North.\nSuve river Grey.\n", "Tari river Iron.\nLori product tea.\n"
    d = diagnose(item([right, other], " Iron."), ("picaso_r", 2))
    assert (d.kind, d.fact.town, d.fact.rank, d.same_passage) == ("same relation", "Tari", 2, False)
    assert "Tari river Iron." in str(d) and "same relation" in str(d)
    d = diagnose(item([right, other], " Grey."), ("picaso_r", 2))
    assert (d.kind, d.fact.town, d.same_passage) == ("same relation", "Suve", True)
    assert diagnose(item([right, other], " tea."), ("picaso_r", 2)).kind == "other relation"
    assert diagnose(item([other], " Green."), ("picaso_r", 1)).kind == "not retrieved"
    assert diagnose(item([right], " Oslo."), ("picaso_r", 1)).kind == "no context"
    assert diagnose(item([right], " Green."), ("picaso_r", 1)).kind == "elsewhere"
    assert item([right], " North.").right(("picaso_r", 1))


def test_every_demo_arch_has_a_default_k():
    from hf_statecompose.demo import DEMO_ARCHS
    from hf_statecompose.demo.run import DEFAULT_K

    assert set(DEFAULT_K) == set(DEMO_ARCHS) and all(1 <= k <= 4 for k in DEFAULT_K.values())


def test_each_default_k_is_the_one_its_measured_grid_picks():
    """DEFAULT_K follows from the committed grids (``--grid --out``): the k where PICASO-R answers the most questions,
    on a tie the smallest k >= 2 (so that states are composed), else the smallest."""
    from hf_statecompose.demo.run import DEFAULT_K

    for arch, k in DEFAULT_K.items():
        grid = json.loads((ROOT / "benchmarks" / "results" / f"demo_grid_{arch}.json").read_text())
        right = dict(zip(grid["k"], grid["right"]["picaso_r"], strict=True))
        best = [kk for kk, n in right.items() if n == max(right.values())]
        composed = [kk for kk in best if kk >= 2]
        assert k == (min(composed) if composed else min(best)), (arch, right)
