"""Fast torch ops vs their plain references, fp64 on fresh random inputs, values and gradients."""

import ctypes

import pytest
import torch
import torch.nn.functional as F

from hf_statecompose.ops import (
    causal_conv1d,
    causal_conv1d_ref,
    selective_scan,
    selective_scan_ref,
    ssd_scan,
    ssd_scan_ref,
)

LENGTHS = [1, 7, 63, 130]


def _left_mask(batch, length, pads):
    mask = torch.ones(batch, length, dtype=torch.float64)
    for b, p in enumerate(pads[:batch]):
        mask[b, : min(p, length - 1)] = 0
    return mask


def _mamba1_inputs(length, seed, dtype=torch.float64, batch=2, channels=5, state=4):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    return dict(
        u=r(batch, channels, length),
        delta=r(batch, channels, length),
        A=-torch.rand(channels, state, generator=g, dtype=dtype) * 4,
        B=r(batch, state, length),
        C=r(batch, state, length),
        D=r(channels),
        z=r(batch, channels, length),
        delta_bias=r(channels),
        delta_softplus=True,
        initial_state=r(batch, channels, state),
        mask=_left_mask(batch, length, [0, 3]),
    )


def _mamba2_inputs(length, seed, dtype=torch.float64, batch=2, heads=4, head_dim=3, groups=2, state=5):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    return dict(
        x=r(batch, length, heads, head_dim),
        dt=r(batch, length, heads),
        A=-torch.rand(heads, generator=g, dtype=dtype) * 4,
        B=r(batch, length, groups, state),
        C=r(batch, length, groups, state),
        D=r(heads),
        dt_bias=r(heads),
        dt_softplus=True,
        dt_limit=(0.0, 1.5),
        initial_state=r(batch, heads, head_dim, state),
        mask=_left_mask(batch, length, [2, 0]),
    )


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("chunk_size", [None, 1, 16])
def test_selective_scan_matches_reference(length, chunk_size):
    inputs = _mamba1_inputs(length, seed=length)
    expected = selective_scan_ref(**inputs)
    actual = selective_scan(**inputs, chunk_size=chunk_size, block_size=50)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_selective_scan_reference_is_the_plain_recurrence():
    """The reference against a scalar loop written out here, element by element."""
    inp = _mamba1_inputs(6, seed=3, batch=1, channels=2, state=3)
    y, h, dsum = selective_scan_ref(**inp)
    dt = F.softplus(inp["delta"] + inp["delta_bias"][None, :, None]) * inp["mask"][:, None, :]
    for d in range(2):
        state = inp["initial_state"][0, d].clone()
        for t in range(6):
            state = torch.exp(dt[0, d, t] * inp["A"][d]) * state + dt[0, d, t] * inp["B"][0, :, t] * inp["u"][0, d, t]
            out = (state * inp["C"][0, :, t]).sum() + inp["D"][d] * inp["u"][0, d, t]
            out = out * F.silu(inp["z"][0, d, t])
            assert abs(float(out - y[0, d, t])) < 1e-12
        torch.testing.assert_close(h[0, d], state)
        assert abs(float(dt[0, d].sum() - dsum[0, d])) < 1e-12


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_ssd_scan_matches_reference(length, chunk_size):
    inputs = _mamba2_inputs(length, seed=length)
    expected = ssd_scan_ref(**inputs)
    actual = ssd_scan(**inputs, chunk_size=chunk_size)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_padding_is_inert_in_both_scans():
    """A left-padded row equals the same row scanned without its padding."""
    inp = _mamba1_inputs(20, seed=5)
    y, h, dsum = selective_scan(**inp)
    trimmed = {
        k: (v[1:, ..., 3:] if torch.is_tensor(v) and v.dim() == 3 and k not in ("initial_state",) else v)
        for k, v in inp.items()
    }
    trimmed.update(initial_state=inp["initial_state"][1:], mask=None)
    y2, h2, dsum2 = selective_scan_ref(**trimmed)
    torch.testing.assert_close(h[1:], h2)
    torch.testing.assert_close(dsum[1:], dsum2)
    torch.testing.assert_close(y[1:, :, 3:], y2)

    inp = _mamba2_inputs(20, seed=6)
    y, h, dsum = ssd_scan(**inp, chunk_size=8)
    trimmed = {k: (v[:1, 2:] if torch.is_tensor(v) and k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    trimmed.update(initial_state=inp["initial_state"][:1], mask=None)
    y2, h2, dsum2 = ssd_scan_ref(**trimmed)
    torch.testing.assert_close(h[:1], h2)
    torch.testing.assert_close(dsum[:1], dsum2)


def _grads(fn, inputs, names):
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in names}
    out = fn(**{**inputs, **leaves})
    g = torch.Generator().manual_seed(0)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in out)
    return torch.autograd.grad(loss, [leaves[k] for k in names])


