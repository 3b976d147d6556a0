"""The GPU protocol in one script: correctness of the Triton kernels and of the Triton backend on a CUDA device,
their speed against the device's own copy bandwidth and against transformers' own CUDA path, and the time to first
token from composed states. Without CUDA it prints why and exits 0 (``--smoke`` runs the same code on tiny shapes
in Triton's CPU interpreter, to check the script itself: set ``TRITON_INTERPRET=1``).

1. **Correctness** (``correctness``): each Triton kernel (selective scan, SSD scan, causal conv, linear recurrence,
   fused composition) against its plain reference (``ops/<op>/reference.py``) on fresh random inputs, float32
   and bfloat16 inputs (the reference runs in float64 on the same input values), 130M- and 2.7B-shaped layers,
   left-padded rows; forward outputs, final states, ΣΔ and every gradient (initial state included) of a random
   projection of all outputs. Measure: ``max |fast - ref| / max |ref|`` per tensor, against a tolerance per dtype.
   Then models: 130M-shaped random Mamba and Mamba-2 (float32; Mamba-2 also bfloat16): ``encode`` with
   ``backend="triton"`` vs ``"torch"``, the last logits of ``forward(query, past_states=[state])`` vs the stock
   forward of context + query, and 8 greedy tokens of ``generate`` from the state vs from context + query.
2. **Speed** (``speed``): the device's copy bandwidth (``y.copy_(x)`` of 1 GiB, bytes read + written / time);
   each kernel's time and achieved bandwidth (the bytes it must read and write / time) as a fraction of it, at
   2.7B layer shapes (batch 4, 2048 tokens); encode of a 2048-token context with the Triton backend vs
   transformers' own prefill on the same device (``model(ids, use_cache=True, logits_to_keep=1)``), 130M and 1.4B
   random Mamba-2 (and 130M Mamba); the composition of n = 10 states of a 2.7B-shaped Mamba-2 (64 layers, every
   method, ``hsc.compose_states``) as a fraction of copy bandwidth and against prefilling the 10 concatenated
   contexts; time to first token from k = 1, 4, 10 composed states (in memory, and through a folder
   ``StateStore``) against transformers' prefill of the k contexts + query.

mamba-ssm is not compared (no wheel; it does not build within the device budget): the roofline (copy
bandwidth measured in the same run) is the reference. Timings: CUDA events, median of ``--repeats`` after warm-up.

    python benchmarks/gpu.py [--sections correctness,speed] [--budget 480] [--out benchmarks/results/gpu.json]
    TRITON_INTERPRET=1 python benchmarks/gpu.py --smoke        # the script itself, tiny shapes, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# layer shapes: Mamba-1 (D, N), Mamba-2 (H, P, N, G), conv channels
LAYERS = {
    "130m": dict(mamba=(1536, 16), mamba2=(24, 64, 128, 1), conv=1792),
    "2.7b": dict(mamba=(5120, 16), mamba2=(80, 64, 128, 1), conv=5376),
    "tiny": dict(mamba=(24, 4), mamba2=(4, 8, 16, 1), conv=40),
}
TOL = {torch.float32: 2e-3, torch.bfloat16: 2e-2}
MODEL_SIZES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, state_size=16, num_heads=4, head_dim=16, vocab_size=128),
    "130m": dict(hidden_size=768, num_hidden_layers=24, state_size=128, num_heads=24, head_dim=64, vocab_size=50288),
    "1.4b": dict(hidden_size=2048, num_hidden_layers=48, state_size=128, num_heads=64, head_dim=64, vocab_size=50288),
    "2.7b": dict(hidden_size=2560, num_hidden_layers=64, state_size=128, num_heads=80, head_dim=64, vocab_size=50288),
}


class Run:
    """Results, the time budget and the JSON written after every check (a killed run keeps what it had)."""

    def __init__(self, out: str, budget: float, smoke: bool):
        self.out, self.budget, self.smoke, self.start = out, budget, smoke, time.perf_counter()
        self.data: dict = {"checks": {}, "failures": [], "skipped": []}
        self.only: list[str] = []

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def check(self, name: str, fn, need: float = 0.0):
        if self.only and not any(part in name for part in self.only):
            return None
        if self.left() < need:
            self.data["skipped"].append(f"{name}: {self.left():.0f} s of budget left, needs ~{need:.0f} s")
            print(f"[skip] {name}", flush=True)
            return None
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # a broken check is a result: record it and go on
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
            self.data["failures"].append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        if isinstance(result, dict):
            result["wall_s"] = round(time.perf_counter() - t0, 2)
            for key, row in result.items():
                if isinstance(row, dict) and row.get("ok") is False:
                    self.data["failures"].append(f"{name}/{key}: {row}")
        self.data["checks"][name] = result
        print(
            f"[{time.perf_counter() - self.start:6.1f} s] {name}: {json.dumps(result, default=str)[:1500]}", flush=True
        )
        self.save()
        return result

    def save(self):
        Path(self.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out + ".tmp"
        Path(tmp).write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.out)


# ------------------------------------------------------------------------------------------------ helpers
def rel(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return float("nan") if (a is None) != (b is None) else 0.0
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def compare(fast_out, ref_out, fast_leaves, ref_leaves, names, dtype) -> dict:
    """Outputs and the gradients of one random projection of all outputs, fast vs reference."""
    row: dict = {}
    fast_out = [t for t in fast_out if t is not None]
    ref_out = [t for t in ref_out if t is not None]
    for i, (f, r) in enumerate(zip(fast_out, ref_out)):
        row[f"out{i}"] = rel(f, r)
    gen = torch.Generator(device=fast_out[0].device).manual_seed(7)
    cots = [torch.randn(r.shape, generator=gen, device=r.device, dtype=torch.float64) for r in ref_out]
    loss_f = sum((f.double() * c).sum() for f, c in zip(fast_out, cots))
    loss_r = sum((r.double() * c).sum() for r, c in zip(ref_out, cots))
    grads_f = torch.autograd.grad(loss_f, fast_leaves, allow_unused=True)
    grads_r = torch.autograd.grad(loss_r, ref_leaves, allow_unused=True)
    for name, gf, gr in zip(names, grads_f, grads_r):
        row[f"d_{name}"] = rel(gf, gr)
    worst = max(v for v in row.values() if not math.isnan(v)) if row else 0.0
    missing = [k for k, v in row.items() if math.isnan(v)]
    return {"max_rel": worst, "tol": TOL[dtype], "ok": worst <= TOL[dtype] and not missing, "missing": missing, **row}


def leaves(tensors: dict, dtype_of: dict, device) -> tuple[dict, dict]:
    """The same values twice: as the fast path's leaves (in their dtypes) and as float64 reference leaves."""
    fast = {
        k: v.to(device=device, dtype=dtype_of.get(k, torch.float32)).requires_grad_(v.is_floating_point())
        for k, v in tensors.items()
    }
    ref = {k: v.detach().double().requires_grad_(v.is_floating_point()) for k, v in fast.items()}
    return fast, ref


