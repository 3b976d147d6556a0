"""Triton chunked SSD scan vs the plain per-token reference: values, final state, ΣΔ and every gradient.

Without a GPU the kernels run in Triton's CPU interpreter (conftest sets TRITON_INTERPRET=1): lengths
stay <= 128 and widths small. Chunk sizes 16 / 24 / 32 make the lengths span several chunks plus a
partial one (24: a chunk that does not fill its power-of-two tile). Without a GPU, one more test compiles
(does not run) every kernel variant for an H100 (sm_90) at real Mamba-2 sizes and checks spills / shared memory.
"""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
from packaging.version import Version

triton = pytest.importorskip("triton")

from hf_statecompose.ops._triton import bundled_kernels
from hf_statecompose.ops.ssd import ssd_scan_ref
from hf_statecompose.ops.ssd.triton_wrapper import ssd_scan_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL_FP32 = 2e-5  # observed <= 2e-6 in the interpreter
TOL_BF16_GRAD = 1e-2  # gradients of bf16 leaves come back rounded to bf16 (2^-8)
GRAD_NAMES = ["x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state"]


def _rel(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max().clamp_min(1e-30)).item()


def _left_mask(batch, length):
    mask = torch.ones(batch, length)
    mask[0, : min(3, length - 1)] = 0  # row 0 left-padded, row 1 not
    return mask.to(DEVICE)


def _leaves(
    length,
    seed,
    dtype,
    groups,
    state,
    head_dim,
    heads=4,
    batch=2,
    init=True,
    dt_bias=True,
    D=True,
    dt_scale=1.0,
    A_scale=4.0,
):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    leaves = dict(
        x=r(batch, length, heads, head_dim).to(dtype),
        dt=(r(batch, length, heads) * dt_scale).to(dtype),
        A=-torch.rand(heads, generator=g) * A_scale - 0.1,
        B=r(batch, length, groups, state).to(dtype),
        C=r(batch, length, groups, state).to(dtype),
        D=r(heads) if D else None,
        dt_bias=r(heads) if dt_bias else None,
        initial_state=r(batch, heads, head_dim, state).to(dtype) if init else None,
    )
    weights = [r(batch, length, heads, head_dim), r(batch, heads, head_dim, state), r(batch, heads)]
    leaves = {k: (v.to(DEVICE).requires_grad_(True) if v is not None else None) for k, v in leaves.items()}
    return leaves, [w.to(DEVICE) for w in weights]


def _run(fn, leaves, weights, **kwargs):
    outputs = fn(**leaves, **kwargs)
    names = [k for k in GRAD_NAMES if leaves[k] is not None]
    loss = sum((o * w).sum() for o, w in zip(outputs, weights))
    grads = torch.autograd.grad(loss, [leaves[k] for k in names])
    return outputs, dict(zip(names, grads))


def _compare(
    length,
    chunk_size,
    dtype,
    groups,
    state,
    head_dim,
    init,
    mask,
    dt_limit,
    seed=0,
    noncontig=False,
    tol=TOL_FP32,
    grad_tol=None,
    **leaf_kw,
):
    leaves, weights = _leaves(length, seed + length, dtype, groups, state, head_dim, init=init, **leaf_kw)
    kwargs = dict(dt_softplus=True, dt_limit=dt_limit, mask=_left_mask(2, length) if mask else None)
    # the reference runs on the same (possibly bf16-rounded) values upcast to fp32
    ref_leaves = {k: (v.detach().float().requires_grad_(True) if v is not None else None) for k, v in leaves.items()}
    tri_leaves = dict(leaves)
    if noncontig:  # strided views: the wrapper must not assume contiguity
        tri_leaves["x"] = leaves["x"].transpose(1, 2).contiguous().transpose(1, 2)
        tri_leaves["B"] = leaves["B"].transpose(0, 1).contiguous().transpose(0, 1)
    expected, expected_grads = _run(ssd_scan_ref, ref_leaves, weights, **kwargs)
    actual, actual_grads = _run(ssd_scan_triton, tri_leaves, weights, chunk_size=chunk_size, **kwargs)
    for name, a, e in zip(["y", "final_state", "delta_sum"], actual, expected):
        assert a.dtype == torch.float32 and a.shape == e.shape, name
        assert torch.isfinite(a).all(), name
        assert _rel(a, e) < tol, f"{name}: rel err {_rel(a, e):.2e}"
    assert set(actual_grads) == set(expected_grads)
    for name, e in expected_grads.items():
        a = actual_grads[name]
        assert a.shape == e.shape and torch.isfinite(a).all(), name
        limit = grad_tol or (TOL_BF16_GRAD if leaves[name].dtype == torch.bfloat16 else tol)
        assert _rel(a, e) < limit, f"d{name}: rel err {_rel(a, e):.2e}"