@pytest.mark.parametrize("length", [1, 7, 63])
def test_selective_scan_gradients_match_reference(length):
    inputs = _mamba1_inputs(length, seed=10 + length)
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state"]
    for a, e in zip(_grads(selective_scan, inputs, names), _grads(selective_scan_ref, inputs, names)):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


def test_selective_scan_training_backward_across_blocks_and_final_state_only():
    """The hand-written backward: state carried from block to block, and a loss on h_T alone (dy None)."""
    import functools

    inputs = _mamba1_inputs(13, seed=77)
    names = ["u", "delta", "A", "B", "C", "initial_state", "delta_bias"]
    blocked = functools.partial(selective_scan, block_size=5)
    for a, e in zip(_grads(blocked, inputs, names), _grads(selective_scan_ref, inputs, names)):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in names}
    final = [fn(**{**inputs, **leaves})[1].sum() for fn in (selective_scan, selective_scan_ref)]
    grads = [torch.autograd.grad(f, list(leaves.values()), allow_unused=True) for f in final]
    for leaf, a, e in zip(leaves.values(), *grads):  # C does not reach h_T: None or zeros
        torch.testing.assert_close(
            a if a is not None else torch.zeros_like(leaf),
            e if e is not None else torch.zeros_like(leaf),
            rtol=1e-9,
            atol=1e-9,
        )


@pytest.mark.parametrize("length", [1, 7, 63])
def test_ssd_scan_gradients_match_reference(length):
    inputs = _mamba2_inputs(length, seed=20 + length)
    names = ["x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state"]
    fast = lambda **kw: ssd_scan(**kw, chunk_size=16)
    for a, e in zip(_grads(fast, inputs, names), _grads(ssd_scan_ref, inputs, names)):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


def test_fp32_fast_paths_close_to_fp64_reference():
    inp64 = _mamba1_inputs(63, seed=1)
    inp32 = {k: (v.float() if torch.is_tensor(v) else v) for k, v in inp64.items()}
    for a, e in zip(selective_scan(**inp32), selective_scan_ref(**inp64)):
        assert a.dtype == torch.float32 and torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4)
    inp64 = _mamba2_inputs(63, seed=2)
    inp32 = {k: (v.float() if torch.is_tensor(v) else v) for k, v in inp64.items()}
    for a, e in zip(ssd_scan(**inp32), ssd_scan_ref(**inp64)):
        torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("length", [1, 2, 9])
