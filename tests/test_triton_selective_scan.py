"""Triton selective scan (Mamba-1) vs ``selective_scan_ref``: outputs, final state, ΣΔ and every gradient.

Runs compiled on CUDA, or in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1 without a GPU):
widths are small and lengths <= 128 so that the interpreter stays fast.
"""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

import torch

from hf_statecompose.ops.selective_scan import selective_scan_ref
from hf_statecompose.ops.selective_scan.triton_wrapper import _selective_scan, selective_scan_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRAD_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}  # bf16: gradients come back rounded to bf16 (2^-9)


def _rel(a, b):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / (scale if scale > 0 else 1.0)


def _inputs(
    length,
    seed,
    dtype,
    *,
    batch=2,
    channels=12,
    state=16,
    softplus=True,
    bias=True,
    mask=True,
    h0=True,
    d_z=True,
    noncontig=False,
):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    inp = dict(
        u=r(batch, channels, length),
        delta=r(batch, channels, length),
        A=-torch.rand(channels, state, generator=g) * 4 - 0.1,
        B=r(batch, length, state).transpose(1, 2) if noncontig else r(batch, state, length),
        C=r(batch, length, state).transpose(1, 2) if noncontig else r(batch, state, length),
        D=r(channels) if d_z else None,
        z=r(batch, channels, length) if d_z else None,
        delta_bias=r(channels) * 0.5 if bias else None,
        initial_state=r(batch, channels, state) if h0 else None,
    )
    if not softplus:  # raw Δ (+ bias) must be >= 0 without the softplus
        inp["delta"] = inp["delta"].abs()
        if bias:
            inp["delta_bias"] = inp["delta_bias"].abs()
    inp = {k: (None if v is None else v.to(dtype).to(DEVICE)) for k, v in inp.items()}
    if noncontig:  # u as a strided slice too
        wide = torch.randn(batch, 2 * channels, length, generator=g).to(dtype).to(DEVICE)
        wide[:, ::2] = inp["u"]
        inp["u"] = wide[:, ::2]
    if mask:
        m = torch.ones(batch, length)
        m[-1, : min(3, length - 1)] = 0  # left padding on the last row (keeps at least one real token)
        inp["mask"] = m.to(DEVICE)
    inp["delta_softplus"] = softplus
    return inp


def _run(fn, inp, weights, leaves, **kw):
    y, h, s = fn(**inp, **kw)
    loss = (y * weights[0]).sum() + (h * weights[1]).sum() + (s * weights[2]).sum()
    grads = torch.autograd.grad(loss, [inp[k] for k in leaves])
    return (y, h, s), dict(zip(leaves, grads))


def _leaves(inp, dtype=None):
    """Fresh leaf tensors (upcast to ``dtype`` when given) with requires_grad."""
    out = {}
    for k, v in inp.items():
        if isinstance(v, torch.Tensor) and k in GRAD_NAMES:
            v = v.detach().clone() if dtype is None else v.detach().to(dtype)
            out[k] = v.requires_grad_(True)
        else:
            out[k] = v
    return out


def _check(length, dtype, chunk_size, block_d=8, **opts):
    inp = _inputs(length, seed=1000 + length, dtype=dtype, **opts)
    leaves = [k for k in GRAD_NAMES if inp.get(k) is not None]
    batch, channels, _ = inp["u"].shape
    g = torch.Generator().manual_seed(7)
    weights = [
        torch.randn(*s, generator=g).to(DEVICE)
        for s in ((batch, channels, length), (batch, channels, inp["A"].shape[1]), (batch, channels))
    ]
    ours_in = _leaves(inp)
    ref_in = _leaves(inp, torch.float32)  # the same (bf16) values, upcast: the reference computes in fp32 too
    (y, h, s), grads = _run(_selective_scan, ours_in, weights, leaves, chunk_size=chunk_size, block_d=block_d)
    (ye, he, se), grads_e = _run(selective_scan_ref, ref_in, weights, leaves)
    for out in (y, h, s):
        assert out.dtype == torch.float32
    assert y.shape == ye.shape and h.shape == he.shape and s.shape == se.shape
    assert _rel(y, ye) < 1e-5, _rel(y, ye)
    assert _rel(h, he) < 1e-5, _rel(h, he)
    assert _rel(s, se) < 1e-6, _rel(s, se)
    for k in leaves:
        assert grads[k].dtype == inp[k].dtype and grads[k].shape == inp[k].shape, k
        err = _rel(grads[k], grads_e[k])
        assert err < TOL[dtype], (k, err)


