"""Cost of the state-safety checks on a 130M-shaped Mamba (random init, CPU unless --device).

    python benchmarks/fingerprint_speed.py [--repeats 7] [--device cpu] [--threads 1] [--checksum-only]

* fingerprint: the full hash (every weight's bytes; ``model_fingerprint(model, cache=False)``) against
  the cached path (what every ``generate``/``encode`` and a store's open pay: the config, each tensor's
  identity, storage, version and copy-on-write sentinel, and the exact bytes of the small tensors; see
  ``hf_statecompose.state.fingerprint``), in fp32 and bf16, against the bare identity key (the floor) and
  the check before issue 21 (identity + a content checksum of every weight: one pass over the weights);
* a state's checks: ``check_against_model`` (shapes, fingerprint comparison, ``A`` against the model's
  ``-exp(A_log)``) and ``check_state`` (full schema and values), against ``load`` of the same state file,
  which runs both;
* the content checksum (what the cached path pays per check for each weight it cannot make copy-on-write:
  shared memory, ``volatile``, parametrized, a torch without copy-on-write): the exact one since issue 29
  (bit patterns, position-weighted: sees any one change and any swap of two elements) against the sampled one
  before it (row sums plus 64 strided elements: missed a swap within a row that spared the samples), on all the
  weights of the 130M-shaped model and on the embeddings plus one layer of a 2.7B-shaped Mamba (hidden 2560).

Ratios are against the baseline measured in the same run (full hash; load), the candidates run in turn
(interleaved) so that load swings of a shared machine hit all alike: absolute times are noisy, ratios less so. Writes benchmarks/results/fingerprint_speed.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import hashlib
import statistics
import tempfile

import torch
from transformers import MambaConfig, MambaForCausalLM

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache
from hf_statecompose.benchmarking import git_commit, median_time, write_result
from hf_statecompose.state.fingerprint import (
    _content_checksum,
    _state_shaping_tensors,
    model_fingerprint,
)
from hf_statecompose.state.validation import check_against_model, check_state


def identity_key(model):
    """Names, storages, versions, shapes, dtypes alone (blind to ``.data`` edits): the floor of a check.
    ``untyped_storage()``, not ``data_ptr()``: that asks for a writable pointer and ends the sentinel."""
    return tuple(
        (n, t.untyped_storage()._cdata, t._version, tuple(t.shape), str(t.dtype))
        for n, t in _state_shaping_tensors(model)
    )


def sampled_checksum(tensors) -> bytes:
    """The content checksum before issue 29 (kept here to compare): per tensor of more than 4096 elements and two
    or more dimensions, one sum per row plus the bits of 64 strided elements; smaller ones whole."""
    parts = []
    with torch.no_grad():
        for tensor in tensors:
            data = tensor.detach()
            if data.numel() == 0:
                continue
            flat = data.reshape(-1)
            if data.numel() <= 4096 or data.dim() < 2:
                parts.append(flat.float().view(torch.int32) if data.numel() <= 4096 else flat.sum().reshape(1))
                continue
            if data.dtype == torch.float16:
                data = data.view(torch.bfloat16)
            parts.append(data.reshape(data.shape[0], -1).sum(-1).float().view(torch.int32))
            parts.append(flat[:: max(1, flat.numel() // 64)][:64].float().view(torch.int32))
    digest = hashlib.blake2b(digest_size=16)
    digest.update(torch.cat([p.reshape(-1).float() for p in parts]).cpu().numpy().tobytes())
    return digest.digest()


def byte_hash(tensors) -> bytes:
    """Every byte through blake2b on the host: what the full hash pays for these tensors."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.digest()


def large_layer_tensors(dtype, device) -> list:
    """The embeddings and one layer of a 2.7B-shaped Mamba (hidden 2560, expand 2, state 16, vocab 50280)."""
    hidden, inner, state, rank = 2560, 5120, 16, 160
    shapes = [(50280, hidden), (2 * inner, hidden), (inner, 1, 4), (rank + 2 * state, inner), (inner, rank)]
    shapes += [(hidden, inner), (inner, state)]
    return [torch.randn(shape, device=device).to(dtype) for shape in shapes]


def checksum_rows(tensors, label: str, repeats: int, device) -> list:
    exact, sampled, hashed = interleaved(
        [lambda: _content_checksum(tensors), lambda: sampled_checksum(tensors), lambda: byte_hash(tensors)],
        repeats,
        device,
    )
    elements = sum(t.numel() for t in tensors)
    return [
        {
            "what": f"exact content checksum (issue 29), {label}",
            "baseline": "sampled checksum (before issue 29)",
            "baseline_s": sampled,
            "s": exact,
            "ratio": exact / sampled,
            "elements": elements,
        },
        {
            "what": f"exact content checksum (issue 29), {label}",
            "baseline": "blake2b of every byte (the full hash's cost)",
            "baseline_s": hashed,
            "s": exact,
            "ratio": exact / hashed,
            "elements": elements,
        },
    ]