def test_causal_conv_matches_reference(length):
    g = torch.Generator().manual_seed(length)
    x = torch.randn(3, 6, length, generator=g, dtype=torch.float64)
    w = torch.randn(6, 4, generator=g, dtype=torch.float64)
    b = torch.randn(6, generator=g, dtype=torch.float64)
    state = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)
    mask = _left_mask(3, length, [0, 1, 5])
    out, new = causal_conv1d(x, w, b, state, mask, "silu")
    out_ref, new_ref = causal_conv1d_ref(x, w, b, state, mask, "silu")
    torch.testing.assert_close(out * mask[:, None], out_ref * mask[:, None])
    torch.testing.assert_close(new, new_ref)
    # from an empty window without padding (the zero-padded conv fast path)
    out, new = causal_conv1d(x, w, b, None, None, "silu")
    out_ref, new_ref = causal_conv1d_ref(x, w, b, None, None, "silu")
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(new, new_ref)
    assert new.is_contiguous() and new.untyped_storage().nbytes() == new.numel() * new.element_size()


def test_scans_agree_with_transformers_own_torch_paths():
    """From a zero state, our scans equal the stock transformers torch implementations."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    inp = _mamba1_inputs(33, seed=4)
    y_stock, h_stock = mamba_selective_scan(
        inp["u"],
        inp["delta"],
        inp["A"],
        inp["B"],
        inp["C"],
        D=inp["D"],
        z=inp["z"],
        delta_bias=inp["delta_bias"],
        delta_softplus=True,
        return_last_state=True,
    )
    y, h, _ = selective_scan(**{**inp, "initial_state": None, "mask": None})
    # the stock path casts B to float32 internally, hence fp32-level tolerance
    torch.testing.assert_close(y, y_stock, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_stock, rtol=1e-5, atol=1e-5)

    inp = _mamba2_inputs(33, seed=5)
    y_stock, h_stock = mamba2_chunk_scan(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        chunk_size=16,
        D=inp["D"],
        dt_bias=inp["dt_bias"],
        initial_states=inp["initial_state"],
        dt_softplus=True,
        dt_limit=inp["dt_limit"],
        return_final_states=True,
    )
    y, h, _ = ssd_scan(**{**inp, "mask": None}, chunk_size=16)
    torch.testing.assert_close(y.float(), y_stock.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.float(), h_stock.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [64, 256])
def test_ssd_fp32_exponents_are_summed_directly(chunk_size):
    """With strong decays (|A| up to 24), exponents taken as differences of prefix sums lose ulp(|cum|):
    fp32 y drifted to 3e-6 relative at chunk 256. Summed directly, y and the state stay at fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    T, H, P, N = 256, 24, 8, 16
    x = torch.randn(1, T, H, P, generator=g)
    dt = torch.randn(1, T, H, generator=g) * 0.5 - 3
    A = -torch.arange(1, H + 1, dtype=torch.float32)
    B, C = torch.randn(1, T, 1, N, generator=g), torch.randn(1, T, 1, N, generator=g)
    y, h, _ = ssd_scan(x, dt, A, B, C, dt_softplus=True, chunk_size=chunk_size)
    y64, h64, _ = ssd_scan_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), dt_softplus=True)
    for a, e in ((y, y64), (h, h64)):
        assert float((a.double() - e).abs().max() / e.abs().max()) < 1e-6


# ------------------------------------------------------------- native C kernels (CPU inference, float32)
# They read tokens-first strided views, run channel blocks of 32 / 16 / 1 (the channel counts below hit all
# three), and fuse softplus, the clamp, the mask, ΣΔ, the skip and the gate: every combination is checked
# against the float64 references on fresh random inputs.
from hf_statecompose.ops import _native
from hf_statecompose.ops.conv import native as conv_native
from hf_statecompose.ops.selective_scan import native as scan_native
from hf_statecompose.ops.ssd import native as ssd_native


def _needs(result):
    if result is None:
        pytest.skip(f"native CPU kernels unavailable here: {_native.failure(scan_native.NAME) or 'turned off'}")
    return result


def _f32(inputs):
    return {k: (v.float() if torch.is_tensor(v) else v) for k, v in inputs.items()}


def _rel(a, e):
    return float((a.double() - e).abs().max() / e.abs().max().clamp_min(1e-30))