# (length, dtype, chunk_size, options): lengths 1, 7, 63, 128; chunk multiple / not multiple / longer than T
CASES = [
    (1, torch.float32, 64, dict()),
    (7, torch.float32, 64, dict(state=5, softplus=False, bias=False, mask=False, h0=False, d_z=False)),
    (63, torch.float32, 16, dict(state=5)),  # 4 chunks, the last one partial
    (128, torch.float32, 32, dict(mask=False, noncontig=True, channels=20)),  # 4 full chunks, 3 D-blocks
    (100, torch.float32, 64, dict(h0=False)),  # default chunk, 100 = 64 + 36
    (7, torch.bfloat16, 64, dict(h0=False, bias=False)),
    (63, torch.bfloat16, 16, dict()),
    (128, torch.bfloat16, 64, dict(state=5, softplus=False, h0=False)),
]


@pytest.mark.parametrize(
    "length,dtype,chunk_size,opts",
    CASES,
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={x}" for k, x in v.items()) or "all",
)
def test_matches_reference_values_and_gradients(length, dtype, chunk_size, opts):
    _check(length, dtype, chunk_size, **opts)


def test_public_function_default_blocks():
    """The public entry point (default chunk and channel block) on a case with every feature on."""
    inp = _inputs(63, seed=5, dtype=torch.float32, channels=24, state=5)
    ours_in, ref_in = _leaves(inp), _leaves(inp)
    leaves = list(GRAD_NAMES)
    w = [torch.ones(()), torch.ones(()), torch.ones(())]  # y.sum(): the incoming dy has stride 0
    (y, h, s), grads = _run(selective_scan_triton, ours_in, w, leaves)
    (ye, he, se), grads_e = _run(selective_scan_ref, ref_in, w, leaves)
    assert _rel(y, ye) < 1e-5 and _rel(h, he) < 1e-5 and _rel(s, se) < 1e-6
    for k in leaves:
        assert _rel(grads[k], grads_e[k]) < 1e-5, k


@pytest.mark.parametrize("which", ["y", "final_state"])
def test_gradient_through_one_output_only(which):
    """Only y or only the final state reaches the loss (the other output's gradient is None)."""
    inp = _inputs(20, seed=11, dtype=torch.float32, state=5)
    ours_in, ref_in = _leaves(inp), _leaves(inp)
    idx = 0 if which == "y" else 1
    outs = _selective_scan(**ours_in, chunk_size=8, block_d=8)
    outs_e = selective_scan_ref(**ref_in)
    grads = torch.autograd.grad((outs[idx] ** 2).sum(), [ours_in[k] for k in GRAD_NAMES], allow_unused=True)
    grads_e = torch.autograd.grad((outs_e[idx] ** 2).sum(), [ref_in[k] for k in GRAD_NAMES], allow_unused=True)
    for k, a, e in zip(GRAD_NAMES, grads, grads_e):
        if e is None:  # D and z do not reach the final state
            assert a is None or not a.any(), k
        else:
            assert _rel(a, e) < 1e-5, k


