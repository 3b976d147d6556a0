"""The main job on the embedded demo model: store contexts once, retrieve, compose, generate; measured.

    python -m hf_statecompose.demo [--arch mamba2|mamba|hybrid|gdn] [--method picaso_r] [-k K] [--store DIR]
    python -m hf_statecompose.demo --grid [--arch ...] [--out benchmarks/results/demo_grid_mamba2.json]
                                  # right answers for k = 1..4, every method, and the baselines

1. Load the embedded demo model (``load_demo``: a 3.6M-parameter Mamba-2 by default; no download). It was
   trained on Wikipedia text and on a synthetic fact-recall task (``"Tari river Iron."`` facts about fictional
   towns, asked back as ``"Tari river"`` -> ``" Iron."``). What it can do: answer such questions from facts in
   its context. What it cannot: write English (a 3.6M-parameter model continues Wikipedia text with
   Wikipedia-like words that mean nothing; the demo shows one continuation, labelled as such).
2. Build a :class:`StateStore` from the bundled passages (``hf_statecompose/demo/data``: 12 synthetic
   passages about 24 fictional towns + 60 held-out Wikipedia paragraphs, CC BY-SA 4.0), indexed with the
   offline all-MiniLM-L6-v2 retriever. Each passage is encoded once.
3. Answer every bundled question (24; ``--questions`` fewer) three ways, measured in the same run: from the k
   retrieved passages' stored states composed (the method), by re-reading those passages' tokens before the
   query (concatenated contexts, the stock model's ``generate``), and with no context; accuracy and time per
   query as a table. The right answers are shown, and each wrong one with its diagnosis, computed from what was
   retrieved and answered (``answers.diagnose``): mostly the value of another retrieved town with the same
   relation, which the tiny model mixes up whether it reads the passages' tokens or their composed states.
4. Leave-one-out attribution: which retrieved passage mattered for one answer.
5. Check the exactness the library promises (one stored state + query generates exactly what
   context + query generates; exits with an error if not) and time composition against re-reading contexts.

Default k per model (``DEFAULT_K``), from ``--grid`` (all 24 questions, k = 1..4; table in
docs/getting-started/quickstart.md, every model in docs/experiments/demo-grid.md): the k at which PICASO-R answers the most questions right, on a tie the
smallest k >= 2 (so that states are composed). The Mamba-2 (default) and the hybrid: k = 2 (the Mamba-2 answers as
many at k = 1, fewer at 3 and 4; the answer's passage is retrieved first for 21 questions of 24, in the first two
for 23); the Mamba-1: k = 1 (about half as many right at k = 2); the GDN model: k = 3 (every question, as soon as
the answer's passage is among those retrieved). The reason for the small k: more retrieved passages bring more
towns that share the question's relation, which the Mamba models confuse (re-reading the passages' tokens too).
The method stays PICASO-R (order-invariant): at each model's default k it answers at least as many questions as soup
and PICASO-S, and as many as CASO except on the hybrid (one fewer of 24).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

from ..attribution import leave_one_out
from ..compat import quiet_transformers
from ..composition import METHODS, StateComposer
from ..pipeline import context_order
from ..state.cache import ComposableMambaCache
from ..store import StateStore
from . import DEMO_ARCHS, DEMO_DIR, load_demo
from .answers import MAX_NEW_TOKENS, Answered, answer_questions, diagnose, mean_ms, right_count

# the k with the most right answers over the 24 bundled questions (picaso_r; on a tie the smallest k >= 2), measured
# by `python -m hf_statecompose.demo --grid --arch <arch>` (docs/getting-started/quickstart.md)
DEFAULT_K = {"mamba2": 2, "mamba": 1, "hybrid": 2, "gdn": 3}
GRID_KS = (1, 2, 3, 4)
GRID_METHODS = ("soup", "caso", "picaso_s", "picaso_r")
SHOWN_RIGHT = 3  # right answers printed in full (every wrong one is)


def bundled(name: str) -> list[dict]:
    text = resources.files("hf_statecompose.demo").joinpath("data", name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main(argv=None):
    """The demo, without transformers' "Loading weights" bars and its advice to install CUDA kernels (the models
    run on the CPU): only the demo's own lines, and any real warning, are printed."""
    with quiet_transformers():
        _run(argv)