def _tokens_first(t):
    """The same values as a [B, X, T] view of a tokens-first tensor (the layout the mixers pass)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("length", [1, 7, 63, 130])
@pytest.mark.parametrize("channels", [5, 16, 37, 83])
def test_native_selective_scan_matches_fp64_reference(length, channels):
    for variant in range(4):
        with_state, with_mask = variant & 1, variant & 2
        inp = _mamba1_inputs(length, seed=100 * length + channels + variant, channels=channels, state=6)
        inp.update(initial_state=inp["initial_state"] if with_state else None, mask=inp["mask"] if with_mask else None)
        expected = selective_scan_ref(**inp)
        f32 = _f32(inp)
        if variant == 3:  # strided tokens-first views, as the Mamba-1 mixer passes them
            f32.update({k: _tokens_first(f32[k]) for k in ("u", "delta", "B", "C", "z")})
        actual = _needs(scan_native.selective_scan_native(**f32))
        for name, a, e in zip(("y", "state", "delta_sum"), actual, expected):
            assert a.dtype == torch.float32 and a.shape == e.shape
            assert _rel(a, e) < 2e-6, (name, variant, _rel(a, e))


def test_native_selective_scan_without_softplus_bias_skip_or_gate():
    inp = _mamba1_inputs(40, seed=9, channels=35)
    inp.update(delta=inp["delta"].abs(), delta_bias=None, delta_softplus=False, D=None, z=None)
    for a, e in zip(_needs(scan_native.selective_scan_native(**_f32(inp))), selective_scan_ref(**inp)):
        assert _rel(a, e) < 2e-6


@pytest.mark.parametrize("length", [1, 7, 63, 130])
@pytest.mark.parametrize("head_dim, state, groups", [(3, 5, 2), (16, 8, 1), (20, 9, 2), (64, 16, 4)])
def test_native_ssd_scan_matches_fp64_reference(length, head_dim, state, groups):
    for variant in range(4):
        with_state, with_mask = variant & 1, variant & 2
        inp = _mamba2_inputs(
            length, seed=100 * length + head_dim + variant, head_dim=head_dim, state=state, groups=groups
        )
        inp.update(initial_state=inp["initial_state"] if with_state else None, mask=inp["mask"] if with_mask else None)
        if variant == 2:
            inp.update(dt_limit=None, dt_bias=None, D=None)
        expected = ssd_scan_ref(**inp)
        f32 = _f32(inp)
        if variant == 3:  # x, B, C as split views of one [B, T, ·] buffer, as the Mamba-2 mixer passes them
            parts = [f32["x"].flatten(2), f32["B"].flatten(2), f32["C"].flatten(2)]
            buffer = torch.cat(parts + [torch.zeros_like(f32["dt"])], -1)
            x, B, C, _ = buffer.split([p.shape[-1] for p in parts] + [f32["dt"].shape[-1]], -1)
            f32.update(x=x.view_as(f32["x"]), B=B.view_as(f32["B"]), C=C.view_as(f32["C"]))
            assert not f32["x"].is_contiguous()
        actual = _needs(ssd_native.ssd_scan_native(**f32))
        for name, a, e in zip(("y", "state", "delta_sum"), actual, expected):
            assert a.dtype == torch.float32 and a.shape == e.shape
            assert _rel(a, e) < 2e-6, (name, variant, _rel(a, e))


@pytest.mark.parametrize("length", [1, 2, 3, 5, 9, 40])
@pytest.mark.parametrize("channels", [3, 16, 37])
def test_native_conv_matches_reference(length, channels):
    g = torch.Generator().manual_seed(10 * length + channels)
    for variant in range(8):
        with_state, with_mask, activation = variant & 1, variant & 2, "silu" if variant & 4 else None
        x = torch.randn(3, channels, length, generator=g, dtype=torch.float64)
        w = torch.randn(channels, 4, generator=g, dtype=torch.float64)
        b = torch.randn(channels, generator=g, dtype=torch.float64)
        state = torch.randn(3, channels, 4, generator=g, dtype=torch.float64) if with_state else None
        mask = _left_mask(3, length, [0, 1, 5]) if with_mask else None
        out_ref, new_ref = causal_conv1d_ref(x, w, b, state, mask, activation)
        x32 = _tokens_first(x.float()) if variant % 2 else x.float()
        out, new = _needs(
            conv_native.causal_conv1d_native(
                x32, w.float(), b.float(), None if state is None else state.float(), mask, activation
            )
        )
        keep = mask[:, None] if mask is not None else 1.0
        assert _rel(out * keep, out_ref * keep) < 1e-6 and _rel(new, new_ref) < 1e-6, variant
        assert new.is_contiguous()


def test_native_math_matches_float64_over_the_whole_range():
    """exp / softplus / silu of the kernels (branch-free, vectorised) against float64, from deep underflow
    (denormal results, then 0) to overflow (inf), and at softplus' threshold (20)."""
    lib = _native.load(
        "test_math",
        _native.MATH
        + r"""
        void run(const float* x, float* e, float* s, float* l, long n) {
            for (long i = 0; i < n; i++) { e[i] = hsc_exp(x[i]); s[i] = hsc_softplus(x[i]); l[i] = hsc_silu(x[i]); }
        }""",
    )
    if lib is None:
        pytest.skip(f"no native kernels here: {_native.failure('test_math')}")
    x = torch.cat(
        [
            torch.linspace(-110, 95, 20001),
            torch.tensor([-87.5, -87.3, 0.0, 1e-8, -1e-8, 19.99, 20.0, 20.01, 88.7, 88.8]),
        ]
    )
    outs = [torch.empty_like(x) for _ in range(3)]
    lib.run(*(ctypes.c_void_p(t.data_ptr()) for t in (x, *outs)), ctypes.c_long(x.numel()))
    x64 = x.double()
    for got, want, name in zip(outs, (torch.exp(x64), F.softplus(x64), F.silu(x64)), ("exp", "softplus", "silu")):
        want32 = want.float()  # the best float32 answer, inf where float64 overflows float32
        # relative error down to 1e-30 (silu below that goes through a denormal exp(-|x|): absolute only)
        finite = torch.isfinite(want32) & (want32.abs() > 1e-30)
        assert torch.equal(torch.isinf(got), torch.isinf(want32)), name
        rel = ((got.double() - want).abs() / want.abs())[finite].max()
        assert rel < 3e-7, (name, float(rel))
        tiny = ~finite & torch.isfinite(want32)
        assert (
            float(torch.cat([(got.double() - want).abs()[tiny], torch.zeros(1, dtype=torch.float64)]).max()) < 1e-36
        ), name


