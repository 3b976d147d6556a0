"""Command line: build a state store from a text / JSONL file, query it, inspect and maintain it.

    python -m hf_statecompose build  STORE passages.jsonl [--model demo] [--storage-dtype bf16]
    python -m hf_statecompose query  STORE "Velmora product" [-k 5] [--composition picaso_r]
    python -m hf_statecompose stats  STORE
    python -m hf_statecompose delete STORE ID [ID ...]
    python -m hf_statecompose compact STORE
    python -m hf_statecompose lm-eval run --model statecompose --model_args ... --tasks ...

(also installed as the console script ``hf-statecompose``). ``--model`` is ``demo`` (the embedded
Mamba-2), ``demo-mamba`` (the embedded Mamba-1) or a local checkpoint folder; ``build`` records it in
the store, so ``query`` reopens the same model by default. Input: ``.jsonl`` with one object per line
(``"text"`` plus any other fields, kept as metadata) or plain text, one passage per blank-line-separated
paragraph.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_model(spec: str):
    from .demo import DEMO_SPECS, load_demo

    if spec in DEMO_SPECS:
        return load_demo(DEMO_SPECS[spec])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .generation.integration import enable

    if not Path(spec).is_dir():
        raise SystemExit(f"--model {spec!r}: not 'demo', 'demo-mamba' or a local checkpoint folder (nothing is downloaded)")
    model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True)
    return enable(model.eval()), AutoTokenizer.from_pretrained(spec, local_files_only=True)


def read_passages(path: str, text_field: str = "text") -> tuple[list[str], list[dict]]:
    source = Path(path)
    if not source.is_file():
        raise SystemExit(f"no input file {path}")
    if source.suffix == ".jsonl":
        from .store.passages import parse_passages_jsonl

        try:
            return parse_passages_jsonl(source.read_text(encoding="utf-8"), path, text_field)
        except ValueError as error:
            raise SystemExit(str(error)) from None
    texts, metadata = [], []
    for block in source.read_text(encoding="utf-8").split("\n\n"):
        if block.strip():
            texts.append(" ".join(block.split()))
            metadata.append({})
    if not texts:
        raise SystemExit(f"{path} holds no passages")
    return texts, metadata


def open_store(path: str, model_spec: str | None, storage_dtype: str | None = None, create: bool = False):
    from .store import StateStore

    header = Path(path) / "store.json"
    if not create and not header.is_file():
        raise SystemExit(f"no store at {path} (build one with: python -m hf_statecompose build {path} FILE)")
    if model_spec is None:
        model_spec = json.loads(header.read_text()).get("info", {}).get("model", "demo") if header.is_file() else "demo"
    model, tokenizer = load_model(model_spec)
    return StateStore(path, model, tokenizer, storage_dtype=storage_dtype, info={"model": model_spec}), model, tokenizer


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "lm-eval":  # lm-eval's own CLI with the `statecompose` model and our tasks
        from .lmeval import run_cli

        return run_cli(argv[1:])
    parser = argparse.ArgumentParser(prog="hf-statecompose", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("lm-eval", help="lm-eval's command line with the `statecompose` model and the bundled tasks (see README)", add_help=False)
    build = sub.add_parser("build", help="encode passages into a store (creates or extends it)")
    build.add_argument("store")
    build.add_argument("input", help=".jsonl (one {'text': ...} per line) or a text file (blank-line-separated passages)")
    build.add_argument("--model", default=None, help="demo | demo-mamba | checkpoint folder (default: the store's, else demo)")
    build.add_argument("--storage-dtype", choices=["fp32", "bf16"], default=None)
    build.add_argument("--batch-size", type=int, default=16)
    build.add_argument("--text-field", default="text")
    query = sub.add_parser("query", help="retrieve, compose, generate")
    query.add_argument("store")
    query.add_argument("query")
    query.add_argument("-k", type=int, default=5)
    query.add_argument("--composition", default="picaso_r")
    query.add_argument("--max-new-tokens", type=int, default=32)
    query.add_argument("--model", default=None)
    query.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    for name in ("stats", "compact"):
        sub.add_parser(name).add_argument("store")
    delete = sub.add_parser("delete")
    delete.add_argument("store")
    delete.add_argument("ids", nargs="+")
    args = parser.parse_args(argv)

    if args.command == "build":
        texts, metadata = read_passages(args.input, args.text_field)
        store, _, _ = open_store(args.store, args.model, args.storage_dtype, create=True)
        ids = store.add(texts, metadata, batch_size=args.batch_size)
        print(f"added {len(ids)} entries to {args.store}")
        print(json.dumps(store.stats(), indent=1))
    elif args.command == "query":
        from .pipeline import generate_with_retrieval

        store, model, tokenizer = open_store(args.store, args.model)
        result = generate_with_retrieval(
            model, tokenizer, args.query, store, k=args.k, composition=args.composition, max_new_tokens=args.max_new_tokens, do_sample=False
        )
        if args.json:
            print(json.dumps({"query": args.query, "generated": result.text,
                              "retrieved": [{"id": e.id, "score": e.score, "text": e.text} for e in result.retrieved]}))
        else:
            for rank, entry in enumerate(result.retrieved, 1):
                print(f"[{rank}] {entry.score:.3f} {entry.id}  {entry.text[:100]!r}")
            print(f"query:     {args.query!r}\ngenerated: {result.text!r}  ({args.composition}, k={len(result.retrieved)})")
    else:
        store, _, _ = open_store(args.store, None)
        if args.command == "stats":
            print(json.dumps(store.stats(), indent=1))
        elif args.command == "delete":
            try:
                store.delete(args.ids)
            except KeyError as error:
                raise SystemExit(str(error)) from None
            print(f"deleted {len(args.ids)} entries (run compact to reclaim their bytes)")
        else:
            print(json.dumps(store.compact(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