def test_partial_requires_grad_and_no_grad_path():
    inp = _inputs(9, seed=3, dtype=torch.float32, state=5)
    expected = selective_scan_ref(**inp)
    with torch.no_grad():  # inference path: no checkpoints stored
        actual = _selective_scan(**inp, chunk_size=4, block_d=8)
    for a, e in zip(actual, expected):
        assert _rel(a, e) < 1e-5
    u = inp["u"].clone().requires_grad_(True)
    (y, _, _) = _selective_scan(**{**inp, "u": u}, chunk_size=4, block_d=8)
    u_e = inp["u"].clone().requires_grad_(True)
    (ye, _, _) = selective_scan_ref(**{**inp, "u": u_e})
    (gu,) = torch.autograd.grad(y.sum(), [u])
    (gu_e,) = torch.autograd.grad(ye.sum(), [u_e])
    assert _rel(gu, gu_e) < 1e-5


def test_backward_is_deterministic():
    inp = _leaves(_inputs(12, seed=9, dtype=torch.float32, channels=24, state=5))
    first = torch.autograd.grad(_selective_scan(**inp, chunk_size=5, block_d=8)[0].pow(2).sum(), [inp["A"], inp["B"]])
    second = torch.autograd.grad(_selective_scan(**inp, chunk_size=5, block_d=8)[0].pow(2).sum(), [inp["A"], inp["B"]])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_empty_sequence():
    inp = _leaves(_inputs(0, seed=1, dtype=torch.float32, state=5, mask=False))
    y, h, s = selective_scan_triton(**inp)
    assert y.shape == (2, 12, 0) and s.shape == (2, 12)
    torch.testing.assert_close(h, inp["initial_state"].detach())
    (g,) = torch.autograd.grad((h * 2).sum(), [inp["initial_state"]])
    torch.testing.assert_close(g, torch.full_like(g, 2.0))


def test_bad_inputs():
    inp = _inputs(5, seed=2, dtype=torch.float32, state=5)
    with pytest.raises(ValueError, match="B must be"):
        selective_scan_triton(**{**inp, "B": inp["B"][:, :4]})
    with pytest.raises(ValueError, match="initial_state"):
        selective_scan_triton(**{**inp, "initial_state": inp["initial_state"][:, :, :3]})
    with pytest.raises(ValueError, match="z must be"):
        selective_scan_triton(**{**inp, "z": inp["z"][:, :, :2]})
    with pytest.raises(TypeError, match="float32"):
        selective_scan_triton(**{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()})


