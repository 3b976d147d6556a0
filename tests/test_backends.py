"""Backend choice, the compiled CPU scan, the references against scalar loops, and the plugin's results
under every backend."""

import logging
import math

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.ops import backends, causal_conv1d_ref, selective_scan_ref, ssd_scan_ref
from hf_statecompose.ops.selective_scan import compiled

from helpers import random_ids, relative_error, tiny_model


# ------------------------------------------------------------------ references vs scalar loops written here
def test_ssd_reference_is_the_plain_recurrence():
    g = torch.Generator().manual_seed(5)
    batch, length, heads, head_dim, groups, state = 1, 5, 2, 2, 2, 3
    x = torch.randn(batch, length, heads, head_dim, generator=g, dtype=torch.float64)
    dt = torch.rand(batch, length, heads, generator=g, dtype=torch.float64)
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 2
    B = torch.randn(batch, length, groups, state, generator=g, dtype=torch.float64)
    C = torch.randn(batch, length, groups, state, generator=g, dtype=torch.float64)
    D = torch.randn(heads, generator=g, dtype=torch.float64)
    h0 = torch.randn(batch, heads, head_dim, state, generator=g, dtype=torch.float64)
    y, h, dsum = ssd_scan_ref(x, dt, A, B, C, D=D, initial_state=h0)
    for hd in range(heads):
        grp = hd // (heads // groups)
        for p in range(head_dim):
            s = [float(h0[0, hd, p, n]) for n in range(state)]
            for t in range(length):
                a = math.exp(float(dt[0, t, hd]) * float(A[hd]))
                s = [
                    a * s[n] + float(dt[0, t, hd]) * float(x[0, t, hd, p]) * float(B[0, t, grp, n])
                    for n in range(state)
                ]
                out = sum(s[n] * float(C[0, t, grp, n]) for n in range(state)) + float(D[hd]) * float(x[0, t, hd, p])
                assert abs(out - float(y[0, t, hd, p])) < 1e-12
            assert all(abs(s[n] - float(h[0, hd, p, n])) < 1e-12 for n in range(state))
        assert abs(sum(float(dt[0, t, hd]) for t in range(length)) - float(dsum[0, hd])) < 1e-12


def test_conv_reference_is_the_plain_convolution():
    g = torch.Generator().manual_seed(6)
    channels, length, kernel = 3, 5, 4
    x = torch.randn(2, channels, length, generator=g, dtype=torch.float64)
    w = torch.randn(channels, kernel, generator=g, dtype=torch.float64)
    bias = torch.randn(channels, generator=g, dtype=torch.float64)
    window = torch.randn(2, channels, kernel, generator=g, dtype=torch.float64)
    mask = torch.ones(2, length, dtype=torch.float64)
    mask[1, :2] = 0  # row 1: two padding tokens on the left
    out, new_window = causal_conv1d_ref(x, w, bias, conv_state=window, mask=mask)
    for b in range(2):
        real = [t for t in range(length) if mask[b, t] == 1]
        seq = [
            [float(window[b, c, k]) for k in range(kernel)] + [float(x[b, c, t]) for t in real] for c in range(channels)
        ]
        for c in range(channels):
            for i, t in enumerate(real):
                # output at a real token: the last `kernel` entries of the sequence up to and including it
                expected = float(bias[c]) + sum(float(w[c, k]) * seq[c][i + 1 + k] for k in range(kernel))
                assert abs(expected - float(out[b, c, t])) < 1e-12
            assert [float(v) for v in new_window[b, c]] == seq[c][-kernel:]


# ------------------------------------------------------------------ backend choice
def test_auto_picks_torch_on_cpu_and_logs_once(caplog):
    backends._logged.clear()
    with caplog.at_level(logging.INFO, logger="hf_statecompose"):
        assert backends.resolve("auto", torch.device("cpu"), "selective_scan") == "torch"
        assert backends.resolve("auto", torch.device("cpu"), "selective_scan") == "torch"
    assert sum("backend='auto'" in r.getMessage() for r in caplog.records) == 1


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend"):
        backends.resolve("cuda", torch.device("cpu"), "ssd_scan")
    with pytest.raises(ValueError, match="unknown backend"):
        hsc.enable(tiny_model("mamba"), backend="fast")


