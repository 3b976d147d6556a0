"""How far composition is from its physical floor, and from re-encoding (CPU, 130M-shaped random models).

For each architecture, n contexts of --context-length tokens are encoded once; then, all in the same run:

  * floor (sum): a plain torch sum of the same n SSM states and conv windows, layer by layer (``acc =
    x_0.clone(); acc += x_k``): reading the inputs once and writing one state, with torch's own kernels;
  * floor (bandwidth): the bytes composition must move (n states read + one written, SSM and conv) divided
    by the streaming bandwidth of a large ``copy_`` (read + write) measured just before;
  * floor (compute): the least arithmetic the decay-based methods (caso, picaso_s, picaso_r) need, one
    multiply and one ``exp`` per SSM state element and state (Mamba-1: n·Σ B·D·N, a weight per element;
    Mamba-2: n·Σ B·H, a weight per head), as a bare C loop with the kernel's own ``exp``, reading only ΣΔ
    and A (``ops.compose.native.exp_floor``); and, as a cross-check of that ``exp``, torch's ``exp`` over
    the same n·Σ log decays (``torch.exp(x, out=buf)``, float32, timed apart after the rounds; it also
    writes them, and is slow on results below float32's smallest normal number). A method can at best
    overlap memory and arithmetic: its floor is the larger of the two;
  * every model-free method through the public ``StateComposer(method).compose(states)`` (input checks,
    finiteness check included);
  * the two concatenation baselines: ours (``StateComposer("concat")``: re-encode the n·L tokens into a
    state) and transformers' prefill of the concatenated tokens (``use_cache=True, logits_to_keep=1``).

Ratios: method / floor (1.0 = at the floor; the floors and the methods are timed in interleaved rounds and
the ratio is the median of the per-round ratios; the bandwidth floor is a computed time) and concat / method
(how much faster than re-encoding).
Then PICASO-S / PICASO-R for large n (``--large-n``), on 130M shapes and on a tiny model (hidden 32),
with the n states built from the encoded ones (tensors shared, ΣΔ rescaled per state, so memory stays
small; shared tensors are partly cache-resident, so the large-n times are a lower bound for distinct
states). A PICASO-S run above ``PICASO_S_MAX_TERMS`` reports the refusal instead of a time.
Medians of --repeats runs; the machine may be shared: compare ratios within one run, not across runs.

    python benchmarks/compose_floor.py [--arch mamba mamba2] [--n 10] [--repeats 15] [--baseline-repeats 2] [--large-n 100 1000]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys

import torch
import transformers
from transformers import Mamba2ForCausalLM, MambaForCausalLM
from transformers.utils import logging as hf_logging

import hf_statecompose as hsc
from hf_statecompose.benchmarking import MODEL_130M_KWARGS, git_commit, median_time, write_result
from hf_statecompose.composition import MODEL_FREE_METHODS
from hf_statecompose.ops.compose import native as compose_native

hf_logging.set_verbosity_error()
CONFIGS = {
    "mamba": (MambaForCausalLM, MODEL_130M_KWARGS["mamba"]),
    "mamba2": (Mamba2ForCausalLM, MODEL_130M_KWARGS["mamba2"]),
}
TINY = {
    "mamba": (MambaForCausalLM, dict(vocab_size=99, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2)),
    "mamba2": (
        Mamba2ForCausalLM,
        dict(
            vocab_size=99,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            expand=2,
            num_heads=8,
            head_dim=8,
            n_groups=2,
            chunk_size=16,
        ),
    ),
}


def stream_bandwidth(repeats: int) -> float:
    """Bytes per second of a large copy (each byte read once and written once)."""
    src = torch.randn(64 * 2**20)  # 256 MiB, far beyond any cache
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), repeats, warmup=1)
    return 2 * src.numel() * src.element_size() / seconds


def plain_sum(tensor_lists):
    for tensors in tensor_lists:
        acc = tensors[0].clone()
        for t in tensors[1:]:
            acc += t


def build(cls, kwargs, seed):
    torch.manual_seed(seed)
    return hsc.enable(cls(cls.config_class(**kwargs)).eval())


def encode_contexts(model, n, length, seed, vocab):
    g = torch.Generator().manual_seed(seed)
    contexts = [torch.randint(3, vocab, (1, length), generator=g) for _ in range(n)]
    with torch.no_grad():
        return contexts, [hsc.ComposableMambaCache.encode(model, c) for c in contexts]


def many_states(states, n, seed):
    """n states built from the given ones: tensors shared, ΣΔ rescaled (distinct decays per state)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        s = states[k % len(states)].shallow_copy()  # shares every tensor
        scale = 0.25 + 1.5 * float(torch.rand((), generator=g))
        s.delta_sums = [d * scale for d in s.delta_sums]
        out.append(s)
    return out


