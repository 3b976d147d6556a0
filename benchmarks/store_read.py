"""Reading k states from a StateStore vs reading the same safetensors files with ``load_file``.

    python benchmarks/store_read.py [--k 10] [--repeats 5] [--storage-dtype fp32]

States of the shape of Mamba-1 2.7B (64 layers, d_inner 5120, N 16, conv 4: 27.5 MB per entry in
fp32) without that model: a Mamba-1 model with hidden size 32 and expand 160 has exactly those state
shapes (d_inner = 32 * 160), and small enough weights to build on a CPU. The store is filled through
its public API (``StateStore.add``), so the files are the store's own. Two layouts: one shard per
entry (``add`` with batch_size 1) and the k entries in one shard (batch_size k).

Timed, median of ``--repeats``, every file in the page cache (each read once before timing), each
including a read of every page of the tensors it returns (both return tensors that map the file):

* ``load_file``: ``safetensors.torch.load_file`` of the shard files that hold the k entries (the baseline);
* ``get (verified before)``: ``store.get(ids)`` when this process has already verified these entries
  in these unchanged files (the steady state of a long-running process);
* ``get (first read)``: ``store.get(ids)`` with the per-process verification cache emptied, so every
  entry's checksum, shapes and values are checked (the first read in a process);
* ``retrieve``: ``store.retrieve(query, k)`` (scoring + ``get``), verified before.

Ratios are against ``load_file`` measured in the same run. Writes benchmarks/results/store_read.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import tempfile

import torch

import hf_statecompose as hsc
from hf_statecompose.benchmarking import BagOfWords, git_commit, median_time, write_result

LAYERS, D_INNER, N, CONV = 64, 5120, 16, 4


class CharTokenizer:
    """One token per character: enough to drive a random model."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % 61 for c in text]}


def touch(tensors) -> int:
    """Read one byte of every 4 KiB page of every tensor. ``load_file`` and ``get`` both return tensors
    that map the file (safetensors reads lazily): without this, neither time would include the read."""
    return sum(int(t.reshape(-1).view(torch.uint8)[::4096].sum()) for t in tensors)


def state_tensors(states):
    for state in states:
        for layer in range(state.num_layers):
            yield from (state.ssm_states[layer], state.conv_states[layer], state.delta_sums[layer], state.A[layer])
        yield state.token_ids


def state_shaped_like_2p7b() -> torch.nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(
        vocab_size=64,
        hidden_size=32,
        expand=D_INNER // 32,
        state_size=N,
        conv_kernel=CONV,
        num_hidden_layers=LAYERS,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    return hsc.enable(MambaForCausalLM(config).eval())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--storage-dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out", default=str(HERE / "results" / "store_read.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    from safetensors.torch import load_file

    from hf_statecompose.store import folder as store_module

    model = state_shaped_like_2p7b()
    texts = [f"passage {i} about topic{i} and the shared word" for i in range(args.k)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for per_shard in (1, args.k):
            store = hsc.StateStore(
                Path(tmp) / f"per-shard-{per_shard}",
                model,
                CharTokenizer(),
                retriever=BagOfWords(),
                storage_dtype=args.storage_dtype,
            )
            ids = store.add(texts, batch_size=per_shard, show_progress=False)
            shard_files = sorted((store.path / "shards").glob("*.safetensors"))
            probe = store.get(ids)
            shape = tuple(probe[0].ssm_states[0].shape), tuple(probe[0].conv_states[0].shape)
            entry_bytes = store.stats()["state_bytes_per_entry"]
            for path in shard_files:  # into the page cache
                path.read_bytes()

            def first_read():
                store_module._VERIFIED.clear()
                touch(state_tensors(store.get(ids)))

            times = {
                "load_file": median_time(
                    lambda: touch(t for p in shard_files for t in load_file(p).values()), args.repeats, warmup=1
                ),
                "get (verified before)": median_time(
                    lambda: touch(state_tensors(store.get(ids))), args.repeats, warmup=1
                ),
                "get (first read)": median_time(first_read, args.repeats, warmup=1),
                "retrieve": median_time(
                    lambda: touch(state_tensors(e.state for e in store.retrieve("the shared word", k=args.k))),
                    args.repeats,
                    warmup=1,
                ),
            }
            rows.append(
                {
                    "entries_per_shard": per_shard,
                    "k": args.k,
                    "shard_files": len(shard_files),
                    "file_bytes": sum(p.stat().st_size for p in shard_files),
                    "state_bytes_per_entry": entry_bytes,
                    "ssm_shape": shape[0],
                    "conv_shape": shape[1],
                    "seconds": times,
                    "ratio_to_load_file": {name: t / times["load_file"] for name, t in times.items()},
                }
            )
    print(
        f"k = {args.k} states shaped like Mamba-1 2.7B ({LAYERS} layers, d_inner {D_INNER}, N {N}, conv {CONV}), "
        f"{args.storage_dtype}; median of {args.repeats}; {torch.get_num_threads()} threads; shared, noisy machine"
    )
    print("| entries per shard | files read | method | seconds | × load_file |")
    print("|---|---|---|---|---|")
    for row in rows:
        for name, seconds in row["seconds"].items():
            print(
                f"| {row['entries_per_shard']} | {row['shard_files']} ({row['file_bytes'] / 1e6:.0f} MB) | {name} | {seconds:.3f} | "
                f"{row['ratio_to_load_file'][name]:.2f} |"
            )
    write_result(
        {
            "rows": rows,
            "storage_dtype": args.storage_dtype,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
            "note": "timings on a shared machine (other processes running): ratios within one run are the figure to read",
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "store_read.json")


if __name__ == "__main__":
    main()