def test_explicit_triton_on_cpu_without_interpreter_raises(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="backend='triton' cannot run selective_scan"):
        backends.selective_scan(
            *([torch.zeros(1, 2, 3)] * 2),
            torch.zeros(2, 4),
            torch.zeros(1, 4, 3),
            torch.zeros(1, 4, 3),
            backend="triton",
        )


def test_explicit_triton_without_triton_installed_raises(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_triton)
    monkeypatch.setattr("importlib.import_module", lambda name, *a: no_triton(name))
    with pytest.raises(RuntimeError, match="triton is not installed"):
        backends.resolve("triton", torch.device("cpu"), "ssd_scan")
    assert backends.resolve("auto", torch.device("cpu"), "ssd_scan") == "torch"


def test_model_backend_is_set_kept_and_restored():
    model = tiny_model("mamba")
    assert hsc.get_backend(model) == "auto"
    hsc.enable(model, backend="torch")
    assert hsc.get_backend(model) == "torch"
    hsc.enable(model)  # None keeps the current choice
    assert hsc.get_backend(model) == "torch"
    hsc.ComposableMambaCache.encode(model, random_ids(5), backend="auto")
    assert hsc.get_backend(model) == "torch"  # a per-call override does not stick


# ------------------------------------------------------------------ the compiled CPU scan
@pytest.mark.parametrize("batch,length", [(1, 100), (2, 70)])
def test_compiled_scan_matches_fp64_reference(batch, length):
    """Fresh random inputs, padding and an initial state; lengths not multiples of the block."""
    g = torch.Generator().manual_seed(batch * 1000 + length)
    D, N = 24, 16
    r = lambda *s: torch.randn(*s, generator=g)
    args = dict(
        u=r(batch, D, length),
        delta=r(batch, D, length),
        A=-torch.rand(D, N, generator=g) * 3,
        B=r(batch, N, length),
        C=r(batch, N, length),
        D=r(D),
        z=r(batch, D, length),
        delta_bias=r(D),
        delta_softplus=True,
        initial_state=r(batch, D, N),
        mask=torch.ones(batch, length),
    )
    args["mask"][-1, :5] = 0
    with torch.no_grad():
        assert compiled.applicable(args["u"], args["A"], args["initial_state"], length)
        actual = compiled.selective_scan_compiled(**args)
    expected = selective_scan_ref(**{k: v.double() if torch.is_tensor(v) else v for k, v in args.items()})
    for a, e in zip(actual, expected):
        assert a.dtype == torch.float32
        assert relative_error(a.double(), e) < 1e-5


def test_compiled_scan_is_skipped_when_autograd_needs_it():
    u = torch.zeros(1, 4, 100, requires_grad=True)
    assert not compiled.applicable(u, torch.zeros(4, 2), None, 100)
    assert not compiled.applicable(u.detach(), torch.zeros(4, 2), None, compiled.MIN_TOKENS - 1)
    assert not compiled.applicable(u.detach().double(), torch.zeros(4, 2), None, 100)


# ------------------------------------------------------------------ plugin results under every backend
def _tiny_backends():
    import importlib.util

    return ["torch"] + (["triton"] if importlib.util.find_spec("triton") is not None else [])


@pytest.mark.parametrize("backend", _tiny_backends())
def test_encode_and_generate_unchanged_by_backend(arch, backend):
    """Same states and same greedy tokens whichever backend runs the state-aware path."""
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(7)
    contexts = [random_ids(12, generator=g), random_ids(9, generator=g)]
    query = random_ids(4, generator=g)
    reference = [hsc.ComposableMambaCache.encode(model, c, backend="torch") for c in contexts]
    states = [hsc.ComposableMambaCache.encode(model, c, backend=backend) for c in contexts]
    for ref, got in zip(reference, states):
        for i in range(ref.num_layers):
            assert relative_error(got.ssm_states[i], ref.ssm_states[i]) < 1e-4
            assert relative_error(got.conv_states[i], ref.conv_states[i]) < 1e-5
            assert relative_error(got.delta_sums[i], ref.delta_sums[i]) < 1e-5
    hsc.set_backend(model, "torch")
    expected = model.generate(query, past_states=reference, max_new_tokens=5, do_sample=False)
    hsc.set_backend(model, backend)
    actual = model.generate(query, past_states=states, max_new_tokens=5, do_sample=False)
    assert torch.equal(actual, expected)