def test_native_kernels_are_used_for_float32_inference_and_agree_with_the_torch_paths(monkeypatch):
    """backend='torch' dispatches float32 no-grad calls to the native kernels; with HF_STATECOMPOSE_NATIVE=0
    the torch paths run and give the same results (float32 rounding)."""
    from hf_statecompose.ops import backends

    inp1 = _f32(_mamba1_inputs(70, seed=3, channels=40))
    inp2 = _f32(_mamba2_inputs(70, seed=4, head_dim=16))
    calls = []
    for module, name in (
        (scan_native, "selective_scan_native"),
        (ssd_native, "ssd_scan_native"),
        (conv_native, "causal_conv1d_native"),
    ):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    conv_args = (
        inp1["u"],
        inp1["u"][0, :, :4].clone(),
        inp1["D"],
        inp1["initial_state"][..., :4].contiguous(),
        inp1["mask"],
        "silu",
    )
    with torch.no_grad():
        fast = [
            backends.selective_scan(**inp1, backend="torch"),
            backends.ssd_scan(**inp2, backend="torch"),
            backends.causal_conv1d(*conv_args, backend="torch"),
        ]
        if calls != ["selective_scan_native", "ssd_scan_native", "causal_conv1d_native"]:
            _needs(None)
        monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", "0")
        slow = [
            backends.selective_scan(**inp1, backend="torch"),
            backends.ssd_scan(**inp2, backend="torch"),
            backends.causal_conv1d(*conv_args, backend="torch"),
        ]
    assert len(calls) == 3
    mask = inp1["mask"][:, None]
    fast[2], slow[2] = (fast[2][0] * mask, fast[2][1]), (slow[2][0] * mask, slow[2][1])
    for f, s in zip(fast, slow):
        for a, e in zip(f, s):
            assert _rel(a, e.double()) < 1e-5