# Compiles (does not run) every launch the wrapper makes for realistic Mamba-1 shapes, for an H100 (sm_90),
# with Triton's bundled ptxas. The kernels are replaced by recorders, the wrapper is called on meta tensors,
# and each recorded launch is specialised exactly as Triton's runtime would (ints equal to 1 become constexprs,
# multiples of 16 get the divisibility hint), with the wrapper's own block sizes, num_warps and flags.
# The resource usage of each cubin (cuobjdump) must show no stack / local memory, i.e. no register spills.
_COMPILE_FOR_SM90 = r"""
import itertools, os, re, subprocess, sys, tempfile
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from hf_statecompose.ops._triton import bundled_kernels
bundled_kernels()  # registers hf_statecompose._kernels (loaded by path in a source checkout)
import hf_statecompose._kernels._selective_scan as ss

launches = {}

class Recorder:
    def __init__(self, fn):
        self.fn, self.what = fn, None
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            num_warps = kwargs.pop("num_warps")
            bound = dict(zip(self.fn.arg_names, args), **kwargs)
            assert len(bound) == len(self.fn.arg_names), self.fn.arg_names
            signature, constexprs, attrs = {}, {}, {}
            for i, name in enumerate(self.fn.arg_names):
                if name in kwargs:  # a tl.constexpr parameter
                    signature[name], constexprs[name] = "constexpr", kwargs[name]
                    continue
                kind, spec = native_specialize_impl(BaseBackend, bound[name], False, True, True)
                signature[name] = kind
                if kind == "constexpr":  # an int equal to 1
                    constexprs[name] = spec
                else:
                    attrs[(i,)] = BaseBackend.parse_attr(spec)
            key = (self.fn.__name__, repr(signature), repr(sorted(constexprs.items())), repr(sorted(attrs.items())),
                   num_warps)
            launches.setdefault(key, (self.fn, signature, constexprs, attrs, num_warps, self.what))
        return launch

fwd, bwd = Recorder(ss._scan_fwd_kernel), Recorder(ss._scan_bwd_kernel)
ss._scan_fwd_kernel, ss._scan_bwd_kernel = fwd, bwd
meta = dict(device="meta")
# fp32 with contiguous B, C; bf16 with B, C as transposed slices of x_proj's [batch, T, R + 2N] output (HF)
for (D, N), (dtype, hf_layout), length in itertools.product(
        ((1536, 16), (5120, 16), (1536, 5)), ((torch.float32, False), (torch.bfloat16, True)), (1, 300)):
    batch = 2
    u = torch.empty(batch, D, length, dtype=dtype, **meta)
    dt = torch.empty(batch, D, length, **meta)  # the wrapper's discretised Δ is float32
    A = torch.empty(D, N, dtype=dtype, **meta)
    if hf_layout:
        xp = torch.empty(batch, length, 96 + 2 * N, dtype=dtype, **meta).transpose(1, 2)
        B, C = xp[:, 96:96 + N], xp[:, 96 + N:]
    else:
        B = torch.empty(batch, N, length, dtype=dtype, **meta)
        C = torch.empty(batch, N, length, dtype=dtype, **meta)
    chunk = ss._chunk_for(length, ss.DEFAULT_CHUNK)
    flags = itertools.product((True, False), (False, True)) if length > 1 else [(True, False)]  # decode: h0, no grad
    for has_h0, store_ckpt in flags:
        h0 = torch.empty(batch, D, N, dtype=dtype, **meta) if has_h0 else None
        fwd.what = f"fwd D={D} N={N} {dtype} T={length} h0={has_h0} ckpt={store_ckpt}"
        _, _, ckpt = ss._scan_forward(u, dt, A, B, C, h0, chunk, None, store_ckpt)
        if store_ckpt and has_h0:
            for dy, dhT in ((torch.empty(batch, D, length, **meta), torch.empty(batch, D, N, **meta)),
                            (torch.zeros((), **meta).expand(batch, D, length), None)):
                bwd.what = f"bwd D={D} N={N} {dtype} T={length} dhT={dhT is not None}"
                ss._scan_backward(u, dt, A, B, C, ckpt, dy, dhT, chunk, None)

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
blocks, spills = set(), []
with tempfile.TemporaryDirectory() as tmp:
    for n, (fn, signature, constexprs, attrs, num_warps, what) in enumerate(launches.values()):
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["cubin"]
        assert cubin, what
        blocks.add((fn.__name__, constexprs["BLOCK_D"], constexprs["BLOCK_N"], num_warps))
        if os.path.exists(cuobjdump):
            path = os.path.join(tmp, f"{n}.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
            usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                                   check=True).stdout
            # spilled registers live in the stack frame (STACK); the kernels have no local arrays
            regs, stack, local = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("REG", "STACK", "LOCAL"))
            print(f"{what} CHUNK={constexprs['CHUNK']} warps={num_warps}: {regs} registers, stack {stack} B, "
                  f"local {local} B")
            if stack or local:
                spills.append(f"{what}: stack {stack} B, local {local} B (register spills)")
print("blocks", sorted(blocks))
print("spills" if spills else "compiled", len(launches), "\n".join(spills))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests run the compiled kernels")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts code the compiler rejects: compile (not run) the wrapper's launches for an H100.

    D = 1536 / 5120 with N = 16 and D = 1536 with N = 5 (padded to 8); fp32 and bf16 inputs; forward with and
    without initial state and checkpoints, decode (T = 1), backward with and without dh_T; no register spills.
    """
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton ships no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the wrapper's choices for these shapes: [32, 16] and [64, 8] state tiles, 4 warps, both kernels
    blocks = [(kernel, *tile, 4) for kernel in ("_scan_bwd_kernel", "_scan_fwd_kernel") for tile in ((32, 16), (64, 8))]
    assert f"blocks {blocks}" in done.stdout, done.stdout[-3000:]
    assert "\ncompiled " in done.stdout, done.stdout[-3000:]