def run_arch(arch, n, repeats, baseline_repeats, length, bandwidth, seed):
    cls, kwargs = CONFIGS[arch]
    model = build(cls, kwargs, seed)
    contexts, states = encode_contexts(model, n, length, seed, 50000)
    layers = range(states[0].num_layers)
    ssm = [[s.ssm_states[i] for s in states] for i in layers]
    conv = [[s.conv_states[i] for s in states] for i in layers]
    moved = sum(t.numel() * t.element_size() for group in ssm + conv for t in group)
    moved += sum(group[0].numel() * group[0].element_size() for group in ssm + conv)  # the output
    with torch.no_grad():
        concat_ids = torch.cat(contexts, 1)
        # seconds each (transformers' CPU path is a per-token loop): fewer repeats, no warm-up
        ours = median_time(lambda: hsc.StateComposer("concat").compose(states, model=model), baseline_repeats)
        theirs = median_time(lambda: model(concat_ids, use_cache=True, logits_to_keep=1), baseline_repeats)
    # interleaved rounds: each round times the floor and every method back to back, so that a burst of
    # load from other jobs hits one round of all of them; per-round ratios, then their median
    # the compute floor: n exps per SSM weight (per element for Mamba-1, per head for Mamba-2)
    mamba1 = arch == "mamba"
    deltas = [d for s in states for d in s.delta_sums]  # state-major, as the kernel takes them
    A = list(states[0].A)
    log_decays = torch.cat(
        [
            torch.stack(
                [(s.delta_sums[i][:, :, None] * A[i] if mamba1 else s.delta_sums[i] * A[i]).reshape(-1) for s in states]
            )
            for i in layers
        ],
        1,
    )  # [n, Σ weights per state]
    exps = log_decays.numel()
    exp_out = torch.empty_like(log_decays)
    calls = {"floor": lambda: plain_sum(ssm + conv)}
    if compose_native.available():
        calls["compute"] = lambda: compose_native.exp_floor(deltas, A, n, mamba1)
    for method in MODEL_FREE_METHODS:
        kw = {"weights": [1 / n] * n} if method == "weighted" else {}
        calls[method] = (lambda c: lambda: c.compose(states))(hsc.StateComposer(method, **kw))
    for fn in calls.values():  # warm-up (builds the native kernel once)
        fn()
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            samples[name].append(median_time(fn, 1))
    # torch.exp runs on torch's own OpenMP pool, whose threads spin on after it and would slow the next
    # calls of the native kernel (another pool): timed after the rounds, not inside them
    torch_exp = median_time(lambda: torch.exp(log_decays, out=exp_out), repeats, warmup=1)
    floor_sum = statistics.median(samples["floor"])
    floor_bw = moved / bandwidth
    floor_compute = statistics.median(samples["compute"]) if "compute" in samples else None
    rows = []
    for method in MODEL_FREE_METHODS:
        seconds = statistics.median(samples[method])
        decay_based = method not in ("soup", "weighted")
        rows.append(
            dict(
                arch=arch,
                n=n,
                method=method,
                seconds=seconds,
                seconds_min=min(samples[method]),
                over_floor_sum=statistics.median(m / f for m, f in zip(samples[method], samples["floor"])),
                over_floor_bandwidth=seconds / floor_bw,
                over_floor_compute=(
                    statistics.median(m / f for m, f in zip(samples[method], samples["compute"]))
                    if decay_based and floor_compute
                    else None
                ),
                speedup_vs_our_concat=ours / seconds,
                speedup_vs_transformers_prefill=theirs / seconds,
            )
        )
    print(f"  {arch} done", file=sys.stderr, flush=True)
    return rows, dict(
        arch=arch,
        n=n,
        bytes_moved=moved,
        floor_sum_s=floor_sum,
        floor_bandwidth_s=floor_bw,
        exps=exps,
        floor_compute_s=floor_compute,
        torch_exp_s=torch_exp,
        our_concat_s=ours,
        transformers_prefill_s=theirs,
        concat_tokens=int(concat_ids.shape[1]),
    )


