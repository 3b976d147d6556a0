"""Time to first token through a StateStore against transformers' own prefill of the contexts + query.

    python benchmarks/ttft.py [--sizes 130m,1.4b] [--ks 1,4,10] [--repeats 5] [--baseline-repeats 3] [--threads 1]
    python benchmarks/ttft.py --size tiny          # seconds: what the test runs

Mamba-2 with random weights from a config (no download): ``130m`` is mamba2-130m's shapes (hidden 768, 24
layers, state 128, head_dim 64, expand 2, n_groups 1, vocab 50288), ``1.4b`` mamba2-1.3b's (hidden 2048, 48
layers). ``k`` stored contexts of 256 tokens each (one character a token, a hashed bag-of-words retriever:
instant and deterministic, so the figures are the library's, not a retriever's) and a 16-token query.

* TTFT through the store (one query, end to end, as a fresh request would run it): open the folder
  ``StateStore`` (``hsc.StateStore(path, model, ...)`` of the existing folder), ``retrieve(query, k)``
  (scoring + reading and verifying the k states), ``model.generate(query, past_states=..., composition=...,
  max_new_tokens=1)`` (fingerprint check, compose, query prefill, first token). "store kept open" is the
  same without the open.
* Its parts, timed one by one in the same run: store open; retrieval (scores only, ``load_states=False``);
  state read + verify (``store.get(ids)``); compose (``hsc.compose_states``); query prefill + first token
  (``generate`` from the one composed state); and the model fingerprint's per-query check
  (``hsc.model_fingerprint(model)``, which ``generate`` and the store's open both run).
* The baseline: transformers' prefill of the k contexts and the query concatenated
  (``model.generate(ids, max_new_tokens=1)``, no state), measured in the same run (fewer repeats, no warm-up:
  it is slow; ``--baseline-ks`` limits it to some ks).

Ratios: baseline / TTFT (the speedup), and TTFT(k) / TTFT(k=1) (target <= 1.15: the cost should barely
grow with k), taken per round of interleaved TTFT(k) timings (every k once per round, ``--repeats`` rounds),
its median reported (``ttft_over_k1``; the ratio of the two medians is kept as ``ttft_over_k1_of_medians``).
Medians; one thread by default (a shared machine; set ``--threads``). Writes
benchmarks/results/ttft.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import statistics
import tempfile
import time

import torch

import hf_statecompose as hsc
from hf_statecompose.benchmarking import BagOfWords, git_commit, median_time, write_result

SIZES = {
    "tiny": dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        state_size=16,
        num_heads=4,
        head_dim=32,
        expand=2,
        n_groups=1,
        chunk_size=64,
    ),
    "130m": dict(
        vocab_size=50288,
        hidden_size=768,
        num_hidden_layers=24,
        state_size=128,
        num_heads=24,
        head_dim=64,
        expand=2,
        n_groups=1,
        chunk_size=256,
    ),
    "1.4b": dict(
        vocab_size=50288,
        hidden_size=2048,
        num_hidden_layers=48,
        state_size=128,
        num_heads=64,
        head_dim=64,
        expand=2,
        n_groups=1,
        chunk_size=256,
    ),
}
CONTEXT_TOKENS, QUERY_TOKENS = 256, 16


class CharTokenizer:
    """One token per character (ids 3..63): exact token counts, enough to drive a random model."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        ids = [3 + ord(c) % 61 for c in text]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}