def _short(text: str, width: int = 48) -> str:
    text = " ".join(text.split())
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def _training_summary(arch: str) -> dict:
    path = DEMO_DIR / arch / "training_log.json"
    return json.loads(path.read_text())["summary"] if path.is_file() else {}


def _introduce(model, arch: str) -> None:
    summary = _training_summary(arch)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model: demo {arch}, {params:.2f}M parameters (load_demo), trained on Wikipedia text and a fact-recall task")
    can = 'can: answer "Town relation" -> " Value." about fictional towns from facts in its context'
    if "recall_accuracy_with_context" in summary:
        can += (
            f" ({summary['recall_accuracy_with_context']:.0%} of {summary['recall_questions']} unseen questions"
            f" with the fact's passage, {summary['recall_accuracy_no_context']:.0%} without: model card)"
        )
    print(f"  {can}")
    loss = summary.get("held_out_wikipedia_loss")
    print(
        "  cannot: write English"
        + (f" (held-out Wikipedia loss {loss:.2f} nats/token)" if loss is not None else "")
        + f": {params:.1f}M parameters learn recall and Wikipedia-like words, not language or knowledge (one"
        " continuation is shown at the end)"
    )


def _show_answers(items: list[Answered], method: str, k: int, size: str) -> None:
    key = (method, k)
    right = [item for item in items if item.right(key)]
    wrong = [item for item in items if not item.right(key)]
    what = "the stored state" if k == 1 else f"{k} stored states composed with {method}"
    print(
        f"\n{len(items)} questions, each answered by one stored passage; retrieve k={k}, generate from {what}:"
        f"\n  right: {len(right)}/{len(items)}" + (", e.g." if right else "")
    )
    for item in right[:SHOWN_RIGHT]:
        q = item.question
        passages = " ".join(f"[{rank}] {_short(e.text, 40)}" for rank, e in enumerate(item.retrieved[:k], 1))
        print(f"    {q['query']!r} -> {item.runs[key].answer!r}   from {passages}")
    if not wrong:
        return
    print(f"  wrong: {len(wrong)}/{len(items)}, and why (computed from what was retrieved and answered):")
    diagnoses = {id(item): diagnose(item, key) for item in wrong}
    for item in wrong:
        q = item.question
        print(f"    {q['query']!r} -> {item.runs[key].answer!r} (expected {q['answer']!r}): {diagnoses[id(item)]}")
    confused = sum(d.kind == "same relation" for d in diagnoses.values())
    also_concat = sum(not item.right(("concat", k)) for item in wrong)
    reading = (
        "re-reading the passage's tokens instead of using its state"
        if k == 1
        else "re-reading the passages' tokens instead of composing their states"
    )
    verdict = (
        "the model's limit, not the composition's"
        if also_concat == len(wrong)
        else f"the other {len(wrong) - also_concat} are the composition's"
    )
    print(
        f"  {confused} of the {len(wrong)} wrong answers are another retrieved town's value for the same relation"
        + (f": this {size} model mixes up towns that share a relation" if confused else "")
        + f". {reading[0].upper()}{reading[1:]} gets {also_concat} of these {len(wrong)} wrong too: {verdict}."
    )


