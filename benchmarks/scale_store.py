"""The Lance store and encode_corpus: encode throughput through Ray, ANN vs exact retrieval, bytes per entry.

    python benchmarks/scale_store.py [--passages 192] [--entries 100000] [--queries 100] [--skip-encode]

Three parts, each a ratio against a baseline measured in the same run (CPU; the machine is shared):

1. **encode throughput**: ``--passages`` generated passages (60-400 characters) encoded by the demo
   Mamba-2 (3.6M) into a store: the plain ``StateStore.add`` loop (folder store, then Lance store;
   1 torch thread, batch 16) vs ``encode_corpus`` through a local Ray (``ray.init(num_cpus=2)``, started
   before timing) with 1 and 2 CPU actors (1 thread each, batch 16). The retriever is a hashed
   bag of words in every case (the encoding is what is compared, not MiniLM). Ray's times include
   starting the actors and loading the model in each.
2. **retrieval at ``--entries``**: a Lance store of that many entries with small synthetic states (a
   1-layer Mamba-2 with hidden size 32: 4.5 KB of state per entry) and real all-MiniLM-L6-v2
   embeddings of generated sentences (embedded once, then served from a lookup). Per query, median
   over ``--queries`` held-out generated queries, top 10 without states (the search itself) and with
   the 10 states read and verified: the exact scan (``exact=True``) vs the IVF-PQ index (built by
   ``compact()``; nprobes 32, refine factor 10), and the folder store holding the same entries
   (its in-memory matrix product). recall@10 = |ANN top 10 ∩ exact top 10| / 10, averaged.
3. **bytes on disk per entry**: for the demo Mamba-2 states of part 1 (848 KB of fp32 state per
   entry) and the tiny states of part 2: all files of the Lance store / all files of the folder store.

Writes benchmarks/results/scale_store.json.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORDS = (
    "river mountain copper bronze harbor village winter summer market bridge castle forest island "
    "valley lantern engine garden meadow silver orchard canal temple glacier desert merchant "
    "weaver baker pilot sailor miner farmer scholar painter potter tailor"
).split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


class Lookup:
    """Precomputed MiniLM vectors served by text (so that a 100k-entry store embeds each text once)."""

    def __init__(self, name, vectors: dict):
        self.name, self.vectors = name, vectors

    def __call__(self, texts):
        import torch

        return torch.stack([self.vectors[t] for t in texts])


def demo_mamba2():
    import hf_statecompose as hsc

    return hsc.load_demo("mamba2")


def tiny_mamba2():
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    import hf_statecompose as hsc

    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=99,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=1,
        expand=2,
        num_heads=8,
        head_dim=8,
        n_groups=2,
        chunk_size=16,
        conv_kernel=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return hsc.enable(Mamba2ForCausalLM(config).eval())


class CharTokenizer:
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % 96 for c in text]}


def du(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def encode_part(args, tmp: Path) -> dict:
    import ray
    import torch

    import hf_statecompose as hsc
    from hf_statecompose.benchmarking import BagOfWords

    rng = random.Random(1)
    passages = [
        {"text": " ".join(sentence(rng, rng.randint(6, 40)) for _ in range(2))[:400], "n": i}
        for i in range(args.passages)
    ]
    texts = [p["text"] for p in passages]
    torch.set_num_threads(1)
    model, tok = demo_mamba2()
    tokens = sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts)
    seconds = {}
    for backend in ("folder", "lance"):
        path = tmp / f"add-{backend}"
        store = hsc.StateStore(str(path), model, tok, retriever=BagOfWords(), backend=backend)
        store.add(texts[:16], show_progress=False)  # warm-up batch, not timed (then a fresh store)
        shutil.rmtree(path)
        store = hsc.StateStore(str(path), model, tok, retriever=BagOfWords(), backend=backend)
        start = time.perf_counter()
        store.add(texts, [{"n": p["n"]} for p in passages], batch_size=16, show_progress=False)
        seconds[f"{backend} store.add loop"] = time.perf_counter() - start
    sizes = {"folder": du(tmp / "add-folder") / len(texts), "lance": du(tmp / "add-lance") / len(texts)}
    state_bytes = hsc.StateStore(str(tmp / "add-lance"), model, tok, retriever=BagOfWords(), backend="lance").stats()[
        "state_bytes_per_entry"
    ]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {"PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "OMP_NUM_THREADS": "1"}
        },
    )
    try:
        for actors in (1, 2):
            start = time.perf_counter()
            report = hsc.encode_corpus(
                passages,
                demo_mamba2,
                tmp / f"ray-{actors}",
                retriever=BagOfWords,
                batch_size=16,
                num_actors=actors,
                show_progress=False,
            )
            seconds[f"encode_corpus, {actors} CPU actor{'s' * (actors > 1)}"] = time.perf_counter() - start
            assert report["entries"] == len(texts), report
    finally:
        ray.shutdown()
    base = seconds["folder store.add loop"]
    return {
        "passages": len(texts),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": {k: tokens / v for k, v in seconds.items()},
        "speed_vs_folder_add_loop": {k: base / v for k, v in seconds.items()},
        "seconds_per_token_folder_loop": base / tokens,
        "bytes_on_disk_per_entry": sizes,
        "state_bytes_per_entry": state_bytes,
        "lance_over_folder_bytes": sizes["lance"] / sizes["folder"],
    }


def retrieval_part(args, tmp: Path) -> dict:
    import torch

    import hf_statecompose as hsc
    from hf_statecompose.retrieval import MiniLMRetriever

    rng = random.Random(2)
    texts = list(dict.fromkeys(sentence(rng, rng.randint(8, 14)) for _ in range(int(args.entries * 1.05))))[
        : args.entries
    ]
    queries = [sentence(rng, rng.randint(4, 8)) for _ in range(args.queries)]
    from safetensors.torch import load_file, save_file

    from hf_statecompose.retrieval import MINILM_NAME
    from hf_statecompose.store.lance import DIMENSION_PROBE

    everything = texts + queries + [DIMENSION_PROBE]
    cache = Path(args.embeddings_cache) if args.embeddings_cache else None
    start = time.perf_counter()
    if cache is not None and cache.exists():  # the same generated texts (fixed seed), embedded by an earlier run
        matrix = load_file(cache)["vectors"]
        assert matrix.shape[0] == len(everything), "embeddings cache of another --entries / --queries"
    else:
        minilm = MiniLMRetriever(batch_size=256, max_length=32)
        matrix = torch.cat([minilm(everything[s : s + 4096]) for s in range(0, len(everything), 4096)])
        if cache is not None:
            save_file({"vectors": matrix.contiguous()}, cache)
    embed_seconds = time.perf_counter() - start
    retriever = Lookup(MINILM_NAME, dict(zip(everything, matrix)))
    if args.embed_only:
        return {"entries": len(texts), "minilm_embedding_seconds": embed_seconds}
    model, tok = tiny_mamba2(), CharTokenizer()
    lance = hsc.StateStore(
        str(tmp / "big-lance"),
        model,
        tok,
        retriever=retriever,
        backend="lance",
        index_threshold=min(10_000, len(texts)),
    )
    folder = hsc.StateStore(str(tmp / "big-folder"), model, tok, retriever=retriever)
    start = time.perf_counter()
    lance.add(texts, batch_size=2048, show_progress=False)
    fill = {"lance add": time.perf_counter() - start}
    start = time.perf_counter()
    folder.add(texts, batch_size=2048, show_progress=False)
    fill["folder add"] = time.perf_counter() - start
    start = time.perf_counter()
    report = lance.compact(keep_versions_for=0)
    fill["lance compact (IVF-PQ build + optimize)"] = time.perf_counter() - start
    assert report["indexed"], report
    timings: dict[str, list[float]] = {}
    recalls = []
    for query in queries:

        def timed(name, fn):
            start = time.perf_counter()
            out = fn()
            timings.setdefault(name, []).append(time.perf_counter() - start)
            return out

        exact = timed("lance exact, top 10", lambda: lance.retrieve(query, k=10, load_states=False, exact=True))
        ann = timed("lance IVF-PQ, top 10", lambda: lance.retrieve(query, k=10, load_states=False))
        timed("folder (matrix product), top 10", lambda: folder.retrieve(query, k=10, load_states=False))
        timed("lance exact, top 10 + states", lambda: lance.retrieve(query, k=10, exact=True))
        timed("lance IVF-PQ, top 10 + states", lambda: lance.retrieve(query, k=10))
        timed("folder, top 10 + states", lambda: folder.retrieve(query, k=10))
        recalls.append(len({e.id for e in ann} & {e.id for e in exact}) / 10)
    median = {name: statistics.median(values) for name, values in timings.items()}
    sizes = {"lance": du(tmp / "big-lance") / len(texts), "folder": du(tmp / "big-folder") / len(texts)}
    return {
        "entries": len(texts),
        "queries": len(queries),
        "minilm_embedding_seconds": embed_seconds,
        "fill_seconds": fill,
        "median_seconds": median,
        "ann_over_exact": median["lance IVF-PQ, top 10"] / median["lance exact, top 10"],
        "recall_at_10": statistics.mean(recalls),
        "min_recall_at_10": min(recalls),
        "bytes_on_disk_per_entry": sizes,
        "lance_over_folder_bytes": sizes["lance"] / sizes["folder"],
        "state_bytes_per_entry": lance.stats()["state_bytes_per_entry"],
    }


def per_token_part(args) -> dict:
    """Encode cost per token of Mamba-1 2.7B-shaped layers (d_model 2560, d_inner 5120, N 16) on this CPU:
    ``--cost-layers`` of the 64 layers, 2 x 512 tokens, our encode path; the full model is extrapolated
    on paper (x 64 / layers), for the fleet sizing in docs/guides/scale-out.md."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    import hf_statecompose as hsc
    from hf_statecompose.benchmarking import median_time

    torch.manual_seed(0)
    config = MambaConfig(
        vocab_size=1024, hidden_size=2560, state_size=16, num_hidden_layers=args.cost_layers, expand=2, conv_kernel=4
    )
    model = hsc.enable(MambaForCausalLM(config).eval())
    ids = torch.randint(3, 1024, (2, 512))
    seconds = median_time(lambda: hsc.ComposableMambaCache.encode(model, ids), 3, warmup=1)
    per_layer_token = seconds / (ids.numel() * args.cost_layers)
    layer_params = sum(p.numel() for p in model.backbone.layers[0].parameters())
    return {
        "layers_run": args.cost_layers,
        "tokens": ids.numel(),
        "seconds": seconds,
        "seconds_per_layer_token": per_layer_token,
        "params_per_layer": layer_params,
        "flop_per_layer_token_2x_params": 2 * layer_params,
        "cpu_flop_per_second_achieved": 2 * layer_params / per_layer_token,
        "seconds_per_token_64_layers_on_paper": 64 * per_layer_token,
        "threads": torch.get_num_threads(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passages", type=int, default=192)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--skip-encode", action="store_true")
    parser.add_argument("--skip-retrieval", action="store_true")
    parser.add_argument(
        "--cost-layers", type=int, default=2, help="2.7B-shaped layers timed for the per-token cost (0: skip)"
    )
    parser.add_argument(
        "--embeddings-cache",
        default=None,
        help="safetensors file of the MiniLM vectors of the generated texts (made if missing)",
    )
    parser.add_argument("--embed-only", action="store_true", help="only compute --embeddings-cache, then stop")
    parser.add_argument("--out", default=str(HERE / "results" / "scale_store.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    import torch

    from hf_statecompose.benchmarking import git_commit, write_result

    result = {
        "commit": git_commit(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "note": "CPU, shared 2-core machine: ratios within one run are the figure to read",
    }
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_encode:
            result["encode"] = encode_part(args, Path(tmp))
            e = result["encode"]
            print(f"encode {e['passages']} passages ({e['tokens']} tokens), demo Mamba-2, CPU:")
            print("| method | seconds | tokens/s | × folder add loop |\n|---|---:|---:|---:|")
            for name, seconds in e["seconds"].items():
                print(
                    f"| {name} | {seconds:.2f} | {e['tokens_per_second'][name]:.0f} | {e['speed_vs_folder_add_loop'][name]:.2f} |"
                )
            print(
                f"bytes on disk per entry: folder {e['bytes_on_disk_per_entry']['folder']:.0f}, lance "
                f"{e['bytes_on_disk_per_entry']['lance']:.0f} ({e['lance_over_folder_bytes']:.3f}×); state {e['state_bytes_per_entry']}"
            )
        if not args.skip_retrieval:
            torch.set_num_threads(os.cpu_count() or 1)
            result["retrieval"] = retrieval_part(args, Path(tmp))
            r = result["retrieval"]
            if args.embed_only:
                print(r)
                return
            print(f"\nretrieval at {r['entries']} entries, {r['queries']} queries (median seconds):")
            print("| method | median ms |\n|---|---:|")
            for name, seconds in r["median_seconds"].items():
                print(f"| {name} | {1e3 * seconds:.1f} |")
            print(
                f"recall@10 of IVF-PQ vs exact: {r['recall_at_10']:.3f} (min {r['min_recall_at_10']:.1f}); ANN / exact time "
                f"{r['ann_over_exact']:.3f}; bytes per entry folder {r['bytes_on_disk_per_entry']['folder']:.0f}, lance "
                f"{r['bytes_on_disk_per_entry']['lance']:.0f}; fill {r['fill_seconds']}"
            )
    if args.cost_layers:
        result["per_token_2p7b_shape"] = c = per_token_part(args)
        print(
            f"\nMamba-1 2.7B-shaped layer, CPU ({c['threads']} threads): {1e3 * c['seconds_per_layer_token']:.3f} ms per layer-token, "
            f"{c['cpu_flop_per_second_achieved'] / 1e9:.1f} GFLOP/s achieved (2 x {c['params_per_layer']} params per layer-token); "
            f"64 layers on paper: {c['seconds_per_token_64_layers_on_paper'] * 1e3:.1f} ms per token"
        )
    write_result(result, args.out)
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "scale_store.json")


if __name__ == "__main__":
    main()