def passage(i: int) -> str:
    words = f"passage{i} about topic{i} and the shared word with filler text number {i} "
    return (words * (CONTEXT_TOKENS // len(words) + 1))[:CONTEXT_TOKENS]


def build_model(size: str):
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(**SIZES[size], pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    return hsc.enable(Mamba2ForCausalLM(config).eval())


def run_size(
    size: str, ks: list[int], repeats: int, baseline_repeats: int, composition: str, tmp: Path, baseline_ks=None
) -> dict:
    started = time.perf_counter()
    model = build_model(size)
    params = sum(p.numel() for p in model.parameters())
    tokenizer, retriever = CharTokenizer(), BagOfWords()
    texts = [passage(i) for i in range(max(ks))]
    query = "the shared word?"[:QUERY_TOKENS].ljust(QUERY_TOKENS, "?")
    query_ids = tokenizer(query, return_tensors="pt")["input_ids"]
    path = tmp / f"store-{size}"
    store = hsc.StateStore(path, model, tokenizer, retriever=retriever)
    with torch.no_grad():
        store.add(texts, batch_size=len(texts), show_progress=False)
    build_s = time.perf_counter() - started
    gen = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)

    def open_store():
        return hsc.StateStore(path, model, tokenizer, retriever=retriever)

    def ttft_of(k):
        # the whole request, fresh store object (or the store kept open)
        def ttft(opened=None):
            s = opened or open_store()
            entries = s.retrieve(query, k)
            return model.generate(
                query_ids, past_states=[e.state for e in reversed(entries)], composition=composition, **gen
            )

        return ttft

    # the headline ratio TTFT(k) / TTFT(k=1): every k timed once per round, rounds interleaved, the ratio taken per
    # round and its median reported, so that the machine's drift over the run (a few % on a shared machine) does
    # not enter the ratio as it does between medians measured one k after another
    for k in ks:
        ttft_of(k)()  # warm-up
    rounds = {k: [] for k in ks}
    for _ in range(repeats):
        for k in ks:
            start = time.perf_counter()
            ttft_of(k)()
            rounds[k].append(time.perf_counter() - start)

    rows = []
    for k in ks:
        retrieved = store.retrieve(query, k, load_states=False)
        ids = [entry.id for entry in retrieved]
        states = [s for s in reversed(store.get(ids))]  # least relevant first, as the pipeline orders them
        composed = hsc.compose_states(states, composition, model=model)

        ttft = ttft_of(k)
        first = ttft()
        concat = torch.cat(
            [tokenizer(t, return_tensors="pt")["input_ids"] for t in reversed([e.text for e in retrieved])]
            + [query_ids],
            1,
        )
        parts = {
            "ttft": statistics.median(rounds[k]),
            "ttft_store_open": median_time(lambda: ttft(store), repeats, warmup=1),
            "store_open": median_time(open_store, repeats),
            "retrieval": median_time(lambda: store.retrieve(query, k, load_states=False), repeats),
            "read_verify": median_time(lambda: store.get(ids), repeats),
            "compose": median_time(lambda: hsc.compose_states(states, composition, model=model), repeats),
            "prefill_first_token": median_time(
                lambda: model.generate(query_ids, past_states=[composed], composition=composition, **gen), repeats
            ),
            "fingerprint_check": median_time(lambda: hsc.model_fingerprint(model), repeats),
        }
        baseline_first, times = None, []
        for _ in range(baseline_repeats if baseline_ks is None or k in baseline_ks else 0):
            with torch.no_grad():
                start = time.perf_counter()
                baseline_first = model.generate(concat, **gen)
                times.append(time.perf_counter() - start)
        parts["baseline_prefill"] = statistics.median(times) if times else None
        rows.append(
            {
                "size": size,
                "k": k,
                "context_tokens": k * CONTEXT_TOKENS,
                "query_tokens": query_ids.shape[1],
                "baseline_tokens": concat.shape[1],
                "seconds": parts,
                "baseline_runs": len(times),
                "speedup": parts["baseline_prefill"] / parts["ttft"] if times else None,
                "speedup_store_open": parts["baseline_prefill"] / parts["ttft_store_open"] if times else None,
                "first_token": int(first[0, -1]),
                "baseline_first_token": int(baseline_first[0, -1]) if baseline_first is not None else None,
            }
        )
    for row in rows:
        k = row["k"]
        row["ttft_over_k1_of_medians"] = row["seconds"]["ttft"] / rows[0]["seconds"]["ttft"]
        row["ttft_over_k1"] = statistics.median(a / b for a, b in zip(rounds[k], rounds[ks[0]], strict=True))
        row["ttft_rounds"] = rounds[k]
    return {
        "size": size,
        "params": params,
        "config": SIZES[size],
        "build_and_encode_s": build_s,
        "rows": rows,
        "ttft_kmax_over_k1": rows[-1]["ttft_over_k1"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", "--size", default="130m", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--ks", default="1,4,10", help="numbers of retrieved contexts, comma-separated, ascending")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the store path's timings (median)")
    parser.add_argument(
        "--baseline-repeats", type=int, default=3, help="repeats of transformers' prefill (slow; no warm-up run)"
    )
    parser.add_argument(
        "--baseline-ks",
        default=None,
        help="the ks whose baseline is measured (default all; at 1.4B on a CPU the k=10 prefill takes many minutes)",
    )
    parser.add_argument("--composition", default="picaso_r")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: on a shared machine more threads mostly measure contention)",
    )
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/ttft.json; tiny: a temp file)"
    )
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    ks = sorted(int(k) for k in args.ks.split(","))
    baseline_ks = None if args.baseline_ks is None else {int(k) for k in args.baseline_ks.split(",") if k.strip()}
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            results.append(
                run_size(size, ks, args.repeats, args.baseline_repeats, args.composition, Path(tmp), baseline_ks)
            )
    print(
        f"Mamba-2, random weights; k contexts of {CONTEXT_TOKENS} tokens + a {QUERY_TOKENS}-token query; composition "
        f"{args.composition}; threads={torch.get_num_threads()}; medians of {args.repeats} (baseline {args.baseline_repeats}); "
        "shared machine: noisy"
    )
    print(
        "| size | k | TTFT store | TTFT store kept open | baseline prefill | speedup | speedup (kept open) | TTFT/TTFT(k=1) "
        "| open | retrieval | read+verify | compose | prefill+1st token | fingerprint check |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for result in results:
        for row in result["rows"]:
            s = row["seconds"]
            ms = lambda key: f"{s[key] * 1e3:.1f} ms"
            base = "not run" if s["baseline_prefill"] is None else f"{s['baseline_prefill']:.2f} s"
            speed = lambda v: "-" if v is None else f"{v:.0f}x"
            print(
                f"| {result['size']} | {row['k']} | {ms('ttft')} | {ms('ttft_store_open')} | {base} | "
                f"{speed(row['speedup'])} | {speed(row['speedup_store_open'])} | {row['ttft_over_k1']:.2f} | {ms('store_open')} | "
                f"{ms('retrieval')} | {ms('read_verify')} | {ms('compose')} | {ms('prefill_first_token')} | {ms('fingerprint_check')} |"
            )
    out = args.out or (
        str(Path(tempfile.gettempdir()) / "ttft-tiny.json")
        if sizes == ["tiny"]
        else str(HERE / "results" / "ttft.json")
    )
    write_result(
        {
            "results": results,
            "ks": ks,
            "composition": args.composition,
            "repeats": args.repeats,
            "baseline_repeats": args.baseline_repeats,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
            "note": "shared machine (other processes running): ratios within one run are the figure to read",
        },
        out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(out, "ttft.json")


if __name__ == "__main__":
    main()
