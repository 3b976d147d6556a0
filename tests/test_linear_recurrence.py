"""Diagonal linear recurrence h_k = a_k h_{k-1} + b_k: torch (doubling scan) and Triton vs the plain loop.

Values, the whole trajectory and every gradient (a, b, initial state) on fresh random inputs: decays in
(0, 1), with exact zeros, moderately above 1 and negative; fp64 to 1e-10 and fp32 to 1e-5 (relative to
the largest entry); gradcheck / gradgradcheck in fp64; the Triton kernels in the interpreter (L <= 128,
fp32 and bf16) and compiled for sm_90 without register spills.
"""

import pytest
import torch

from hf_statecompose.ops import linear_recurrence, linear_recurrence_reference
from hf_statecompose.ops.linear_recurrence import linear_recurrence_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, CHANNELS = 2, 5
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def relative_error(actual, expected):
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def _inputs(length, decay, dtype, seed, channels=CHANNELS):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(BATCH, length, channels, generator=g, dtype=torch.float64)
    if decay == "unit":  # (0, 1), as exp(Δ A)
        a = u
    elif decay == "zeros":  # resets: exact zeros every few steps and a whole zero channel
        a = u * (torch.rand(BATCH, length, channels, generator=g, dtype=torch.float64) > 0.3)
        a[..., 0] = 0.0
    elif decay == "growing":  # slightly above 1: Π a ~ e^{L/200}, finite for L = 4096 in fp32
        a = 1.0 + u / 100.0
    elif decay == "negative":  # |a| < 1.2 with either sign
        a = 2.4 * u - 1.2
    else:
        raise ValueError(decay)
    b = torch.randn(BATCH, length, channels, generator=g, dtype=torch.float64)
    h0 = torch.randn(BATCH, channels, generator=g, dtype=torch.float64)
    dh = torch.randn(BATCH, length, channels, generator=g, dtype=torch.float64)
    return [t.to(DEVICE, dtype) for t in (a, b, h0)], dh.to(DEVICE)


def _value_and_grads(fn, a, b, h0, dh):
    leaves = [t.clone().requires_grad_(True) for t in (a, b, h0)]
    h = fn(*leaves)
    grads = torch.autograd.grad((h.double() * dh).sum(), leaves)
    return h, grads


def _check(fn, length, decay, dtype, seed, tol, channels=CHANNELS):
    (a, b, h0), dh = _inputs(length, decay, dtype, seed, channels)
    h, grads = _value_and_grads(fn, a, b, h0, dh)
    # the oracle: the plain loop in float64 on the same values
    h_ref, grads_ref = _value_and_grads(linear_recurrence_reference, a.double(), b.double(), h0.double(), dh)
    assert h.shape == (BATCH, length, channels) and h.dtype == dtype
    assert torch.isfinite(h).all()
    assert relative_error(h, h_ref) <= tol
    for name, grad, grad_ref, leaf in zip(("a", "b", "initial_state"), grads, grads_ref, (a, b, h0)):
        assert grad.dtype == leaf.dtype, name
        assert torch.isfinite(grad).all(), name
        assert relative_error(grad, grad_ref) <= tol, name


@pytest.mark.parametrize("decay", ["unit", "zeros", "growing", "negative"])
@pytest.mark.parametrize("length", [1, 7, 255, 4096])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_matches_reference(length, decay, dtype):
    _check(linear_recurrence_torch, length, decay, dtype, seed=length + len(decay), tol=TOL[dtype])


@pytest.mark.parametrize("length", [63, 64, 65, 129])  # around the chunk of the doubling scan
def test_torch_chunk_boundaries(length):
    _check(linear_recurrence_torch, length, "negative", torch.float64, seed=length, tol=1e-12)


def test_reference_is_the_recurrence():
    """The oracle itself, written out for three steps (a mutant of the loop fails this)."""
    a = torch.tensor([[[0.5], [0.0], [2.0]]], dtype=torch.float64)
    b = torch.tensor([[[1.0], [3.0], [-1.0]]], dtype=torch.float64)
    h = linear_recurrence_reference(a, b, torch.tensor([[4.0]], dtype=torch.float64))
    assert h.flatten().tolist() == [3.0, 3.0, 5.0]
    assert linear_recurrence_reference(a, b).flatten().tolist() == [1.0, 3.0, 5.0]


def test_gradcheck_and_double_backward():
    (a, b, h0), _ = _inputs(19, "negative", torch.float64, seed=3, channels=3)
    leaves = [t.requires_grad_(True) for t in (a, b, h0)]
    assert torch.autograd.gradcheck(linear_recurrence_torch, leaves)
    assert torch.autograd.gradgradcheck(linear_recurrence_torch, leaves)


