"""What storing a hybrid state's attention keys in 16 bits costs (issue 22): ``state.save(path, keys_dtype=...)``.

    python benchmarks/hybrid_keys_dtype.py [--context 256] [--query 16]

Per hybrid (tiny random float32 NemotronH, GraniteMoeHybrid with RoPE, Bamba: the configs of tests/architectures.py (tiny_hybrid),
nothing downloaded): a random context is encoded and saved with the keys in the model dtype, in bfloat16 and in
float16; each file is loaded back with the model and the query's logits after it are compared with those after the
unsaved state: max |Δ logit|, the logits' magnitude, whether the greedy tokens agree, and the file sizes.
Writes benchmarks/results/hybrid_keys_dtype.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent

import argparse
import os
import sys
import tempfile

import torch

from hf_statecompose.benchmarking import git_commit, write_result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=256, help="context tokens (default 256)")
    parser.add_argument("--query", type=int, default=16, help="query tokens (default 16)")
    parser.add_argument("--out", default=str(HERE / "results" / "hybrid_keys_dtype.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent / "tests"))
    import hf_statecompose as hsc
    from hf_statecompose.state.cache import ComposableMambaCache

    from architectures import WORKING, tiny_hybrid
    from helpers import random_ids

    rows = []
    print("| model | keys | max abs dlogit | max abs logit | greedy same | file bytes |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        for arch in WORKING:
            model = tiny_hybrid(arch)
            generator = torch.Generator().manual_seed(0)
            context, query = random_ids(args.context, generator=generator), random_ids(args.query, generator=generator)
            state = hsc.encode(model, context)
            exact = model(query, past_states=[state]).logits
            for keys_dtype in (None, torch.bfloat16, torch.float16):
                path = os.path.join(folder, "state.safetensors")
                state.save(path, keys_dtype=keys_dtype)
                logits = model(query, past_states=[ComposableMambaCache.load(path, model=model)]).logits
                row = {
                    "model": arch,
                    "keys_dtype": str(keys_dtype or state.model_dtype),
                    "max_abs_dlogit": float((logits - exact).abs().max()),
                    "max_abs_logit": float(exact.abs().max()),
                    "greedy_same": bool(torch.equal(logits.argmax(-1), exact.argmax(-1))),
                    "file_bytes": os.path.getsize(path),
                }
                rows.append(row)
                print(
                    f"| {arch} | {row['keys_dtype']} | {row['max_abs_dlogit']:.2e} | {row['max_abs_logit']:.2f} | {row['greedy_same']} | {row['file_bytes']} |"
                )
    write_result(
        {
            "benchmark": "hybrid_keys_dtype",
            "commit": git_commit(),
            "context": args.context,
            "query": args.query,
            "rows": rows,
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "hybrid_keys_dtype.json")


if __name__ == "__main__":
    main()