def test_native_build_failure_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    """No compiler (or a failing build): load returns None once, logs why, and the torch path runs."""
    monkeypatch.setenv("HF_STATECOMPOSE_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(_native, "_compiler", lambda: None)
    monkeypatch.setattr(_native, "_failed", {})
    monkeypatch.setattr(_native, "_loaded", {})
    with caplog.at_level("WARNING", logger="hf_statecompose"):
        assert scan_native.selective_scan_native(**_f32(_mamba1_inputs(5, seed=1))) is None
    assert "no C compiler" in caplog.text and "no C compiler" in _native.failure(scan_native.NAME)
    assert not scan_native.applicable(**_f32(_mamba1_inputs(5, seed=1)))
    from hf_statecompose.ops import backends

    inp = _mamba1_inputs(9, seed=2)
    with torch.no_grad():
        got = backends.selective_scan(**_f32(inp), backend="torch")
    for a, e in zip(got, selective_scan_ref(**inp)):
        assert _rel(a, e) < 1e-5
    assert list(tmp_path.iterdir()) == []


def test_native_library_is_cached_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_STATECOMPOSE_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(_native, "_failed", {})
    monkeypatch.setattr(_native, "_loaded", {})
    source = "int answer(void) { return 42; }"
    lib = _native.load("test_cache", source)
    if lib is None:
        pytest.skip(f"no native kernels here: {_native.failure('test_cache')}")
    assert lib.answer() == 42
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("test_cache-") and built[0].endswith(".so")
    monkeypatch.setattr(_native, "_loaded", {})  # a new process: the library is on disk, not built again
    commands = []
    real_run = _native.subprocess.run
    monkeypatch.setattr(_native.subprocess, "run", lambda cmd, *a, **k: commands.append(cmd) or real_run(cmd, *a, **k))
    assert _native.load("test_cache", source).answer() == 42
    assert all("--version" in cmd for cmd in commands) and sorted(p.name for p in tmp_path.iterdir()) == built


@pytest.mark.parametrize("width, groups", [(48, 1), (40, 2), (7, 1)])
def test_native_gated_rms_norm_matches_the_transformers_module_in_float64(width, groups):
    from transformers.models.mamba2 import modeling_mamba2

    # transformers 5.25 renamed the module MambaRMSNormGated -> Mamba2RMSNormGated (same attributes and forward)
    gated_norm = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
    g = torch.Generator().manual_seed(width)
    norm = gated_norm(width, group_size=width // groups, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=g))
    y = torch.randn(2, 5, width, generator=g) * 3
    projected = torch.randn(2, 5, width + 9, generator=g)
    gate = projected[..., 4 : 4 + width]  # a strided view, as the mixer passes it
    with torch.no_grad():
        got = ssd_native.gated_rms_norm_native(norm, y, gate)
        if got is None:
            _needs(None)
        expected = norm.double()(y.double(), gate.double())
    assert got.shape == y.shape and got.dtype == torch.float32
    assert _rel(got, expected) < 2e-6
    # anything else is left to the module: autograd, other dtypes
    assert ssd_native.gated_rms_norm_native(norm.float(), y.double(), gate.double()) is None
    assert ssd_native.gated_rms_norm_native(norm.float(), y.requires_grad_(), gate) is None