def cuda_time(fn, repeats: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, wall time on CPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def left_pad_mask(batch: int, length: int, device) -> torch.Tensor:
    mask = torch.ones(batch, length, device=device)
    if batch > 1:
        mask[0, : length // 7] = 0  # row 0 left padded
    return mask


# ------------------------------------------------------------------------------------------------ 1. kernels
def check_selective_scan(shape, dtype, batch, length, device):
    from hf_statecompose.ops.selective_scan.reference import selective_scan_ref
    from hf_statecompose.ops.selective_scan.triton_wrapper import selective_scan_triton

    D, N = shape
    g = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=g)
    t = dict(
        u=r(batch, D, length),
        delta=r(batch, D, length) * 0.5 - 1,
        A=-torch.exp(r(D, N) * 0.5),
        B=r(batch, N, length),
        C=r(batch, N, length),
        D=r(D),
        z=r(batch, D, length),
        delta_bias=r(D) * 0.1,
        initial_state=r(batch, D, N),
    )
    fast, ref = leaves(t, {k: dtype for k in ("u", "delta", "B", "C", "z")}, device)
    mask = left_pad_mask(batch, length, device)
    out_f = selective_scan_triton(**fast, delta_softplus=True, mask=mask)
    out_r = selective_scan_ref(**ref, delta_softplus=True, mask=mask.double())
    return compare(out_f, out_r, list(fast.values()), list(ref.values()), list(fast), dtype)


def check_ssd(shape, dtype, batch, length, device):
    from hf_statecompose.ops.ssd.reference import ssd_scan_ref
    from hf_statecompose.ops.ssd.triton_wrapper import ssd_scan_triton

    H, P, N, G = shape
    g = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=g)
    t = dict(
        x=r(batch, length, H, P),
        dt=r(batch, length, H) * 0.5 - 1,
        A=-torch.exp(r(H) * 0.5),
        B=r(batch, length, G, N),
        C=r(batch, length, G, N),
        D=r(H),
        dt_bias=r(H) * 0.1,
        initial_state=r(batch, H, P, N),
    )
    fast, ref = leaves(t, {k: dtype for k in ("x", "dt", "B", "C")}, device)
    mask = left_pad_mask(batch, length, device)
    out_f = ssd_scan_triton(**fast, dt_softplus=True, mask=mask)
    out_r = ssd_scan_ref(**ref, dt_softplus=True, mask=mask.double())
    return compare(out_f, out_r, list(fast.values()), list(ref.values()), list(fast), dtype)