# (length, chunk_size, groups, state N, head_dim P, initial_state, mask, dt_limit)
FP32_CASES = [
    (1, 16, 1, 16, 8, False, False, None),
    (7, 16, 2, 12, 16, True, True, (0.0, 1.5)),
    (63, 16, 2, 12, 8, True, False, (0.01, 0.5)),
    (63, 24, 2, 16, 8, True, True, None),
    (128, 32, 1, 16, 16, False, True, None),
    (128, 16, 2, 12, 8, True, True, (0.0, 1.5)),
]


@pytest.mark.parametrize("length,chunk_size,groups,state,head_dim,init,mask,dt_limit", FP32_CASES)
def test_ssd_triton_fp32_matches_reference(length, chunk_size, groups, state, head_dim, init, mask, dt_limit):
    _compare(
        length,
        chunk_size,
        torch.float32,
        groups,
        state,
        head_dim,
        init,
        mask,
        dt_limit,
        noncontig=(length == 7),
        D=(length != 1),
        dt_bias=(length != 1),
    )


BF16_CASES = [
    (7, 16, 2, 12, 8, True, True, (0.0, 1.5)),
    (63, 16, 2, 16, 8, False, False, None),
    (128, 32, 1, 12, 16, True, True, None),
]


@pytest.mark.parametrize("length,chunk_size,groups,state,head_dim,init,mask,dt_limit", BF16_CASES)
def test_ssd_triton_bf16_matches_reference(length, chunk_size, groups, state, head_dim, init, mask, dt_limit):
    _compare(length, chunk_size, torch.bfloat16, groups, state, head_dim, init, mask, dt_limit)


def test_ssd_triton_wide_state_and_head_dim():
    """N = 40, P = 36: the K loops run over two 32-wide slices, the second one masked (K1 = N in the forward
    and dxΔ passes, the C·B slices over K2 = N in the dC pass, K1 = P in the dC and dB passes)."""
    _compare(63, 32, torch.float32, 1, 40, 36, True, True, None, heads=2)
    _compare(40, 32, torch.bfloat16, 2, 40, 36, True, False, None, heads=2)


def test_ssd_triton_strong_decay_stays_finite_and_close():
    """Δ·A down to about -3000 per step: every exponent is of a non-positive number, nothing overflows.

    The only extra error is fp32 rounding of the chunk's cumulative log-decay (|cum| ~ 1e4 here), which
    the chunked torch op shares; the per-step reference has none.
    """
    _compare(63, 16, torch.float32, 2, 12, 8, True, True, None, dt_scale=30.0, A_scale=50.0, tol=2e-3, grad_tol=2e-3)


