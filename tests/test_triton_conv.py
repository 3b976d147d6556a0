"""Triton causal conv1d (continuing a window, left padding) vs the plain reference: values, window, gradients."""

import pytest
import torch

triton = pytest.importorskip("triton")

from hf_statecompose.ops.conv import causal_conv1d, causal_conv1d_ref
from hf_statecompose.ops.conv.triton_wrapper import causal_conv1d_triton

from helpers import compile_without_gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, CHANNELS = 4, 6
# bf16: outputs and gradients are rounded to bf16: 2^-9 on a GPU, 2^-7 in the interpreter (its cast truncates)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def relative_error(actual, expected):
    actual, expected = actual.detach(), expected.detach()
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30))


def _left_mask(length):
    # rows: no padding, half padded, all but one token padded, fully padded
    mask = torch.ones(BATCH, length, dtype=torch.long)
    for row, pad in enumerate([0, length // 2, length - 1, length]):
        mask[row, :pad] = 0
    return mask


def _inputs(length, kernel, dtype, bias, state, mask, seed):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    return dict(
        x=rand(BATCH, CHANNELS, length),
        weight=rand(CHANNELS, kernel) * 0.5,
        bias=rand(CHANNELS) if bias else None,
        conv_state=rand(BATCH, CHANNELS, kernel) if state else None,
        mask=_left_mask(length).to(DEVICE) if mask else None,
    )


def _run(fn, inputs, activation, grads):
    """(out, window, gradients of x, weight, bias, conv_state) for the cotangents ``grads``."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items() if k != "mask" and v is not None}
    out, window = fn(**{**inputs, **leaves}, activation=activation)
    loss = (out.float() * grads[0]).sum() + (window.float() * grads[1]).sum()
    return out, window, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def _check(length, kernel, dtype, bias, state, mask, activation, seed):
    inputs = _inputs(length, kernel, dtype, bias, state, mask, seed)
    # the reference runs on the same values in float32
    ref_inputs = {k: (v.float() if v is not None and v.is_floating_point() else v) for k, v in inputs.items()}
    g = torch.Generator().manual_seed(seed + 1)
    cotangents = (
        torch.randn(BATCH, CHANNELS, length, generator=g).to(DEVICE),
        torch.randn(BATCH, CHANNELS, kernel, generator=g).to(DEVICE),
    )
    out, window, grads = _run(causal_conv1d_triton, inputs, activation, cotangents)
    out_ref, window_ref, grads_ref = _run(causal_conv1d_ref, ref_inputs, activation, cotangents)

    assert out.dtype == dtype and window.dtype == dtype
    assert out.shape == (BATCH, CHANNELS, length) and window.shape == (BATCH, CHANNELS, kernel)
    assert torch.isfinite(out).all()
    # padded outputs are 0 as in the reference, so the whole output (and its gradient) is compared
    assert relative_error(out, out_ref) <= TOL[dtype]
    assert torch.equal(window.float(), window_ref)  # the window is a copy of inputs: exact
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype, name
        assert relative_error(grad, grads_ref[name]) <= TOL[dtype], name


@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("length", [1, 3, 7, 63, 128])
def test_matches_reference_with_everything(length, kernel):
    _check(length, kernel, torch.float32, bias=True, state=True, mask=True, activation="silu", seed=length + kernel)


@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("length", [1, 3, 7, 63, 128])
def test_matches_reference_bare(length, kernel):
    """No bias, no initial window (zeros), no mask, no activation."""
    _check(length, kernel, torch.float32, bias=False, state=False, mask=False, activation=None, seed=10 * length)


@pytest.mark.parametrize(
    "length, bias, state, mask, activation",
    [(7, True, False, True, None), (63, False, True, False, "swish"), (3, False, True, True, "silu")],
)
def test_matches_reference_mixed_options(length, bias, state, mask, activation):
    _check(length, 4, torch.float32, bias, state, mask, activation, seed=100 + length)


@pytest.mark.parametrize("length", [3, 128])
def test_bfloat16_inputs_compute_in_float32(length):
    _check(length, 4, torch.bfloat16, bias=True, state=True, mask=True, activation="silu", seed=200 + length)


def test_agrees_with_vectorised_op_on_real_positions_and_strided_input():
    """Channels-last storage, as the Mamba mixers hold x ([B, T, 2C] transposed and chunked)."""
    g = torch.Generator().manual_seed(7)
    length, kernel = 37, 4
    projected = torch.randn(BATCH, length, 2 * CHANNELS, generator=g).to(DEVICE).transpose(1, 2)
    x = projected[:, :CHANNELS]
    assert not x.is_contiguous()
    weight = torch.randn(CHANNELS, kernel, generator=g).to(DEVICE)
    bias = torch.randn(CHANNELS, generator=g).to(DEVICE)
    state = torch.randn(BATCH, CHANNELS, kernel, generator=g).to(DEVICE)
    mask = _left_mask(length).to(DEVICE)
    out, window = causal_conv1d_triton(x, weight, bias, state, mask, "silu")
    out_vec, window_vec = causal_conv1d(x, weight, bias, state, mask, "silu")
    real = mask[:, None, :].bool()
    assert relative_error(out * real, out_vec * real) <= 1e-5
    assert torch.equal(window, window_vec)
    # the fully padded row keeps its window; the row with one real token shifts it by one
    assert torch.equal(window[3], state[3])
    assert torch.equal(window[2], torch.cat([state[2, :, 1:], x[2, :, -1:]], -1))


def test_bad_inputs_raise():
    x = torch.randn(2, 3, 5, device=DEVICE)
    w = torch.randn(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be"):
        causal_conv1d_triton(x, torch.randn(4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="conv window"):
        causal_conv1d_triton(x, w, conv_state=torch.randn(2, 3, 3, device=DEVICE))
    with pytest.raises(ValueError, match="mask"):
        causal_conv1d_triton(x, w, mask=torch.ones(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        causal_conv1d_triton(x, w, bias=torch.randn(4, device=DEVICE))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_triton(x, w, activation="relu")
    with pytest.raises(TypeError, match="float64"):
        causal_conv1d_triton(x.double(), w.double())


_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_statecompose.ops._triton import bundled_kernels
bundled_kernels()  # registers hf_statecompose._kernels (loaded by path in a source checkout)
import hf_statecompose._kernels._conv as conv
f32 = {"pad_ptr": "*i32", "dy_ptr": "*fp32", "dw_part_ptr": "*fp32", "db_part_ptr": "*fp32"}
for fn in (conv._conv_fwd_kernel, conv._conv_bwd_dy_kernel, conv._conv_bwd_dx_kernel):
    for kernel, silu in ((4, True), (3, False)):
        constexprs = {"K": kernel, "KP": 4, "HAS_BIAS": True, "SILU": silu, "BLOCK_C": 32, "BLOCK_T": 64}
        constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        signature = {a: "constexpr" if a in constexprs else f32.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                     for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        assert triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["cubin"]
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests run the compiled kernels")
def test_kernels_compile_for_sm90_without_a_gpu():
    """The interpreter accepts code the compiler rejects: compile (not run) the kernels for an H100."""
    compile_without_gpu(_COMPILE_FOR_SM90)