def check_conv(channels, dtype, batch, length, device):
    from hf_statecompose.ops.conv.reference import causal_conv1d_ref
    from hf_statecompose.ops.conv.triton_wrapper import causal_conv1d_triton

    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g)
    t = dict(x=r(batch, channels, length), weight=r(channels, 4), bias=r(channels), conv_state=r(batch, channels, 4))
    fast, ref = leaves(t, {"x": dtype, "conv_state": dtype}, device)
    mask = left_pad_mask(batch, length, device)
    out_f = causal_conv1d_triton(**fast, mask=mask, activation="silu")
    out_r = causal_conv1d_ref(**ref, mask=mask.double(), activation="silu")
    return compare(out_f, out_r, list(fast.values()), list(ref.values()), list(fast), dtype)


def check_linear_recurrence(channels, dtype, batch, length, device):
    from hf_statecompose.ops.linear_recurrence.reference import linear_recurrence_reference
    from hf_statecompose.ops.linear_recurrence.triton_wrapper import linear_recurrence_triton

    g = torch.Generator().manual_seed(4)
    t = dict(
        a=torch.rand(batch, length, channels, generator=g) * 0.2 + 0.8,
        b=torch.randn(batch, length, channels, generator=g),
        initial_state=torch.randn(batch, channels, generator=g),
    )
    fast, ref = leaves(t, {"a": dtype, "b": dtype}, device)
    out_f = linear_recurrence_triton(**fast)
    out_r = linear_recurrence_reference(**ref)
    return compare([out_f], [out_r], list(fast.values()), list(ref.values()), list(fast), dtype)