@pytest.mark.parametrize("block_cap", [None, 16])
def test_ssd_triton_fp32_exponents_are_summed_directly(block_cap, monkeypatch):
    """Strong decays (|A| up to 24): exponents taken as differences of prefix sums (cum_l - cum_s,
    cum_last - cum_s) lose ulp(|cum|) and put y ~9e-7 / the final state ~6e-7 off the fp64 reference
    here; summed directly (suffix sums, in-kernel segment sums) both stay at fp32 rounding (~1.3e-7 /
    ~6e-8, as the torch op). block_cap=16: four row / key blocks per chunk, so the off-diagonal blocks
    (with whole blocks in between) are summed too."""
    ssd = importlib.import_module(bundled_kernels().__name__ + "._ssd")
    monkeypatch.setattr(ssd, "_BLOCK_M_CAP", block_cap, raising=False)
    g = torch.Generator().manual_seed(0)
    T, H, P, N = 128, 4, 8, 16
    x = torch.randn(1, T, H, P, generator=g)
    dt = torch.randn(1, T, H, generator=g) * 0.5 - 3
    A = -torch.tensor([6.0, 12.0, 18.0, 24.0])
    B, C = torch.randn(1, T, 1, N, generator=g), torch.randn(1, T, 1, N, generator=g)
    y, h, _ = ssd_scan_triton(*(v.to(DEVICE) for v in (x, dt, A, B, C)), dt_softplus=True, chunk_size=64)
    y64, h64, _ = ssd_scan_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), dt_softplus=True)
    for name, a, e in (("y", y, y64), ("final_state", h, h64)):
        err = float((a.cpu().double() - e).abs().max() / e.abs().max())
        assert err < 3e-7, f"{name}: rel err {err:.2e} against fp64"


def test_ssd_triton_several_blocks_per_chunk(monkeypatch):
    """Row / key blocks of 16 in chunks of 64 (the interpreter's other tests have one block per chunk, as
    chunks of 256 have four on a GPU): off-diagonal decays, the blocks in between and the intra-chunk
    log-decay gradient carried across key blocks, forward and reverse, with every gradient."""
    ssd = importlib.import_module(bundled_kernels().__name__ + "._ssd")
    monkeypatch.setattr(ssd, "_BLOCK_M_CAP", 16, raising=False)
    _compare(100, 64, torch.float32, 2, 16, 8, True, True, None, heads=2, A_scale=0.2)


def test_ssd_triton_final_state_only_gradient():
    """Gradient through the final state alone (y unused, so C gets none): the backward chain and dh0."""
    leaves, _ = _leaves(40, 5, torch.float32, 2, 16, 8)
    ref_leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    names = ["x", "dt", "A", "B", "dt_bias", "initial_state"]
    grads = torch.autograd.grad(
        ssd_scan_triton(**leaves, dt_softplus=True, chunk_size=16)[1].square().sum(), [leaves[k] for k in names]
    )
    expected = torch.autograd.grad(
        ssd_scan_ref(**ref_leaves, dt_softplus=True)[1].square().sum(), [ref_leaves[k] for k in names]
    )
    for name, a, e in zip(names, grads, expected):
        assert _rel(a, e) < TOL_FP32, f"d{name}: rel err {_rel(a, e):.2e}"


def test_ssd_triton_empty_sequence():
    leaves, _ = _leaves(0, 1, torch.float32, 1, 16, 8)
    y, final, delta_sum = ssd_scan_triton(**leaves, dt_softplus=True)
    assert y.shape == (2, 0, 4, 8)
    torch.testing.assert_close(final, leaves["initial_state"].detach())
    assert (delta_sum == 0).all()


def test_ssd_triton_rejects_bad_inputs():
    leaves, _ = _leaves(5, 2, torch.float32, 2, 16, 8)
    leaves = {k: v.detach() for k, v in leaves.items()}
    with pytest.raises(ValueError, match="dt must be"):
        ssd_scan_triton(**{**leaves, "dt": leaves["dt"][:, :4]})
    with pytest.raises(ValueError, match="H % G"):
        ssd_scan_triton(**{**leaves, "B": leaves["B"][:, :, :1].expand(-1, -1, 3, -1)})
    with pytest.raises(ValueError, match="initial_state"):
        ssd_scan_triton(**{**leaves, "initial_state": leaves["initial_state"][..., :8]})
    with pytest.raises(ValueError, match="D must be"):
        ssd_scan_triton(**{**leaves, "D": leaves["D"][:2]})
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_scan_triton(**leaves, chunk_size=0)
    with pytest.raises(TypeError, match="float64"):
        ssd_scan_triton(**{**leaves, "x": leaves["x"].double()})