def test_no_initial_state_means_zeros_and_half_precision_computes_in_float32():
    (a, b, h0), _ = _inputs(33, "unit", torch.float32, seed=4)
    assert torch.equal(
        linear_recurrence(a, b, backend="torch"), linear_recurrence(a, b, torch.zeros_like(h0), backend="torch")
    )
    h = linear_recurrence(a.bfloat16(), b.bfloat16(), h0, backend="torch")
    assert h.dtype == torch.bfloat16
    assert (
        relative_error(h, linear_recurrence_reference(a.bfloat16().double(), b.bfloat16().double(), h0.double()))
        <= 1e-2
    )
    assert linear_recurrence(a[:, :0], b[:, :0], h0, backend="torch").shape == (BATCH, 0, CHANNELS)


def test_backends_and_bad_inputs():
    (a, b, h0), _ = _inputs(9, "unit", torch.float64, seed=5)
    ref = linear_recurrence_reference(a, b, h0)
    for backend in ("auto", "torch", "reference"):
        assert relative_error(linear_recurrence(a, b, h0, backend=backend), ref) <= 1e-12, backend
    with pytest.raises(ValueError, match="unknown backend"):
        linear_recurrence(a, b, backend="loop")
    with pytest.raises(ValueError, match="one shape"):
        linear_recurrence(a, b[:, 1:])
    with pytest.raises(ValueError, match="initial_state"):
        linear_recurrence(a, b, h0[:, 1:])
    with pytest.raises(TypeError, match="floating"):
        linear_recurrence(a.long(), b)


# --------------------------------------------------------------------------------------------- Triton
# bf16: a, b and h are bf16 (h is also re-read by the backward): 2^-7 per rounding in the interpreter
TRITON_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length, decay, channels", [(1, "unit", 5), (7, "zeros", 37), (128, "negative", 300)])
def test_triton_matches_reference(length, decay, channels, dtype):
    pytest.importorskip("triton")
    from hf_statecompose.ops.linear_recurrence.triton_wrapper import linear_recurrence_triton

    _check(linear_recurrence_triton, length, decay, dtype, seed=7 * length, tol=TRITON_TOL[dtype], channels=channels)


def test_triton_backend_dispatch_and_errors():
    pytest.importorskip("triton")
    from hf_statecompose.ops.linear_recurrence.triton_wrapper import linear_recurrence_triton

    (a, b, h0), _ = _inputs(12, "unit", torch.float32, seed=8)
    h = linear_recurrence(a, b, h0, backend="triton")
    assert relative_error(h, linear_recurrence_reference(a.double(), b.double(), h0.double())) <= 1e-5
    assert torch.equal(linear_recurrence_triton(a, b), linear_recurrence_triton(a, b, torch.zeros_like(h0)))
    with pytest.raises(TypeError, match="float64"):
        linear_recurrence_triton(a.double(), b.double())


_COMPILE_FOR_SM90 = r"""
import os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_statecompose.ops._triton import bundled_kernels
bundled_kernels()  # registers hf_statecompose._kernels (loaded by path in a source checkout)
import hf_statecompose._kernels._linear_recurrence as lr

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
spills, n = [], 0
with tempfile.TemporaryDirectory() as tmp:
    for channels in (5, 128, 12288):  # every (BLOCK_C, num_warps) the wrapper picks: 32/1, 128/2, 256/4
        block_c, warps = lr._blocks(channels)
        for dtype in ("fp32", "bf16"):
            for fn in (lr._recurrence_fwd_kernel, lr._recurrence_bwd_kernel):
                # h0, dh and dh0 are float32 (the wrapper's); a, b, h, da, db have the input dtype
                signature = {a: "*fp32" if a in ("h0_ptr", "dh_ptr", "dh0_ptr") else
                             f"*{dtype}" if a.endswith("_ptr") else "i32" for a in fn.arg_names}
                signature["BLOCK_C"] = "constexpr"
                src = ASTSource(fn=fn, signature=signature, constexprs={"BLOCK_C": block_c})
                cubin = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"]
                assert cubin
                n += 1
                if os.path.exists(cuobjdump):
                    path = os.path.join(tmp, f"{n}.cubin")
                    with open(path, "wb") as f:
                        f.write(cubin)
                    usage = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True,
                                           text=True, check=True).stdout
                    stack, local = (int(re.search(rf"{k}:(\d+)", usage).group(1)) for k in ("STACK", "LOCAL"))
                    if stack or local:
                        spills.append(f"{fn.__name__} {dtype} BLOCK_C={block_c}: stack {stack}, local {local}")
print("spills" if spills else "compiled", n, "\n".join(spills))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests run the compiled kernels")
def test_triton_kernels_compile_for_sm90_without_spills():
    """The interpreter accepts code the compiler rejects: compile (not run) both kernels for an H100, for
    every block size and warp count the wrapper picks, fp32 and bf16 inputs; no register spills."""
    pytest.importorskip("triton")
    from helpers import compile_without_gpu

    out = compile_without_gpu(_COMPILE_FOR_SM90)
    assert "compiled 12" in out, out