def check_compose(layer, dtype, n, device):
    from hf_statecompose.ops.compose.methods import METHODS
    from hf_statecompose.ops.compose.reference import compose_ssm_ref
    from hf_statecompose.ops.compose.triton_wrapper import compose_ssm_layers_triton, compose_ssm_triton

    row = {}
    g = torch.Generator().manual_seed(5)
    for arch in ("mamba", "mamba2"):
        shape = layer[arch]
        if arch == "mamba":
            D, N = shape
            states = [torch.randn(2, D, N, generator=g) for _ in range(n)]
            delta_sums, A = torch.rand(n, 2, D, generator=g) * 20, -torch.exp(torch.randn(D, N, generator=g))
        else:
            H, P, N, _ = shape
            states = [torch.randn(2, H, P, N, generator=g) for _ in range(n)]
            delta_sums, A = torch.rand(n, 2, H, generator=g) * 20, -torch.exp(torch.randn(H, generator=g))
        weights = torch.softmax(torch.randn(n, generator=g), 0)
        fast = [s.to(device, dtype) for s in states]
        for name, spec in METHODS.items():
            if spec.kernel_id is None:
                continue
            w = weights if spec.user_weights else None
            out_f = compose_ssm_triton(
                fast, delta_sums.to(device), A.to(device), name, weights=None if w is None else w.to(device)
            )
            out_r = compose_ssm_ref(
                [s.double() for s in fast],
                delta_sums.double().to(device),
                A.double().to(device),
                name,
                weights=None if w is None else w.double().to(device),
            )
            err = rel(out_f, out_r)
            row[f"{arch}/{name}"] = {"rel": err, "ok": err <= TOL[dtype]}
            # all layers in one launch: 4 layers, each its own states / ΣΔ / A, against the reference per layer
            layer_states = [fast] + [[(s * (i + 2)).to(dtype) for s in fast] for i in range(3)]
            layer_ds = [delta_sums.to(device) * (1 + 0.1 * i) for i in range(4)]
            layer_A = [A.to(device) * (1 + 0.05 * i) for i in range(4)]
            wl = None if w is None else w.to(device)
            outs = compose_ssm_layers_triton(layer_states, layer_ds, layer_A, name, weights=wl)
            errs = [
                rel(
                    o,
                    compose_ssm_ref(
                        [s.double() for s in st],
                        d.double(),
                        a.double(),
                        name,
                        weights=None if wl is None else wl.double(),
                    ),
                )
                for o, st, d, a in zip(outs, layer_states, layer_ds, layer_A)
            ]
            row[f"{arch}/{name}/4_layers_one_launch"] = {"rel": max(errs), "ok": max(errs) <= TOL[dtype]}
    return row


def kernel_correctness(run: Run, device):
    sizes = ["tiny"] if run.smoke else ["130m", "2.7b"]
    dtypes = [torch.float32] if run.smoke else [torch.float32, torch.bfloat16]
    length = 37 if run.smoke else 512
    for size in sizes:
        layer = LAYERS[size]
        for dtype in dtypes:
            tag = f"{size}/{str(dtype).split('.')[-1]}"
            run.check(
                f"correct/selective_scan/{tag}",
                lambda: check_selective_scan(layer["mamba"], dtype, 2, length, device),
                20,
            )
            run.check(f"correct/ssd_scan/{tag}", lambda: check_ssd(layer["mamba2"], dtype, 2, length, device), 20)
            run.check(f"correct/causal_conv1d/{tag}", lambda: check_conv(layer["conv"], dtype, 2, length, device), 10)
            run.check(
                f"correct/linear_recurrence/{tag}",
                lambda: check_linear_recurrence(layer["mamba"][0], dtype, 2, length, device),
                10,
            )
            run.check(f"correct/compose/{tag}", lambda: check_compose(layer, dtype, 10, device), 10)


