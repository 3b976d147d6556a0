"""The main job on the embedded demo model: store contexts once, retrieve, compose, generate.

    python -m hf_statecompose.demo [--arch mamba2|mamba|hybrid|gdn] [--method picaso_r] [-k 4] [--store DIR]

1. Load the embedded demo model (``load_demo``: a 3.6M-parameter Mamba-2, or Mamba-1, trained on
   Wikipedia text and a synthetic fact-recall task; no download).
2. Build a :class:`StateStore` from the bundled passages (``hf_statecompose/demo/data``: 12 synthetic
   passages about 24 fictional towns + 60 held-out Wikipedia paragraphs, CC BY-SA 4.0), indexed with the
   offline all-MiniLM-L6-v2 retriever. Each passage is encoded once.
3. For questions whose answers are only in the passages: retrieve k states, compose them, generate; and
   the same without context. Then which retrieved passage mattered (leave-one-out attribution).
4. Check the exactness the library promises (one stored state + query generates exactly what
   context + query generates) and time composition against re-reading the contexts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib import resources

import torch

from ..attribution import leave_one_out
from ..compat import quiet_transformers
from ..composition import METHODS, StateComposer
from ..pipeline import context_order, generate_with_retrieval
from ..state.cache import ComposableMambaCache
from ..store import StateStore
from . import DEMO_ARCHS, load_demo


def bundled(name: str) -> list[dict]:
    text = resources.files("hf_statecompose.demo").joinpath("data", name).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def main(argv=None):
    """The demo, without transformers' "Loading weights" bars and its advice to install CUDA kernels (the models
    run on the CPU): only the demo's own lines, and any real warning, are printed."""
    with quiet_transformers():
        _run(argv)


def _run(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="mamba2", choices=list(DEMO_ARCHS))
    parser.add_argument("--method", default="picaso_r", choices=[m for m in METHODS if m != "weighted"])
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--store", default=None, help="keep the store in this folder (default: a temporary one)")
    args = parser.parse_args(argv)

    model, tok = load_demo(args.arch)
    print(f"model: demo {args.arch}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters (load_demo)")
    passages = bundled("passages.jsonl")
    questions = bundled("questions.jsonl")
    questions = questions[:: max(1, len(questions) // args.questions)][: args.questions]
    with tempfile.TemporaryDirectory() as tmp:
        store = StateStore(args.store or tmp, model, tok)
        if len(store) == 0:
            t0 = time.perf_counter()
            store.add([p["text"] for p in passages], [{"source": p["source"]} for p in passages], show_progress=False)
            print(
                f"store: encoded {len(passages)} passages once in {time.perf_counter() - t0:.1f} s -> {json.dumps(store.stats())}"
            )

        correct = 0
        for q in questions:
            with_context = generate_with_retrieval(
                model, tok, q["query"], store, k=args.k, composition=args.method, max_new_tokens=4, do_sample=False
            )
            without = generate_with_retrieval(model, tok, q["query"], store, k=0, max_new_tokens=4, do_sample=False)
            answer = with_context.text.split(".")[0] + "."
            correct += answer == q["answer"]
            print(f"\nquery: {q['query']!r}   expected {q['answer']!r}")
            for rank, entry in enumerate(with_context.retrieved, 1):
                print(f"  retrieved [{rank}] {entry.score:.2f} {entry.text[:70]!r}")
            print(
                f"  {args.method} of {len(with_context.retrieved)} states -> {with_context.text!r}   | no context -> {without.text!r}"
            )
        print(f"\n{correct}/{len(questions)} answers right from composed states ({args.method}, k={args.k})")

        q = questions[0]
        retrieved = store.retrieve(q["query"], args.k)
        attribution = leave_one_out(
            model,
            context_order(retrieved),
            tok(q["query"]).input_ids,
            tok(q["answer"]).input_ids,
            composition=args.method,
        )
        order = list(reversed(retrieved))
        print(f"\nwhich context mattered for {q['query']!r} (loss rise when left out, nats/token):")
        for i in attribution.ranking():
            print(f"  {attribution.scores[i]:+.3f}  {order[i].text[:70]!r}")

        wiki = next(p for p in passages if p["source"].startswith("Wikipedia"))
        words = wiki["text"].split()
        query = " ".join(words[:12])
        out = generate_with_retrieval(
            model, tok, query, store, k=args.k, composition=args.method, max_new_tokens=24, do_sample=False
        )
        print(f"\nWikipedia query {query!r}\n  -> {out.text!r}")

        # exactness: one stored state + query == generate(context + query)
        entry = store.retrieve(q["query"], 1)[0]
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
