"""Kernel benchmarks: encode vs transformers and vs the dense-projection floor (CPU); fused composition vs
copy bandwidth (CPU and GPU); Triton scans vs mamba-ssm (GPU, when one is present).

CPU, encode (130M-shaped random Mamba / Mamba-2, float32, batch 1):
  * ``floor``: every ``nn.Linear`` of every mixer applied to the same number of tokens, nothing else.
    No implementation of the model can be faster than its dense projections.
  * ``transformers``: the model's own prefill, ``model(ids, use_cache=True, logits_to_keep=1)``.
  * ``encode``: ``ComposableMambaCache.encode(model, ids, backend="torch")`` (on CPU: the native C kernels
    of ``ops/_native.py`` for the scans, the conv and the gated norm; the torch paths where they cannot build).
  Ratios are against ``floor`` measured in the same run (target: encode <= 1.5x floor). Before timing,
  the final SSM states of ``encode`` are compared with transformers' own (target: <= 1e-4 relative), in
  the first layer (same input: the scan alone) and over all layers (fp32 rounding amplified by depth);
  up to --fp64-max-tokens both are also compared with a float64 run (ours: transformers' Mamba-2 torch
  path computes its scan in float32 even for a float64 model).
Composition (n states of a 130M- and a 2.7B-shaped model, every layer): the fused composition
  (``compose_ssm``) against a copy of the same bytes into a preallocated buffer (bandwidth fraction =
  bytes the composition moves per second / bytes the copy moves per second; target >= 0.7 on GPU), and
  against the unfused composition that materialises the weights first.
GPU only: Triton selective scan / SSD scan vs mamba-ssm's ``selective_scan_fn`` /
  ``mamba_chunk_scan_combined`` (target: Triton within 1.3x), when both are importable.

  ``--cpu-time``: the encode table on one thread, timed by CPU time (a shared machine's load barely moves it;
  wall time on two busy cores does: the default).

    python benchmarks/ops_speed.py [--arch mamba mamba2] [--lengths 256 1024 4096] [--repeats 3] [--cpu-time] [--out benchmarks/results/kernels.json]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
import transformers
from torch import nn
from transformers import Mamba2ForCausalLM, MambaForCausalLM
from transformers.utils import logging as hf_logging

import hf_statecompose as hsc
from hf_statecompose.benchmarking import MODEL_130M_KWARGS, git_commit, median_time, write_result
from hf_statecompose.ops import backends
from hf_statecompose.ops.compose.weights import WEIGHT_FUNCTIONS
from hf_statecompose.state.fingerprint import base_model_of

hf_logging.set_verbosity_error()
CONFIGS = {
    "mamba": (MambaForCausalLM, MODEL_130M_KWARGS["mamba"]),
    "mamba2": (Mamba2ForCausalLM, MODEL_130M_KWARGS["mamba2"]),
}
# per-layer SSM state shapes (batch 1) and layer counts for composition
STATE_SHAPES = {
    "mamba-130m": ((1, 1536, 16), 24, "mamba"),
    "mamba2-130m": ((1, 24, 64, 128), 24, "mamba2"),
    "mamba-2.8b": ((1, 5120, 16), 64, "mamba"),
    "mamba2-2.7b": ((1, 80, 64, 128), 64, "mamba2"),
}
COMPOSE_METHODS = ["soup", "caso", "picaso_s", "picaso_r"]


def rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------- encode
def cpu_time(fn) -> float:
    """CPU time of this thread (``--cpu-time``: torch on one thread): what other processes on a shared
    machine do barely changes it, unlike wall time."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def encode_rows(arch, lengths, repeats, seed, fp64_max_tokens, cpu_clock=False):
    cls, kwargs = CONFIGS[arch]
    torch.manual_seed(seed)
    model = hsc.enable(cls(cls.config_class(**kwargs)).eval(), backend="torch")
    model64 = cls(model.config).eval()
    model64.load_state_dict(model.state_dict())
    model64 = hsc.enable(model64.double(), backend="torch")
    linears = [m for block in base_model_of(model).layers for m in block.mixer.modules() if isinstance(m, nn.Linear)]
    rows = []
    with torch.no_grad():
        for length in lengths:
            generator = torch.Generator().manual_seed(seed + length)
            ids = torch.randint(3, 50000, (1, length), generator=generator)
            inputs = [torch.randn(1, length, m.in_features, generator=generator) for m in linears]

            def floor():
                for m, x in zip(linears, inputs):
                    m(x)

            def stock():
                return model(ids, use_cache=True, logits_to_keep=1)

            def encode():
                return hsc.ComposableMambaCache.encode(model, ids, backend="torch")

            # correctness first (also the warm-up: compiles the fused scan once)
            reference = hsc.compat.output_cache(stock())
            state = encode()
            layers = range(state.num_layers)
            errors = [rel_err(state.ssm_states[i], reference.layers[i].recurrent_states[0]) for i in layers]
            state_err = max(errors)
            conv_err = max(rel_err(state.conv_states[i], reference.layers[i].conv_states[0]) for i in layers)
            fp64 = {}
            if length <= fp64_max_tokens:
                # How far fp32 is from exact at all: both fp32 implementations against a float64 run. The
                # float64 run is ours: transformers' Mamba-2 torch path computes its scan in float32 even
                # for a float64 model (`hidden_states.float()` in mamba2_chunk_scan); our float64 ops are
                # checked against plain references and scalar loops to 1e-10 in the tests. (The cache stores
                # states in float32: the truth is rounded once, 6e-8 relative, far below what is measured.)
                exact = hsc.ComposableMambaCache.encode(model64, ids.clone(), backend="torch")
                truth = [exact.ssm_states[i] for i in layers]
                fp64 = dict(
                    encode_vs_fp64=max(rel_err(state.ssm_states[i], truth[i]) for i in layers),
                    transformers_vs_fp64=max(
                        rel_err(reference.layers[i].recurrent_states[0], truth[i]) for i in layers
                    ),
                    encode_vs_fp64_layer0=rel_err(state.ssm_states[0], truth[0]),
                    transformers_vs_fp64_layer0=rel_err(reference.layers[0].recurrent_states[0], truth[0]),
                )
            floor()
            reps = repeats if length <= 1024 else max(1, repeats // 2)
            # interleave the three so that machine noise hits them alike
            times = {"floor": [], "transformers": [], "encode": []}
            for _ in range(reps):
                for name, fn in (("floor", floor), ("transformers", stock), ("encode", encode)):
                    times[name].append(cpu_time(fn) if cpu_clock else median_time(fn, 1))
            t = {k: statistics.median(v) for k, v in times.items()}
            row = dict(
                arch=arch,
                tokens=length,
                floor_s=t["floor"],
                transformers_s=t["transformers"],
                encode_s=t["encode"],
                encode_over_floor=t["encode"] / t["floor"],
                transformers_over_floor=t["transformers"] / t["floor"],
                speedup_vs_transformers=t["transformers"] / t["encode"],
                state_rel_err=state_err,
                state_rel_err_layer0=errors[0],
                conv_rel_err=conv_err,
                **fp64,
                speed_target_met=t["encode"] / t["floor"] <= 1.5,
                state_target_met=state_err <= 1e-4,
            )
            rows.append(row)
            print(
                f"  {arch} {length} tokens: encode/floor {row['encode_over_floor']:.2f}x", file=sys.stderr, flush=True
            )
    return rows


# ---------------------------------------------------------------------------------------------- compose
def compose_rows(names, n, repeats, device, backend, seed):
    rows = []
    generator = torch.Generator().manual_seed(seed)
    for name in names:
        shape, layers, arch = STATE_SHAPES[name]
        state_numel = int(torch.tensor(shape).prod())
        delta_shape = (n, shape[0], shape[1])
        a_shape = (shape[1], shape[2]) if arch == "mamba" else (shape[1],)
        data = []
        for _ in range(layers):
            states = [torch.randn(shape, generator=generator).to(device) for _ in range(n)]
            delta = (torch.rand(delta_shape, generator=generator) * 3).to(device)
            A = (-torch.rand(a_shape, generator=generator) * 2 - 0.01).to(device)
            data.append((states, delta, A))
        flat = torch.cat([s.flatten() for s in data[0][0]] * layers)  # the same bytes as all states, contiguous
        target = torch.empty_like(flat)
        target.copy_(flat)  # touch the destination once: time the copy, not page faults
        copy_s = median_time(lambda: target.copy_(flat), repeats, device)
        copy_bandwidth = 2 * flat.numel() * 4 / copy_s  # read + write
        moved = layers * (n + 1) * state_numel * 4  # each state read once, the result written once
        for method in COMPOSE_METHODS:

            def fused():
                return [backends.compose_ssm(s, d, a, method, backend=backend) for s, d, a in data]

            def materialised():
                out = []
                for s, d, a in data:
                    log_decay = d[..., None] * a if arch == "mamba" else (d * a)[..., None, None]
                    W = WEIGHT_FUNCTIONS[method](log_decay)
                    acc = s[0] * W[0]
                    for k in range(1, n):
                        acc = acc.addcmul(s[k], W[k])
                    out.append(acc)
                return out

            got, expected = fused(), materialised()
            err = max(rel_err(g, e) for g, e in zip(got, expected))
            assert err < 1e-4, f"{name} {method}: fused composition differs from the materialised one by {err}"
            fused_s = median_time(fused, repeats, device)
            materialised_s = median_time(materialised, repeats, device)
            rows.append(
                dict(
                    state=name,
                    n=n,
                    method=method,
                    device=device.type,
                    backend=backend,
                    fused_s=fused_s,
                    materialised_s=materialised_s,
                    copy_s=copy_s,
                    bandwidth_fraction=(moved / fused_s) / copy_bandwidth,
                    speedup_vs_materialised=materialised_s / fused_s,
                    rel_err=err,
                )
            )
        print(f"  compose {name} on {device.type} done", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- GPU scans
def gpu_scan_rows(repeats, seed):
    """Triton scans vs mamba-ssm's on 2.7B-shaped layers (GPU only)."""
    rows = []
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as error:
        return rows, f"mamba-ssm not importable ({error}): no reference to compare against"
    device = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for length in (1024, 4096):
        D, N = 5120, 16
        u = torch.randn(1, D, length, device=device, generator=g)
        delta = torch.randn(1, D, length, device=device, generator=g) * 0.5 - 2
        A = -torch.rand(D, N, device=device, generator=g) - 0.1
        B = torch.randn(1, N, length, device=device, generator=g)
        C = torch.randn(1, N, length, device=device, generator=g)
        h0 = torch.randn(1, D, N, device=device, generator=g)
        with torch.no_grad():
            ours = lambda: backends.selective_scan(
                u, delta, A, B, C, delta_softplus=True, initial_state=h0, backend="triton"
            )
            ours_zero = lambda: backends.selective_scan(u, delta, A, B, C, delta_softplus=True, backend="triton")
            theirs = lambda: selective_scan_fn(u, delta, A, B, C, delta_softplus=True, return_last_state=True)
            err = rel_err(ours_zero()[0], theirs()[0])
            t_ours, t_zero, t_theirs = (median_time(f, repeats, device) for f in (ours, ours_zero, theirs))
        rows.append(
            dict(
                op="selective_scan",
                tokens=length,
                triton_s=t_ours,
                triton_zero_state_s=t_zero,
                mamba_ssm_s=t_theirs,
                ratio=t_ours / t_theirs,
                rel_err_vs_mamba_ssm=err,
                target_met=t_ours / t_theirs <= 1.3,
            )
        )
        H, P, N2 = 80, 64, 128
        x = torch.randn(1, length, H, P, device=device, generator=g)
        dt = torch.randn(1, length, H, device=device, generator=g) * 0.5 - 2
        A2 = -torch.rand(H, device=device, generator=g) - 0.1
        B2 = torch.randn(1, length, 1, N2, device=device, generator=g)
        C2 = torch.randn(1, length, 1, N2, device=device, generator=g)
        h2 = torch.randn(1, H, P, N2, device=device, generator=g)
        with torch.no_grad():
            ours = lambda: backends.ssd_scan(
                x, dt, A2, B2, C2, dt_softplus=True, initial_state=h2, chunk_size=256, backend="triton"
            )
            theirs = lambda: mamba_chunk_scan_combined(
                x, dt, A2, B2, C2, 256, dt_softplus=True, initial_states=h2, return_final_states=True
            )
            err = rel_err(ours()[0], theirs()[0])
            t_ours, t_theirs = median_time(ours, repeats, device), median_time(theirs, repeats, device)
        rows.append(
            dict(
                op="ssd_scan",
                tokens=length,
                triton_s=t_ours,
                mamba_ssm_s=t_theirs,
                ratio=t_ours / t_theirs,
                rel_err_vs_mamba_ssm=err,
                target_met=t_ours / t_theirs <= 1.3,
            )
        )
    return rows, None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", default=["mamba", "mamba2"], choices=list(CONFIGS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n", type=int, default=10, help="states per composition")
    parser.add_argument("--skip-encode", action="store_true")
    parser.add_argument(
        "--fp64-max-tokens",
        type=int,
        default=1024,
        help="also encode in float64 (the exact reference) up to this length",
    )
    parser.add_argument(
        "--compose-states",
        nargs="*",
        default=list(STATE_SHAPES),
        choices=list(STATE_SHAPES),
        help="state shapes for the composition table (none: skip it)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="encode table: torch on one thread, timed by this thread's CPU time (robust on a busy machine)",
    )
    parser.add_argument("--out", default="benchmarks/results/kernels.json")
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args()

    if args.cpu_time:
        torch.set_num_threads(1)
    result = dict(
        benchmark="kernels",
        clock="thread CPU time, 1 thread" if args.cpu_time else "wall",
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        machine=platform.machine(),
        processor=platform.processor(),
        threads=torch.get_num_threads(),
        statistic="median",
        commit=git_commit(),
    )

    if not args.skip_encode:
        encode = []
        for arch in args.arch:
            encode += encode_rows(arch, args.lengths, args.repeats, args.seed, args.fp64_max_tokens, args.cpu_time)
        result["encode"] = encode
        clock = "one thread, thread CPU time" if args.cpu_time else f"{torch.get_num_threads()} threads, wall time"
        print(f"\nencode (CPU, float32, batch 1, {clock}; ratios against the dense-projection floor of the same run)")
        print(
            "| arch | tokens | floor (s) | transformers (s) | encode (s) | encode / floor (target 1.5x) | transformers / floor | "
            "speed-up vs transformers | state vs transformers: layer 0 / max | fp64 error: encode / transformers (layer 0; max) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in encode:
            fp64 = (
                f"{r['encode_vs_fp64_layer0']:.1e} / {r['transformers_vs_fp64_layer0']:.1e}; "
                f"{r['encode_vs_fp64']:.1e} / {r['transformers_vs_fp64']:.1e}"
                if "encode_vs_fp64" in r
                else "-"
            )
            print(
                f"| {r['arch']} | {r['tokens']} | {r['floor_s']:.3f} | {r['transformers_s']:.3f} | {r['encode_s']:.3f} | "
                f"{r['encode_over_floor']:.2f}x {'met' if r['speed_target_met'] else 'missed'} | {r['transformers_over_floor']:.2f}x | "
                f"{r['speedup_vs_transformers']:.2f}x | {r['state_rel_err_layer0']:.1e} / {r['state_rel_err']:.1e} | {fp64} |"
            )

    compose = compose_rows(args.compose_states, args.n, args.repeats, torch.device("cpu"), "torch", args.seed)
    gpu_note = "no CUDA device"
    if torch.cuda.is_available():
        result["gpu"] = torch.cuda.get_device_name()
        compose += compose_rows(args.compose_states, args.n, args.repeats, torch.device("cuda"), "triton", args.seed)
        scans, gpu_note = gpu_scan_rows(args.repeats, args.seed)
        result["gpu_scans"] = scans
    result["compose"] = compose
    print(f"\nfused composition of n={args.n} states, all layers (bandwidth fraction: vs a copy of the same bytes)")
    print("| state | device | method | fused (ms) | materialised (ms) | speed-up | bandwidth fraction |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in compose:
        print(
            f"| {r['state']} | {r['device']} | {r['method']} | {1e3 * r['fused_s']:.2f} | {1e3 * r['materialised_s']:.2f} | "
            f"{r['speedup_vs_materialised']:.2f}x | {r['bandwidth_fraction']:.2f} |"
        )
    if result.get("gpu_scans"):
        print("\nGPU scans (Triton, with initial state, vs mamba-ssm)")
        print("| op | tokens | triton (ms) | mamba-ssm (ms) | ratio | target |")
        print("|---|---:|---:|---:|---:|---|")
        for r in result["gpu_scans"]:
            print(
                f"| {r['op']} | {r['tokens']} | {1e3 * r['triton_s']:.3f} | {1e3 * r['mamba_ssm_s']:.3f} | {r['ratio']:.2f}x | "
                f"{'met' if r['target_met'] else 'MISSED'} |"
            )
    if gpu_note:
        print(f"\nGPU scans not measured: {gpu_note}")
        result["gpu_note"] = gpu_note
    write_result(result, args.out)
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "encode_wall.json")


if __name__ == "__main__":
    main()