# Compile (not run) every kernel variant the wrapper launches for realistic Mamba-2 shapes, for an H100
# (sm_90), with Triton's bundled ptxas. The launches are recorded from the real wrapper (forward and
# backward through autograd, on CPU tensors that no kernel touches), so the constexprs, block sizes,
# num_warps, pointer types and the JIT's own specialisation of the integer arguments (== 1, % 16) are
# exactly those of a GPU run. ptxas -v reports registers and spills; the metadata the shared memory.
_COMPILE_SSD_FOR_SM90 = r"""
import contextlib, io, json, re
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from hf_statecompose.ops._triton import bundled_kernels
bundled_kernels()  # registers hf_statecompose._kernels (loaded by path in a source checkout)
import hf_statecompose._kernels._ssd as ssd
import hf_statecompose.ops.ssd.triton_wrapper as wrapper

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
# (label, heads H, head_dim P, state N, groups G, chunk_size, length T)
SHAPES = [("130m", 24, 64, 128, 1, 256, 300), ("2.7b", 80, 64, 128, 1, 64, 100), ("small", 4, 16, 16, 2, 64, 100)]
launches = []


class Record:  # kernel[grid](*args, **kwargs) records the launch instead of running it
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs, self.label))


for name in ("_chunk_state_kernel", "_state_passing_kernel", "_chunk_scan_kernel"):
    setattr(ssd, name, Record(getattr(ssd, name)))
wrapper.check_runnable = lambda *tensors: None  # CPU tensors are fine: nothing is launched

for label, H, P, N, G, chunk, T in SHAPES:
    for dtype in (torch.float32, torch.bfloat16):
        for init in (True, False):
            Record.label = f"{label} {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
            g = torch.Generator().manual_seed(0)
            leaves = [torch.randn(2, T, H, P, generator=g), torch.randn(2, T, H, generator=g),
                      torch.randn(2, T, G, N, generator=g), torch.randn(2, T, G, N, generator=g)]
            x, dt, B, C = [v.to(dtype).requires_grad_(True) for v in leaves]
            A = -torch.rand(H, generator=g).requires_grad_(True)
            h0 = torch.randn(2, H, P, N, generator=g).to(dtype).requires_grad_(True) if init else None
            y, final, _ = wrapper.ssd_scan_triton(x, dt, A, B, C, dt_softplus=True, initial_state=h0, chunk_size=chunk)
            torch.autograd.grad(y.sum() + final.sum(), [x, dt, A, B, C] + ([h0] if init else []))


def specialise(kernel, args, kwargs):
    # what JITFunction.run does before compiling (private API: a plain signature if it is missing)
    try:
        from triton.runtime.jit import create_function_from_signature
        bound, spec, opts = create_function_from_signature(kernel.signature, kernel.params, BACKEND)(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(BACKEND, kwargs, bound, spec, opts)
        return signature, constexprs, attrs, options.__dict__
    except (ImportError, AttributeError):
        values = dict(zip(kernel.arg_names, args), **kwargs)
        dtypes = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
        names = [p.name for p in kernel.params if p.is_constexpr]
        signature = {a: "constexpr" if a in names else dtypes[values[a].dtype] if torch.is_tensor(values[a])
                     else "i32" for a in kernel.arg_names}
        options = {k: v for k, v in kwargs.items() if k not in kernel.arg_names}
        return signature, {a: values[a] for a in names}, None, options


seen = set()
for kernel, args, kwargs, label in launches:
    signature, constexprs, attrs, options = specialise(kernel, args, kwargs)
    key = (kernel.__name__, repr(signature), repr(constexprs), repr(attrs), repr(sorted(options.items())))
    if key in seen:
        continue
    seen.add(key)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG=1 prints ptxas -v
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options)
    regs = re.search(r"Used (\d+) registers", log.getvalue())
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log.getvalue())
    names = kernel.arg_names
    print("VARIANT " + json.dumps(dict(
        kernel=kernel.__name__, shape=label, cubin=len(compiled.asm["cubin"]),
        constexprs={names[k[0]] if isinstance(k, tuple) else k: v for k, v in constexprs.items()
                    if (names[k[0]] if isinstance(k, tuple) else k).isupper()},
        pointers="".join(t[1] for t in signature.values() if t.startswith("*")),
        num_warps=compiled.metadata.num_warps, shared=compiled.metadata.shared,
        regs=int(regs.group(1)) if regs else None,
        spill_stores=int(spills.group(1)) if spills else None, spill_loads=int(spills.group(2)) if spills else None)))
print("compiled")
"""