def checksum_key(model):
    """The per-query check before issue 21: the identity key plus a content checksum of every weight
    (one sum per row and a strided sample: a pass over all the weights)."""
    named = list(_state_shaping_tensors(model))
    return identity_key(model), sampled_checksum([t for _, t in named])


def interleaved(fns, repeats: int, device) -> list[float]:
    """Median time of each of ``fns``, run in turn ``repeats`` times: load swings of a shared machine
    hit every candidate alike, so the ratios hold better than the absolute times."""
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, bucket in zip(fns, times):
            bucket.append(median_time(fn, 1, device))
    return [statistics.median(bucket) for bucket in times]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads for torch (default 1: on a shared machine more threads mostly measure contention)",
    )
    parser.add_argument(
        "--checksum-only", action="store_true", help="only the content checksum rows (exact vs sampled vs byte hash)"
    )
    parser.add_argument("--out", default=str(HERE / "results" / "fingerprint_speed.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=768, num_hidden_layers=24, vocab_size=50280)
    rows, checksums = [], []
    for dtype in (torch.float32, torch.bfloat16):
        model = hsc.enable(MambaForCausalLM(config).to(args.device, dtype).eval())
        params = sum(p.numel() for p in model.parameters())
        weights = [t for _, t in _state_shaping_tensors(model)]
        checksums += checksum_rows(weights, f"130M, all weights, {str(dtype)[6:]}", args.repeats, args.device)
        large = large_layer_tensors(dtype, args.device)
        checksums += checksum_rows(large, f"2.7B embeddings + 1 layer, {str(dtype)[6:]}", args.repeats, args.device)
        del large
        if args.checksum_only:
            continue
        model_fingerprint(model)
        full, cached, identity, checksum = interleaved(
            [
                lambda: model_fingerprint(model, cache=False),
                lambda: model_fingerprint(model),
                lambda: identity_key(model),
                lambda: checksum_key(model),
            ],
            args.repeats,
            args.device,
        )
        rows.append(
            {
                "what": f"fingerprint, cached path, {str(dtype)[6:]}",
                "baseline": "full hash",
                "baseline_s": full,
                "s": cached,
                "ratio": cached / full,
                "params": params,
            }
        )
        rows.append(
            {
                "what": f"identity + content checksum, {str(dtype)[6:]} (the cached path before issue 21)",
                "baseline": "full hash",
                "baseline_s": full,
                "s": checksum,
                "ratio": checksum / full,
            }
        )
        rows.append(
            {
                "what": f"identity-only key, {str(dtype)[6:]} (the floor: misses .data edits)",
                "baseline": "full hash",
                "baseline_s": full,
                "s": identity,
                "ratio": identity / full,
            }
        )
        if dtype != torch.float32:
            continue
        with torch.no_grad():
            state = ComposableMambaCache.encode(model, torch.randint(3, 50000, (1, 32), device=args.device))
        fingerprint = model_fingerprint(model)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "state.safetensors"
            state.save(path)
            load, against, schema = interleaved(
                [
                    lambda: ComposableMambaCache.load(path, model=model),
                    lambda: check_against_model(state, model, fingerprint),
                    lambda: check_state(state),
                ],
                args.repeats,
                args.device,
            )
        for what, seconds in (("check_against_model (incl. A)", against), ("check_state (schema, values)", schema)):
            rows.append(
                {
                    "what": what,
                    "baseline": "load(path, model)",
                    "baseline_s": load,
                    "s": seconds,
                    "ratio": seconds / load,
                }
            )
    print(
        f"130M-shaped Mamba ({params / 1e6:.0f}M parameters), {args.device}, "
        f"threads={torch.get_num_threads()}, median of {args.repeats} interleaved runs (shared machine: noisy)"
    )
    print("| what | time | baseline | baseline time | ratio |")
    print("|---|---|---|---|---|")
    for r in checksums + rows:
        print(
            f"| {r['what']} | {r['s'] * 1e3:.1f} ms | {r['baseline']} | {r['baseline_s'] * 1e3:.1f} ms | {r['ratio']:.4f} |"
        )
    write_result(
        {
            "rows": rows,
            "checksum_rows": checksums,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": git_commit(),
            "note": "shared machine: absolute times are noisy",
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "fingerprint_speed.json")


if __name__ == "__main__":
    main()