def _comparison(items: list[Answered], method: str, k: int) -> None:
    n = len(items)
    rows = [
        (f"composed states ({method}, k={k})" if k > 1 else "one stored state (k=1)", (method, k), "compose"),
        (f"concatenated contexts (k={k})", ("concat", k), "re-read"),
        ("no context", "none", None),
    ]
    print(f"\n  {'':33}{'right':<13}{'state (ms)':<18}per query (ms)")
    for label, key, how in rows:
        right = right_count(items, key)
        state = f"{mean_ms(items, key, 'state_s'):6.1f} {how}" if how else f"{'-':>6}"
        print(f"  {label:33}{f'{right:2}/{n} ({right / n:.0%})':<13}{state:<18}{mean_ms(items, key):6.1f}")
    tokens = sum(sum(e.state.token_ids.shape[1] for e in item.retrieved[:k]) for item in items) / n
    print(
        "  (means over the questions; state: composing the stored states vs the stock model re-reading the passages'"
        f" tokens; per query: the whole generate call, state and {MAX_NEW_TOKENS} new tokens. The"
        f" {'passage holds' if k == 1 else f'{k} passages hold'} {tokens:.0f} tokens: re-reading them is one short"
        " forward pass; it grows with their length, composing does not: 10 contexts below)"
    )