# ------------------------------------------------------------------------------------------------ models
def build(arch: str, size: str, device, dtype):
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    import hf_statecompose as hsc

    kw = dict(MODEL_SIZES[size])
    torch.manual_seed(0)
    if arch == "mamba":
        config = MambaConfig(
            vocab_size=kw["vocab_size"],
            hidden_size=kw["hidden_size"],
            num_hidden_layers=kw["num_hidden_layers"],
            state_size=16,
            expand=2,
            conv_kernel=4,
        )
        cls = MambaForCausalLM
    else:
        config = Mamba2Config(
            **kw,
            expand=2,
            n_groups=1,
            chunk_size=256 if size != "tiny" else 16,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
        cls = Mamba2ForCausalLM
    with torch.device(device):
        model = cls(config)
    model = model.to(dtype).eval()
    return hsc.enable(model)


@torch.no_grad()
def check_model(arch: str, size: str, dtype, device, context_len: int, query_len: int):
    import hf_statecompose as hsc

    model = build(arch, size, device, dtype)
    g = torch.Generator().manual_seed(11)
    vocab = model.config.vocab_size
    context = torch.randint(3, vocab, (1, context_len), generator=g).to(device)
    query = torch.randint(3, vocab, (1, query_len), generator=g).to(device)
    s_tri = hsc.encode(model, context, backend="triton")
    s_tor = hsc.encode(model, context, backend="torch")
    state_rel = max(rel(a, b) for a, b in zip(s_tri.ssm_states, s_tor.ssm_states))
    conv_rel = max(rel(a, b) for a, b in zip(s_tri.conv_states, s_tor.conv_states))
    full = torch.cat([context, query], 1)
    stock = model(full).logits[:, -1].float()
    rows = {}
    for backend in ("triton", "torch"):
        hsc.set_backend(model, backend)
        state = s_tri if backend == "triton" else s_tor
        logits = model(query, past_states=[state]).logits[:, -1].float()
        rows[f"logits_{backend}_vs_context_plus_query"] = rel(logits, stock)
    hsc.set_backend(model, "triton")
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    from_state = model.generate(query, past_states=[s_tri], **gen)[0, -8:]
    from_full = model.generate(full, **gen)[0, -8:]
    hsc.set_backend(model, "torch")
    from_state_torch = model.generate(query, past_states=[s_tor], **gen)[0, -8:]
    hsc.set_backend(model, "auto")
    if dtype != torch.float32:
        # bf16: the state path is judged against a float32 copy of the same model, next to the errors that
        # bf16 itself makes (the torch backend's state, stock transformers' bf16 logits): no worse than those
        import copy

        model32 = copy.deepcopy(model).float()
        ref = hsc.encode(model32, context, backend="torch")
        stock32 = model32(full).logits[:, -1].float()
        last = len(ref.ssm_states) - 1
        diag = {}
        for name, state in (("triton", s_tri), ("torch", s_tor)):
            diag[f"layer0_state_{name}_vs_fp32"] = rel(state.ssm_states[0], ref.ssm_states[0])
            diag[f"last_layer_state_{name}_vs_fp32"] = rel(state.ssm_states[last], ref.ssm_states[last])
        hsc.set_backend(model, "triton")
        diag["logits_triton_state_vs_fp32_stock"] = rel(
            model(query, past_states=[s_tri]).logits[:, -1].float(), stock32
        )
        hsc.set_backend(model, "auto")
        diag["logits_bf16_stock_vs_fp32_stock"] = rel(stock, stock32)
        ours = max(diag["layer0_state_triton_vs_fp32"], diag["logits_triton_state_vs_fp32_stock"])
        theirs = max(diag["layer0_state_torch_vs_fp32"], diag["logits_bf16_stock_vs_fp32_stock"])
        model32 = None
        return {
            "state_triton_vs_torch": state_rel,
            **rows,
            **diag,
            "greedy8_triton_state_eq_context_plus_query": bool(torch.equal(from_state, from_full)),
            "verdict": {"ours_vs_fp32": ours, "bf16_baseline_vs_fp32": theirs, "ok": ours <= 2 * theirs + 1e-3},
        }
    tol = 1e-3
    worst = max(state_rel, *rows.values())
    return {
        "state_triton_vs_torch": state_rel,
        "conv_triton_vs_torch": conv_rel,
        **rows,
        "greedy8_triton_state_eq_context_plus_query": bool(torch.equal(from_state, from_full)),
        "greedy8_triton_eq_torch": bool(torch.equal(from_state, from_state_torch)),
        "tokens_equal_of_8": int((from_state == from_full).sum()),
        "verdict": {"max_rel": worst, "tol": tol, "ok": worst <= tol},
    }


def model_correctness(run: Run, device):
    size = "tiny" if run.smoke else "130m"
    ctx, q = (20, 6) if run.smoke else (300, 24)
    run.check(
        f"correct/model/mamba/{size}/float32", lambda: check_model("mamba", size, torch.float32, device, ctx, q), 30
    )
    run.check(
        f"correct/model/mamba2/{size}/float32", lambda: check_model("mamba2", size, torch.float32, device, ctx, q), 30
    )
    if True:  # bf16 in the interpreter is upcast at load: the smoke run checks the code path, not bf16
        run.check(
            f"correct/model/mamba2/{size}/bfloat16",
            lambda: check_model("mamba2", size, torch.bfloat16, device, ctx, q),
            30,
        )


# ------------------------------------------------------------------------------------------------ 2. speed
def copy_bandwidth(device, smoke: bool, repeats: int) -> dict:
    n = (1 << 20) if smoke else (1 << 28)  # 1 GiB of float32 on a GPU
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    s = cuda_time(lambda: y.copy_(x), repeats)
    return {"bytes": 2 * x.nbytes, "seconds": s, "GBps": 2 * x.nbytes / s / 1e9}


def kernel_speed(run: Run, device, copy_bps: float, repeats: int):
    from hf_statecompose.ops.compose.triton_wrapper import compose_ssm_layers_triton, compose_ssm_triton
    from hf_statecompose.ops.conv.triton_wrapper import causal_conv1d_triton
    from hf_statecompose.ops.linear_recurrence.triton_wrapper import linear_recurrence_triton
    from hf_statecompose.ops.selective_scan.triton_wrapper import selective_scan_triton
    from hf_statecompose.ops.ssd.triton_wrapper import ssd_scan_triton

    layer = LAYERS["tiny" if run.smoke else "2.7b"]
    batch, length = (1, 32) if run.smoke else (4, 2048)

    def timed(name, make, bytes_moved, backward=False):
        def go():
            fn, inputs = make()
            fwd = cuda_time(fn, repeats)
            row = {
                "fwd_s": fwd,
                "bytes": bytes_moved,
                "GBps": bytes_moved / fwd / 1e9,
                "fraction_of_copy": bytes_moved / fwd / copy_bps,
            }
            if backward:

                def fb():
                    outs = fn()
                    outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o is not None]
                    torch.autograd.grad(sum(o.float().sum() for o in outs), inputs)

                row["fwd_bwd_s"] = cuda_time(fb, max(3, repeats // 2))
            return row

        return run.check(f"speed/kernel/{name}", go, 15)

    D, N = layer["mamba"]
    for dtype in (torch.float32, torch.bfloat16):
        tag, es = str(dtype).split(".")[-1], torch.tensor([], dtype=dtype).element_size()

        def make_scan(dtype=dtype):
            u, delta, z = (
                torch.randn(batch, D, length, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
            )
            Bm, C = (torch.randn(batch, N, length, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
            A = (-torch.rand(D, N, device=device) - 0.5).requires_grad_()
            h0 = torch.randn(batch, D, N, device=device, requires_grad=True)
            return (lambda: selective_scan_triton(u, delta, A, Bm, C, z=z, delta_softplus=True, initial_state=h0)), [
                u,
                delta,
                z,
                Bm,
                C,
                A,
                h0,
            ]

        # reads u, delta, z, B, C; writes y (float32); states are small
        timed(f"selective_scan/{tag}", make_scan, batch * length * (3 * D * es + 2 * N * es + 4 * D), backward=True)
        H, P, NN, G = layer["mamba2"]

        def make_ssd(dtype=dtype):
            x = torch.randn(batch, length, H, P, device=device, dtype=dtype, requires_grad=True)
            dt = torch.randn(batch, length, H, device=device, dtype=dtype, requires_grad=True)
            Bm, C = (
                torch.randn(batch, length, G, NN, device=device, dtype=dtype, requires_grad=True) for _ in range(2)
            )
            A = (-torch.rand(H, device=device) - 0.5).requires_grad_()
            h0 = torch.randn(batch, H, P, NN, device=device, requires_grad=True)
            return (lambda: ssd_scan_triton(x, dt, A, Bm, C, dt_softplus=True, initial_state=h0)), [x, dt, Bm, C, A, h0]

        timed(
            f"ssd_scan/{tag}",
            make_ssd,
            batch * length * (H * P * es + H * es + 2 * G * NN * es + H * P * 4) + 2 * batch * H * P * NN * 4,
            backward=True,
        )
        Cc = layer["conv"]

        def make_conv(dtype=dtype):
            x = torch.randn(batch, Cc, length, device=device, dtype=dtype, requires_grad=True)
            w = torch.randn(Cc, 4, device=device, requires_grad=True)
            return (lambda: causal_conv1d_triton(x, w, activation="silu")), [x, w]

        timed(f"causal_conv1d/{tag}", make_conv, 2 * batch * Cc * length * es, backward=True)

        def make_lr(dtype=dtype):
            a = torch.rand(batch, length, D, device=device, dtype=dtype).requires_grad_()
            b = torch.randn(batch, length, D, device=device, dtype=dtype, requires_grad=True)
            return (lambda: linear_recurrence_triton(a, b)), [a, b]

        timed(f"linear_recurrence/{tag}", make_lr, 3 * batch * length * D * es, backward=True)

        n, layers = 10, (2 if run.smoke else 64)
        for method in ("soup", "caso", "picaso_s", "picaso_r"):

            def make_compose(dtype=dtype, method=method):
                states = [
                    [torch.randn(1, H, P, NN, device=device, dtype=dtype) for _ in range(n)] for _ in range(layers)
                ]
                ds = [torch.rand(n, 1, H, device=device) * 20 for _ in range(layers)]
                A = -torch.rand(H, device=device) - 0.5
                return (lambda: [compose_ssm_triton(s, d, A, method) for s, d in zip(states, ds)]), []

            timed(f"compose_n10_{layers}layers/{method}/{tag}", make_compose, (n + 1) * layers * H * P * NN * es)

            def make_compose_layers(dtype=dtype, method=method):
                states = [
                    [torch.randn(1, H, P, NN, device=device, dtype=dtype) for _ in range(n)] for _ in range(layers)
                ]
                ds = [torch.rand(n, 1, H, device=device) * 20 for _ in range(layers)]
                As = [-torch.rand(H, device=device) - 0.5 for _ in range(layers)]
                return (lambda: compose_ssm_layers_triton(states, ds, As, method)), []

            timed(
                f"compose_layers_n10_{layers}layers/{method}/{tag}",
                make_compose_layers,
                (n + 1) * layers * H * P * NN * es,
            )


@torch.no_grad()
def encode_speed(run: Run, device, repeats: int):
    import hf_statecompose as hsc

    length = 64 if run.smoke else 2048
    cases = (
        [("mamba2", "tiny", torch.float32)]
        if run.smoke
        else [
            ("mamba2", "130m", torch.float32),
            ("mamba2", "130m", torch.bfloat16),
            ("mamba2", "1.4b", torch.bfloat16),
            ("mamba", "130m", torch.float32),
        ]
    )
    for arch, size, dtype in cases:

        def go(arch=arch, size=size, dtype=dtype):
            model = build(arch, size, device, dtype)
            ids = torch.randint(3, model.config.vocab_size, (1, length), device=device)
            ours = cuda_time(lambda: hsc.encode(model, ids, backend="triton"), repeats)
            stock = cuda_time(lambda: model(ids, use_cache=True, logits_to_keep=1), max(2, repeats // 2), warmup=1)
            model = None
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            return {"tokens": length, "encode_triton_s": ours, "transformers_prefill_s": stock, "speedup": stock / ours}

        run.check(f"speed/encode/{arch}/{size}/{str(dtype).split('.')[-1]}", go, 40)


@torch.no_grad()
def compose_speed(run: Run, device, copy_bps: float, repeats: int):
    """n = 10 states of a 2.7B-shaped Mamba-2: every method through hsc.compose_states vs copy and vs prefill."""
    import hf_statecompose as hsc

    size, ctx, n = ("tiny", 16, 10) if run.smoke else ("2.7b", 256, 10)

    def go():
        model = build("mamba2", size, device, torch.bfloat16)
        g = torch.Generator().manual_seed(3)
        contexts = [torch.randint(3, model.config.vocab_size, (1, ctx), generator=g).to(device) for _ in range(n)]
        states = [hsc.encode(model, c, backend="triton") for c in contexts]
        state_bytes = sum(t.nbytes for t in states[0].ssm_states)
        row = {"n": n, "layers": model.config.num_hidden_layers, "ssm_bytes_per_state": state_bytes}
        moved = (n + 1) * state_bytes
        for method in ("soup", "caso", "picaso_s", "picaso_r"):
            s = cuda_time(lambda: hsc.compose_states(states, method, model=model), repeats)
            row[method] = {"seconds": s, "fraction_of_copy": moved / s / copy_bps}
        concat = torch.cat(contexts, 1)
        row["prefill_concat_s"] = cuda_time(lambda: model(concat, use_cache=True, logits_to_keep=1), 3, warmup=1)
        for method in ("soup", "caso", "picaso_s", "picaso_r"):
            row[method]["prefill_over_compose"] = row["prefill_concat_s"] / row[method]["seconds"]
        model = states = None
        return row

    run.check(f"speed/compose_states/mamba2/{size}/bfloat16", go, 60)


@torch.no_grad()
def ttft_speed(run: Run, device, repeats: int):
    """TTFT from k composed states (in memory, and through a folder StateStore) vs prefill of k contexts + query."""
    from ttft import QUERY_TOKENS, CharTokenizer, passage

    import hf_statecompose as hsc
    from hf_statecompose.benchmarking import BagOfWords

    sizes = ["tiny"] if run.smoke else ["130m", "1.4b"]
    for size in sizes:

        def go(size=size):
            model = build("mamba2", size, device, torch.bfloat16)
            tok, gen = CharTokenizer(), dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
            texts = [passage(i) for i in range(10)]
            query = tok("the shared word?"[:QUERY_TOKENS].ljust(QUERY_TOKENS, "?"), return_tensors="pt")[
                "input_ids"
            ].to(device)
            ids = [tok(t, return_tensors="pt")["input_ids"].to(device) for t in texts]
            states = [hsc.encode(model, i) for i in ids]
            row = {}
            with tempfile.TemporaryDirectory() as tmp:
                store = hsc.StateStore(Path(tmp) / "s", model, tok, retriever=BagOfWords())
                store.add(texts, batch_size=10, show_progress=False)
                for k in (1, 4, 10):
                    mem = cuda_time(
                        lambda: model.generate(query, past_states=states[:k], composition="picaso_r", **gen), repeats
                    )

                    def via_store():
                        entries = store.retrieve("the shared word?", k)
                        return model.generate(
                            query, past_states=[e.state for e in reversed(entries)], composition="picaso_r", **gen
                        )

                    stored = cuda_time(via_store, repeats)
                    concat = torch.cat(ids[:k] + [query], 1)
                    base = cuda_time(lambda: model.generate(concat, **gen), 3, warmup=1)
                    row[f"k{k}"] = {
                        "ttft_memory_s": mem,
                        "ttft_store_s": stored,
                        "prefill_s": base,
                        "speedup_memory": base / mem,
                        "speedup_store": base / stored,
                    }
            row["ttft_store_k10_over_k1"] = row["k10"]["ttft_store_s"] / row["k1"]["ttft_store_s"]
            model = None
            return row

        run.check(f"speed/ttft/mamba2/{size}/bfloat16", go, 60)


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="correctness,speed")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds; checks that would not fit are skipped")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    parser.add_argument("--only", default="", help="comma-separated substrings: run only the checks named so")
    args = parser.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--smoke needs TRITON_INTERPRET=1 in the environment")
        device = torch.device("cpu")
        args.repeats = 1
    elif not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device: skipped (TRITON_INTERPRET=1 ... --smoke checks the script on CPU)")
        return 0
    else:
        device = torch.device("cuda")
    import transformers
    import triton

    from hf_statecompose.benchmarking import git_commit

    run = Run(args.out, args.budget, args.smoke)
    run.only = [part for part in args.only.split(",") if part]
    run.data["env"] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
    }
    print(json.dumps(run.data["env"]), flush=True)
    sections = set(args.sections.split(","))
    with contextlib.suppress(Exception):
        torch.backends.cuda.matmul.allow_tf32 = False
    if "correctness" in sections:
        kernel_correctness(run, device)
        model_correctness(run, device)
    if "speed" in sections:
        copy = run.check("speed/copy_bandwidth", lambda: copy_bandwidth(device, args.smoke, args.repeats))
        copy_bps = copy["GBps"] * 1e9 if copy and "GBps" in copy else float("nan")
        kernel_speed(run, device, copy_bps, args.repeats)
        encode_speed(run, device, max(3, args.repeats // 2))
        compose_speed(run, device, copy_bps, args.repeats)
        ttft_speed(run, device, max(3, args.repeats // 2))
    run.data["total_s"] = round(time.perf_counter() - run.start, 1)
    run.save()
    print(f"\n{len(run.data['failures'])} failures, {len(run.data['skipped'])} skipped; wrote {args.out}")
    for line in run.data["failures"]:
        print("FAIL", line[:400])
    return 1 if run.data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