SM90_MAX_SHARED = 232448  # bytes of shared memory one block may use on an H100 (227 KiB)
MAX_SPILL_BYTES = 64  # with triton 3.9 every variant spills 0 (the 64-wide K slices / 4 warps spilled up to 2.7 KB)


def _variant_table(variants):
    return "\n".join(
        f"{v['kernel']:24s} {v['shape']:10s} {json.dumps(v['constexprs'])} ptr={v['pointers']} warps={v['num_warps']} "
        f"smem={v['shared']} regs={v['regs']} spill={v['spill_stores']}/{v['spill_loads']}"
        for v in variants
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the other tests run the compiled kernels")
def test_ssd_kernels_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter accepts code the compiler rejects: compile every variant the wrapper launches for the
    130M (H=24, P=64, N=128, chunk 256) and 2.7B (H=80) shapes and a small one (P=N=16, G=2), forward and
    backward, fp32 and bf16 inputs, with / without initial state, for an H100; no spills, shared memory fits."""
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton ships no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # a fresh cache: ptxas runs (and reports registers and spills) for every variant
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_DUMP_PTXAS_LOG="1", TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SSD_FOR_SM90], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    variants = [json.loads(line[8:]) for line in done.stdout.splitlines() if line.startswith("VARIANT ")]
    table = _variant_table(variants)
    print(table)
    assert all(v["cubin"] > 0 for v in variants), table
    # every kernel and every pass was compiled, fp32 and bf16 inputs
    scan = {
        (v["constexprs"]["EPI"], v["constexprs"]["REVERSE"]) for v in variants if v["kernel"] == "_chunk_scan_kernel"
    }
    assert scan == {(0, False), (1, True), (2, False), (0, True)}, table
    state = {v["constexprs"]["FROM_START"] for v in variants if v["kernel"] == "_chunk_state_kernel"}
    passing = {
        (v["constexprs"]["HAS_START"], v["constexprs"]["REVERSE"])
        for v in variants
        if v["kernel"] == "_state_passing_kernel"
    }
    assert state == {False, True} and passing == {(True, False), (False, False), (True, True)}, table
    assert {v["shape"] for v in variants} == {f"{s} {d}" for s in ("130m", "2.7b", "small") for d in ("fp32", "bf16")}
    assert any("b" in v["pointers"] for v in variants), table
    # resources: shared memory within the H100 limit, no register spills (when ptxas reported them)
    assert all(v["shared"] <= SM90_MAX_SHARED for v in variants), table
    spilling = [v for v in variants if (v["spill_stores"] or 0) > MAX_SPILL_BYTES]
    if spilling and Version(triton.__version__).release < (3, 9):
        # the budget holds from triton 3.9 (the tests-newest torch 2.14.1 pins 3.8, torch 2.13's CUDA wheels 3.7.1):
        # every variant compiled and fits shared memory (checked above); the spills are reported, not failed
        pytest.skip(
            f"triton {triton.__version__}: every variant compiles for sm_90 and fits shared memory; the register-spill "
            f"budget ({MAX_SPILL_BYTES} B) holds from triton 3.9 only, here {len(spilling)} variants spill up to "
            f"{max(v['spill_stores'] for v in spilling)} B"
        )
    assert not spilling, "register spills:\n" + _variant_table(spilling)
