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
                s = [a * s[n] + float(dt[0, t, hd]) * float(x[0, t, hd, p]) * float(B[0, t, grp, n]) for n in range(state)]
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
        seq = [[float(window[b, c, k]) for k in range(kernel)] + [float(x[b, c, t]) for t in real] for c in range(channels)]
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
        backends.selective_scan(*([torch.zeros(1, 2, 3)] * 2), torch.zeros(2, 4), torch.zeros(1, 4, 3),
                                torch.zeros(1, 4, 3), backend="triton")


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
    args = dict(u=r(batch, D, length), delta=r(batch, D, length), A=-torch.rand(D, N, generator=g) * 3,
                B=r(batch, N, length), C=r(batch, N, length), D=r(D), z=r(batch, D, length), delta_bias=r(D),
                delta_softplus=True, initial_state=r(batch, D, N), mask=torch.ones(batch, length))
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


@pytest.mark.parametrize("method", ["soup", "caso", "picaso_s", "picaso_r"])
def test_composer_same_result_on_every_backend(arch, method):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(11)
    states = [hsc.ComposableMambaCache.encode(model, random_ids(6 + k, generator=g)) for k in range(3)]
    expected = hsc.StateComposer(method, backend="torch").compose(states)
    for backend in _tiny_backends()[1:]:
        got = hsc.StateComposer(method, backend=backend).compose(states)
        for i in range(expected.num_layers):
            assert relative_error(got.ssm_states[i], expected.ssm_states[i]) < 1e-5
            assert torch.equal(got.conv_states[i], expected.conv_states[i])
    with pytest.raises(ValueError, match="unknown backend"):
        hsc.StateComposer(method, backend="gpu")