def grid_table(items: list[Answered], ks=GRID_KS, methods=GRID_METHODS) -> str:
    """Markdown: per k, how often the answer's passage is retrieved, and right answers with no context,
    concatenated contexts and each composition method; then the mean time per query."""
    n = len(items)
    cell = lambda key: f"{right_count(items, key)}/{n}"
    head = ["k", "answer's passage retrieved", "no context", "concat", *methods]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for k in ks:
        hit = sum(item.gold_rank(k) is not None for item in items)
        row = [str(k), f"{hit}/{n}", cell("none"), cell(("concat", k)), *(cell((m, k)) for m in methods)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| k | ms per query: no context | concat (re-read ms) | " + " | ".join(methods) + " (compose ms) |"]
    lines.append("|" + "---:|" * (3 + len(methods)))
    for k in ks:
        timing = [
            f"{mean_ms(items, 'none'):.0f}",
            f"{mean_ms(items, ('concat', k)):.0f} ({mean_ms(items, ('concat', k), 'state_s'):.1f})",
            *(f"{mean_ms(items, (m, k)):.0f} ({mean_ms(items, (m, k), 'state_s'):.2f})" for m in methods),
        ]
        lines.append(f"| {k} | " + " | ".join(timing) + " |")
    return "\n".join(lines)


def grid_result(items: list[Answered], ks=GRID_KS, methods=GRID_METHODS) -> dict:
    """The grid as JSON: right answers (counts) and mean milliseconds per condition and k."""
    ms = lambda key, what="total_s": round(mean_ms(items, key, what), 3)
    conditions = ("concat", *methods)
    return {
        "questions": len(items),
        "k": list(ks),
        "answer_passage_retrieved": [sum(item.gold_rank(k) is not None for item in items) for k in ks],
        "right": {
            "none": right_count(items, "none"),
            **{c: [right_count(items, (c, k)) for k in ks] for c in conditions},
        },
        "ms_per_query": {"none": ms("none"), **{c: [ms((c, k)) for k in ks] for c in conditions}},
        "ms_to_state": {c: [ms((c, k), "state_s") for k in ks] for c in conditions},
        "torch_threads": torch.get_num_threads(),
    }


def _run(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mamba2", choices=list(DEMO_ARCHS))
    parser.add_argument("--method", default="picaso_r", choices=[m for m in METHODS if m != "weighted"])
    parser.add_argument(
        "-k", type=int, default=None, help="passages retrieved per question (default: DEFAULT_K, per --arch)"
    )
    parser.add_argument("--questions", type=int, default=None, help="how many of the 24 questions (default: all)")
    parser.add_argument("--store", default=None, help="keep the store in this folder (default: a temporary one)")
    parser.add_argument(
        "--grid",
        action="store_true",
        help=f"only print the accuracy grid: k in {GRID_KS}, methods {', '.join(GRID_METHODS)}, concat, no context",
    )
    parser.add_argument("--out", default=None, help="with --grid: also write it to this JSON file")
    args = parser.parse_args(argv)
    k = args.k if args.k is not None else DEFAULT_K[args.arch]
    if k < 1:
        parser.error("-k must be at least 1")

    model, tok = load_demo(args.arch)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    if not args.grid:
        _introduce(model, args.arch)
    passages = bundled("passages.jsonl")
    questions = bundled("questions.jsonl")
    if args.questions is not None:
        questions = questions[:: max(1, len(questions) // args.questions)][: args.questions]
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(args.store or tmp, model, tok)
        if len(store) == 0:
            t0 = time.perf_counter()
            store.add([p["text"] for p in passages], [{"source": p["source"]} for p in passages], show_progress=False)
            synthetic = sum(p["source"] == "synthetic" for p in passages)
            print(
                f"store: encoded {len(passages)} passages ({synthetic} of town facts, {len(passages) - synthetic}"
                f" Wikipedia paragraphs) once in {time.perf_counter() - t0:.1f} s -> {json.dumps(store.stats())}"
            )
        if args.grid:
            items = answer_questions(model, tok, store, questions, GRID_KS, GRID_METHODS)
            print(f"\ndemo {args.arch}, {len(questions)} questions: right answers\n")
            print(grid_table(items))
            if args.out:
                result = {"model": f"demo-{args.arch}", "torch": torch.__version__, **grid_result(items)}
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
            return

        items = answer_questions(model, tok, store, questions, (k,), (args.method,))
        _show_answers(items, args.method, k, f"{millions:.1f}M-parameter")
        _comparison(items, args.method, k)
        if args.k is None:
            print(
                f"  k={k} is this model's default: no other k in 1..4 answers more of these questions (measured by"
                " --grid: fewer passages miss more answers, more bring in more towns that share the question's"
                " relation)"
            )

        # leave-one-out on the first question answered right
        item = next((item for item in items if item.right((args.method, k))), items[0])
        q = item.question
        retrieved = item.retrieved[:k]
        attribution = leave_one_out(
            model,
            context_order(retrieved),
            tok(q["query"]).input_ids,
            tok(q["answer"]).input_ids,
            composition=args.method,
        )
        order = list(reversed(retrieved))
        print(
            f"\nwhich context mattered for {q['query']!r} -> {q['answer']!r} (rise of the answer's loss when left"
            " out, nats/token):"
        )
        for i in attribution.ranking():
            print(f"  {attribution.scores[i]:+.3f}  {_short(order[i].text, 70)}")

        wiki = next(p for p in passages if p["source"].startswith("Wikipedia"))
        words = wiki["text"].split()
        query = " ".join(words[:12])
        ids = tok(query, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
        held_out = wiki["source"].split(": ", 1)[-1] in _training_summary(args.arch).get("held_out_articles", [])
        print(
            f"\nwhat it cannot do: write. A {'held-out ' if held_out else ''}Wikipedia paragraph's first words,"
            f" no context: {query!r}\n  -> {tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)!r}"
            f"\n  (Wikipedia-like words, not knowledge: {millions:.1f}M parameters are too few to write English;"
            f" the article goes on {' '.join(words[12:20])!r})"
        )

        # exactness: one stored state + query == generate(context + query)
        entry = item.retrieved[0]
        query_ids = tok(q["query"], return_tensors="pt").input_ids
        alone = model.generate(
            query_ids, past_states=[entry.state], max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id
        )
        full = model.generate(
            torch.cat([entry.state.token_ids, query_ids], 1),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
        same = torch.equal(alone[0, -8:], full[0, -8:])
        print(f"\none stored state + query == generate(context + query): {same}")

        states = [e.state for e in store.retrieve(q["query"], 10)]
        composer = StateComposer(args.method)
        composer.compose(states, model=model)  # warm-up
        t0 = time.perf_counter()
        composer.compose(states, model=model)
        compose_s = time.perf_counter() - t0
        ids = torch.cat([s.token_ids for s in states], 1)
        t0 = time.perf_counter()
        ComposableMambaCache.encode(model, ids)
        concat_s = time.perf_counter() - t0
        print(
            f"10 contexts ({ids.shape[1]} tokens): {args.method} {compose_s * 1e3:.2f} ms vs re-reading them {concat_s * 1e3:.1f} ms"
        )
    if not same:
        raise SystemExit("exactness check failed")


if __name__ == "__main__":
    main()