def test_encode_with_compiled_scan_matches_eager(monkeypatch):
    """A long Mamba-1 context (>= MIN_TOKENS) goes through the compiled scan; the eager scan agrees."""
    monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", "0")  # the native kernel would take precedence
    model = tiny_model("mamba")
    ids = random_ids(compiled.MIN_TOKENS + 9, generator=torch.Generator().manual_seed(8))
    calls = []
    real = compiled.selective_scan_compiled
    monkeypatch.setattr(compiled, "selective_scan_compiled", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fused = hsc.ComposableMambaCache.encode(model, ids, backend="torch")
    assert len(calls) == model.config.num_hidden_layers
    monkeypatch.setenv("HF_STATECOMPOSE_COMPILE", "0")
    with torch.no_grad():
        eager = hsc.ComposableMambaCache.encode(model, ids, backend="torch")
    for i in range(model.config.num_hidden_layers):
        assert relative_error(fused.ssm_states[i], eager.ssm_states[i]) < 1e-5


@pytest.mark.parametrize("method", ["soup", "weighted", "caso", "picaso_s", "picaso_r"])
def test_composer_matches_the_float64_reference_on_every_path(arch, method, monkeypatch):
    """StateComposer on every path that can run here (the native CPU kernel, the blockwise torch path with
    native kernels off, Triton where installed) against the reference composition in float64, every tensor:
    SSM states, conv windows (the method's policy), ΣΔ and the token count."""
    from hf_statecompose.ops.compose import compose_ssm_ref

    model = tiny_model(arch)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        states = [hsc.ComposableMambaCache.encode(model, random_ids(6 + k, batch=2, generator=g)) for k in range(3)]
    w = [0.5, 0.2, 0.3]
    kwargs = {"weights": w} if method == "weighted" else {}
    conv_w = {"soup": [1 / 3] * 3, "weighted": w, "caso": [0, 0, 1], "picaso_s": [1 / 3] * 3, "picaso_r": [1 / 3] * 3}[
        method
    ]
    delta_w = [1 / 3] * 3 if method == "soup" else w if method == "weighted" else [1, 1, 1]
    runs = {}
    for backend in _tiny_backends():
        runs[backend] = hsc.StateComposer(method, backend=backend, **kwargs).compose(states)
    monkeypatch.setenv("HF_STATECOMPOSE_NATIVE", "0")
    runs["torch, no native kernel"] = hsc.StateComposer(method, backend="torch", **kwargs).compose(states)
    for name, got in runs.items():
        for i in range(model.config.num_hidden_layers):
            ssm = compose_ssm_ref(
                [s.ssm_states[i].double() for s in states],
                torch.stack([s.delta_sums[i] for s in states]).double(),
                states[0].A[i].double(),
                method,
                weights=torch.tensor(w, dtype=torch.float64) if method == "weighted" else None,
            )
            conv = sum(c * s.conv_states[i].double() for c, s in zip(conv_w, states))
            delta = sum(c * s.delta_sums[i].double() for c, s in zip(delta_w, states))
            assert relative_error(got.ssm_states[i].double(), ssm) < 1e-5, (name, i)
            assert relative_error(got.conv_states[i].double(), conv) < 1e-6, (name, i)
            assert relative_error(got.delta_sums[i].double(), delta) < 1e-6, (name, i)
        assert got.num_tokens.tolist() == [21, 21], name
    with pytest.raises(ValueError, match="unknown backend"):
        hsc.StateComposer(method, backend="gpu")


# ------------------------------------------------------------------ composition: reference, fast paths, gradients
from hf_statecompose.ops.compose import MODEL_FREE_METHODS, compose_ssm_ref, compose_ssm_torch
from hf_statecompose.ops.compose import native as compose_native

# odd sizes: Mamba-1 rows of N = 5 and 21 elements (not multiples of the kernel's 16 lanes), Mamba-2 heads
# not a multiple of 16 either, batch 1 and 3
COMPOSE_SHAPES = {"mamba": [(3, 7, 5), (1, 4, 21)], "mamba2": [(3, 5, 2, 3), (1, 19, 3, 4)]}


def _compose_inputs(arch, shape, n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    states = [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for _ in range(n)]
    delta = (torch.rand(n, shape[0], shape[1], generator=g, dtype=torch.float64) * 4).to(dtype)
    delta[0, 0, 0] = 0.0  # a decay of exactly 1
    delta[-1, -1, -1] = 200.0  # a decay below float32's smallest number: exp underflows
    A = -torch.exp(torch.randn(shape[1:3] if arch == "mamba" else shape[1:2], generator=g, dtype=torch.float64)).to(
        dtype
    )
    weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    return states, delta, A, weights / weights.sum()


def _fold(states, log_decays, order):
    x = torch.zeros_like(states[0])
    for k in order:
        x = torch.exp(log_decays[k]) * x + states[k]
    return x


def test_compose_reference_is_the_mean_over_orders(arch):
    """compose_ssm_ref against the definitions written out here: CASO folds the states in list order,
    PICASO-S averages the fold over all n! orders, PICASO-R over the n rotations."""
    import itertools

    for shape in COMPOSE_SHAPES[arch]:
        for n in (1, 2, 3, 4):
            states, delta, A, weights = _compose_inputs(arch, shape, n, seed=n, dtype=torch.float64)
            log_decays = [
                delta[k][..., None] * A if arch == "mamba" else (delta[k] * A)[..., None, None] for k in range(n)
            ]
            perms = list(itertools.permutations(range(n)))
            rotations = [[(s + j) % n for j in range(n)] for s in range(n)]
            expected = {
                "soup": sum(states) / n,
                "weighted": sum(float(w) * x for w, x in zip(weights, states)),
                "caso": _fold(states, log_decays, range(n)),
                "picaso_s": sum(_fold(states, log_decays, p) for p in perms) / len(perms),
                "picaso_r": sum(_fold(states, log_decays, r) for r in rotations) / n,
            }
            for method, want in expected.items():
                got = compose_ssm_ref(states, delta, A, method, weights=weights if method == "weighted" else None)
                assert relative_error(got, want) < 1e-12, (method, shape, n)


def _fast_paths():
    # the Triton kernel has its own tests against a float64 oracle (test_triton_compose.py); in the CPU
    # interpreter it is too slow for this many shapes
    paths = {"torch": compose_ssm_torch}
    if compose_native.available():
        paths["native"] = compose_native.compose_ssm_native
    return paths


@pytest.mark.parametrize("method", MODEL_FREE_METHODS)
def test_fast_compose_paths_match_the_float64_reference(arch, method):
    """Every CPU fast path (blockwise torch, native kernel) on fresh float32 inputs
    against compose_ssm_ref on the same values in float64; n odd and even, odd shapes."""
    paths = _fast_paths()
    for shape in COMPOSE_SHAPES[arch]:
        for n in (1, 2, 3, 8, 17):
            states, delta, A, weights = _compose_inputs(arch, shape, n, seed=100 + n)
            w = weights if method == "weighted" else None
            want = compose_ssm_ref([s.double() for s in states], delta.double(), A.double(), method, weights=w)
            for name, fn in paths.items():
                got = fn(states, delta, A, method, weights=None if w is None else w.float())
                assert got.dtype == torch.float32 and got.shape == states[0].shape
                assert relative_error(got.double(), want) < 2e-6, (name, shape, n)


@pytest.mark.parametrize("method", MODEL_FREE_METHODS)
def test_torch_compose_gradients_match_the_reference(arch, method):
    """The blockwise torch path is differentiable: its gradients (states, ΣΔ, A, weights) equal those of
    the plain reference, in float64."""
    states, delta, A, weights = _compose_inputs(arch, COMPOSE_SHAPES[arch][0], 5, seed=7, dtype=torch.float64)
    delta = delta.clamp_max(10)  # keep every decay's gradient away from underflow
    g = torch.Generator().manual_seed(8)
    probe = torch.randn(states[0].shape, generator=g, dtype=torch.float64)
    grads = []
    for fn in (compose_ssm_ref, compose_ssm_torch):
        leaves = [t.clone().requires_grad_(True) for t in (*states, delta, A, weights)]
        out = fn(leaves[:5], leaves[5], leaves[6], method, weights=leaves[7] if method == "weighted" else None)
        used = [t for t in leaves if method == "weighted" or t is not leaves[7]]
        grads.append(torch.autograd.grad((out * probe).sum(), used, allow_unused=True))
    for ref, fast in zip(*grads):
        if ref is None:
            assert fast is None or fast.abs().max() == 0
        else:
            assert relative_error(fast, ref) < 1e-10
    if method not in ("soup", "weighted"):
        assert grads[0][5].abs().max() > 0  # the decays matter: the ΣΔ gradient is not vacuous


# ------------------------------------------------------------------ the native composition kernel, more inputs
@pytest.mark.skipif(not compose_native.available(), reason="no C compiler for the native kernel")
@pytest.mark.parametrize("method", MODEL_FREE_METHODS)
def test_native_compose_matches_the_float64_reference_on_extreme_decays(arch, method):
    """The native kernel (its decay-only exp, CASO as a fold in context order, PICASO-R folded backwards,
    one call for many layers) on fresh float32 inputs against compose_ssm_ref in float64: n = 1, 2, 10
    and 17, rows not a multiple of its 16 lanes, log decays from 0 down to far below float32's range
    (underflow), ΣΔ = 0 and ΣΔ = inf (a decay of exactly 0)."""
    g = torch.Generator().manual_seed(21)
    shapes = {"mamba": [(2, 3, 16), (1, 5, 7), (3, 2, 37)], "mamba2": [(2, 21, 3, 2), (1, 3, 5, 4)]}[arch]
    for shape in shapes:
        for n in (1, 2, 10, 17):
            states = [torch.randn(shape, generator=g) for _ in range(n)]
            # log decays ΣΔ·A spread over [-1e3, 0] on a log scale, so every magnitude is hit
            delta = (10 ** (torch.rand(n, shape[0], shape[1], generator=g) * 5 - 3)).float()
            delta[0, 0, 0] = 0.0
            delta[-1, -1, -1] = float("inf")
            A = -torch.exp(torch.randn(shape[1:3] if arch == "mamba" else shape[1:2], generator=g)).float()
            weights = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
            w = weights / weights.sum() if method == "weighted" else None
            want = compose_ssm_ref([s.double() for s in states], delta.double(), A.double(), method, weights=w)
            got = compose_native.compose_ssm_native(states, delta, A, method, weights=None if w is None else w.float())
            assert got.dtype == torch.float32 and got.shape == states[0].shape
            assert torch.isfinite(got).all()
            assert relative_error(got.double(), want) < 2e-6, (shape, n)


@pytest.mark.skipif(not compose_native.available(), reason="no C compiler for the native kernel")
def test_native_decay_exp_is_float32_accurate_everywhere():
    """The kernel's exp of log decays, read off CASO with two states (x = a_1 x_0 + x_1 with x_0 = 1,
    x_1 = 0 gives a_1 = exp(ΣΔ_1 A)) on a dense grid of log decays in [-104, 0]: within 2 ulp of float64's
    exp wherever the result is a normal float32, 0 <= result < 2^-126 below that, exactly 1 at 0 and
    exactly 0 for -inf."""
    x = -torch.linspace(0, 104, 200_001, dtype=torch.float64)
    x = torch.cat([x, -torch.logspace(-30, 2, 20_001, dtype=torch.float64), torch.tensor([0.0, -88.0, -87.3])])
    A = x.float()
    A = A[A < 0]  # A must be negative; 0 comes from ΣΔ = 0 below
    D = A.numel()
    states = [torch.ones(1, D, 1), torch.zeros(1, D, 1)]
    delta = torch.ones(2, 1, D)
    got = compose_native.compose_ssm_native(states, delta, A[:, None], "caso")[0, :, 0].double()
    want = torch.exp(A.double())
    normal = want >= 2.0**-126
    ulp = 2.0 ** (torch.floor(torch.log2(want[normal])) - 23)
    assert ((got[normal] - want[normal]).abs() / ulp).max() <= 2.0
    assert (got[~normal] >= 0).all() and (got[~normal] < 2.0**-126).all()
    one, zero = torch.ones(1, 1, 1), torch.zeros(1, 1, 1)
    decay_0 = compose_native.compose_ssm_native(
        [one, one, zero],
        torch.tensor([[[1.0]], [[0.0]], [[float("inf")]]]),
        torch.tensor([[-1.0]]),
        "caso",
    )  # x = a_1 a_2 x_0 + a_2 x_1 + x_2 with a_2 = exp(-inf) = 0
    assert decay_0.item() == 0.0
    decay_1 = compose_native.compose_ssm_native(
        [one, zero], torch.tensor([[[1.0]], [[0.0]]]), torch.tensor([[-3.0]]), "caso"
    )
    assert decay_1.item() == 1.0  # a_1 = exp(0 · A) = 1