def run_large(arch, sizes, ns, length, seed):
    cls, kwargs = (CONFIGS if sizes == "130M" else TINY)[arch]
    model = build(cls, kwargs, seed)
    _, base = encode_contexts(model, 10, length if sizes == "130M" else 16, seed, kwargs["vocab_size"])
    rows = []
    for n in ns:
        states = many_states(base, n, seed)
        for method in ("picaso_s", "picaso_r"):
            composer = hsc.StateComposer(method)
            try:
                seconds, refused = median_time(lambda: composer.compose(states), 1), None
            except ValueError as error:
                seconds, refused = None, str(error).split(":")[0]
            rows.append(dict(arch=arch, shapes=sizes, n=n, method=method, seconds=seconds, refused=refused))
            print(f"  {arch} {sizes} n={n} {method} done", file=sys.stderr, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["mamba", "mamba2"], choices=list(CONFIGS))
    parser.add_argument("--n", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--baseline-repeats", type=int, default=2)
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--large-n", nargs="*", type=int, default=[100, 1000])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (the native kernel uses as many)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/compose_floor.json")
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = stream_bandwidth(args.repeats)
    rows, floors, large = [], [], []
    for arch in args.arch:
        arch_rows, floor = run_arch(
            arch, args.n, args.repeats, args.baseline_repeats, args.context_length, bandwidth, args.seed
        )
        rows += arch_rows
        floors.append(floor)
    for arch in args.arch:
        for sizes in ("tiny", "130M"):
            large += run_large(arch, sizes, args.large_n, args.context_length, args.seed)

    print(f"\nstreaming bandwidth (copy, read + write): {bandwidth / 1e9:.1f} GB/s; {torch.get_num_threads()} threads")
    for f in floors:
        compute = f"{f['floor_compute_s'] * 1e3:.2f} ms" if f["floor_compute_s"] else "n/a (no C compiler)"
        print(
            f"{f['arch']}: n = {f['n']}, {f['bytes_moved'] / 1e6:.1f} MB moved; floor: plain sum {f['floor_sum_s'] * 1e3:.2f} ms, "
            f"bytes / bandwidth {f['floor_bandwidth_s'] * 1e3:.2f} ms, compute ({f['exps'] / 1e6:.2f} M exps, C loop) {compute} "
            f"(torch.exp of them {f['torch_exp_s'] * 1e3:.2f} ms); our concat encode ({f['concat_tokens']} tokens) "
            f"{f['our_concat_s'] * 1e3:.0f} ms, transformers' prefill {f['transformers_prefill_s'] * 1e3:.0f} ms"
        )
    print(
        "\n| arch | method | time (ms) | / floor (sum) | / floor (bytes/bandwidth) | / floor (compute) | vs our concat | vs transformers' prefill |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        compute = f"{r['over_floor_compute']:.2f}x" if r["over_floor_compute"] is not None else "–"
        print(
            f"| {r['arch']} | {r['method']} | {r['seconds'] * 1e3:.2f} | {r['over_floor_sum']:.2f}x | "
            f"{r['over_floor_bandwidth']:.2f}x | {compute} | {r['speedup_vs_our_concat']:.0f}x faster | "
            f"{r['speedup_vs_transformers_prefill']:.0f}x faster |"
        )
    print("\n| arch | shapes | n | method | time (s) |")
    print("|---|---|---:|---|---:|")
    for r in large:
        shown = f"{r['seconds']:.3f}" if r["seconds"] is not None else f"refused ({r['refused']})"
        print(f"| {r['arch']} | {r['shapes']} | {r['n']} | {r['method']} | {shown} |")

    write_result(
        dict(
            benchmark="compose_floor",
            commit=git_commit(),
            torch=torch.__version__,
            transformers=transformers.__version__,
            python=platform.python_version(),
            machine=platform.machine(),
            threads=torch.get_num_threads(),
            device="cpu",
            dtype="float32",
            n=args.n,
            context_length=args.context_length,
            repeats=args.repeats,
            baseline_repeats=args.baseline_repeats,
            statistic="median",
            stream_bandwidth_bytes_per_s=bandwidth,
            floors=floors,
            rows=rows,
            large_n=large,
            note="machine shared with other jobs while measured: ratios within this run only",
        ),
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "compose_floor.json")


if __name__ == "__main__":
    main()
