"""hsc.CoffeeMixer: the parallel (Newton + implicit backward) path against the sequential loop."""

import copy
import logging

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.models.coffee import mixer as coffee_mixer

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _trained(mixer, steps=5):
    """A few Adam steps on a toy target (running mean of the input), so the weights leave their init."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.Adam(mixer.parameters(), lr=0.1)
    for _ in range(steps):
        u = torch.randn(4, 32, mixer.hidden_size, generator=g, dtype=mixer.C.dtype)
        target = u.cumsum(1) / torch.arange(1, 33, dtype=u.dtype)[:, None]
        loss = (mixer(u, method="sequential") - target).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    mixer.zero_grad()
    return mixer


def _run(mixer, u, x0, method):
    mixer.zero_grad()
    u, x0 = u.clone().requires_grad_(), x0.clone().requires_grad_()
    y, final = mixer(u, x0, return_final_state=True, method=method)
    weights = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    ((y * weights).sum() + final.pow(2).sum()).backward()
    grads = {"u": u.grad, "initial_state": x0.grad}
    grads.update({name: p.grad.clone() for name, p in mixer.named_parameters()})
    mixer.zero_grad()
    return y.detach(), final.detach(), grads


def _close(actual, expected, rel, what):
    scale = expected.abs().max().clamp_min(torch.finfo(expected.dtype).tiny)
    err = (actual - expected).abs().max() / scale
    assert err <= rel, f"{what}: relative error {err:.3g} > {rel:g}"


def test_parameter_count_and_export():
    assert hsc.CoffeeMixer is coffee_mixer.CoffeeMixer
    mixer = hsc.CoffeeMixer(16, 8)
    assert sum(p.numel() for p in mixer.parameters()) == 384
    assert {name for name, _ in mixer.named_parameters()} == {"A", "C", "w_D"}
    assert sum(p.numel() for p in hsc.CoffeeMixer(16, 8, output_filter=True).parameters()) == 512


def test_stable_parametrisation():
    mixer = hsc.CoffeeMixer(4, 3, dtype=torch.float64)
    with torch.no_grad():
        mixer.A.copy_(torch.linspace(-40, 40, 12).view(4, 3))
    lam = mixer.eigenvalues
    # (-1, 0) in exact arithmetic; rounding may reach the ends, which still keep 0 <= 1 + λΔ <= 1
    assert ((lam >= -1) & (lam <= 0)).all()
    gate = torch.linspace(0, 1, 101, dtype=torch.float64)
    assert ((1 + lam[..., None] * gate >= 0) & (1 + lam[..., None] * gate <= 1)).all()
    moderate = lam[1:3]  # |μ| <= 18: strictly inside, every gate strictly contracting, never sign-flipping
    assert ((moderate > -1) & (moderate < 0)).all()
    assert ((1 + moderate[..., None] * gate[1:-1] > 0) & (1 + moderate[..., None] * gate[1:-1] < 1)).all()
    # the state stays within |x(-1)| + Σ|u| whatever the weights
    with torch.no_grad():
        mixer.w_D.mul_(50)
    u = 10 * torch.randn(2, 200, 4, dtype=torch.float64)
    _, final = mixer(u, return_final_state=True, method="sequential")
    assert (final.abs() <= u.abs().sum(1)[..., None] * (1 + 1e-12)).all()


def _errors(result, truth):
    """Normwise relative errors (max |difference| / max |truth|) of output, final state and every gradient."""
    pairs = {"output": (result[0], truth[0]), "final state": (result[1], truth[1])}
    pairs.update({f"grad {name}": (result[2][name], truth[2][name]) for name in truth[2]})
    return {
        what: ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()
        for what, (a, b) in pairs.items()
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("L", [1, 7, 255, 4096])
@pytest.mark.parametrize("trained", [False, True])
def test_parallel_matches_sequential(dtype, L, trained):
    """fp64: parallel == sequential within 1e-10. fp32: both are compared with the fp64 loop (the truth); the
    parallel path is within 1e-5 of it, or, where the fp32 loop itself is not (rounding amplified through
    4096 steps: up to ~2e-5 for grad u, measured), within twice the fp32 loop's own error."""
    torch.manual_seed(L)
    hidden, batch = (16, 2) if L < 4096 else (4, 1)
    mixer = hsc.CoffeeMixer(hidden, 8, dtype=dtype)
    if trained:
        _trained(mixer)
    u = torch.randn(batch, L, hidden, dtype=dtype)
    x0 = torch.randn(batch, hidden, 8, dtype=dtype)
    parallel = _run(mixer, u, x0, "parallel")
    info = mixer.last_solve
    assert info.method == "parallel" and 0 <= info.iterations <= L and info.residual <= info.tolerance
    sequential = _run(mixer, u, x0, "sequential")
    assert set(parallel[2]) == set(sequential[2]) == {"u", "initial_state", "A", "C", "w_D"}
    if dtype == torch.float64:
        for what, err in _errors(parallel, sequential).items():
            assert err <= 1e-10, f"{what}: relative error {err:.3g} > 1e-10"
        return
    mixer64 = copy.deepcopy(mixer).double()
    truth = _run(mixer64, u.double(), x0.double(), "sequential")
    loop_errors = _errors(sequential, truth)
    for what, err in _errors(parallel, truth).items():
        bound = max(1e-5, 2 * loop_errors[what])
        assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g} (fp32 loop: {loop_errors[what]:.3g})"


def test_output_filter_parallel_matches_sequential():
    torch.manual_seed(0)
    mixer = hsc.CoffeeMixer(6, 4, output_filter=True, dtype=torch.float64)
    u, x0 = torch.randn(2, 33, 6, dtype=torch.float64), torch.randn(2, 6, 4, dtype=torch.float64)
    y_p, final_p, grads_p = _run(mixer, u, x0, "parallel")
    y_s, final_s, grads_s = _run(mixer, u, x0, "sequential")
    _close(y_p, y_s, 1e-10, "output")
    _close(final_p, final_s, 1e-10, "final state")
    assert "w_gamma" in grads_s
    for name in grads_s:
        _close(grads_p[name], grads_s[name], 1e-10, f"grad {name}")


def test_default_initial_state_is_zero_and_auto_picks_the_path():
    torch.manual_seed(0)
    mixer = hsc.CoffeeMixer(3, 2)
    u = torch.randn(2, 9, 3)
    y = mixer(u, method="parallel")
    assert mixer.last_solve.method == "parallel" and mixer.last_iterations <= 9
    torch.testing.assert_close(y, mixer(u, torch.zeros(2, 3, 2), method="sequential"))
    torch.testing.assert_close(mixer(u), y)  # "auto" on the CPU: the loop
    assert mixer.last_solve.method == "sequential"
    assert coffee_mixer._auto_method(u) == "sequential"
    assert coffee_mixer._auto_method(torch.empty(1, 1, 3, device="meta")) == "parallel"


def test_gradcheck_parallel():
    torch.manual_seed(0)
    mixer = hsc.CoffeeMixer(3, 2, output_filter=True, dtype=torch.float64)
    with torch.no_grad():
        mixer.A.normal_()  # away from the init, so λ matters
    u = torch.randn(2, 6, 3, dtype=torch.float64, requires_grad=True)
    x0 = torch.randn(2, 3, 2, dtype=torch.float64, requires_grad=True)
    lam = mixer.eigenvalues.detach().requires_grad_()
    w = mixer.w_D.detach().clone().requires_grad_()

    def states(u, x0, lam, w):
        return coffee_mixer._CoffeeTrajectory.apply(u, x0, lam, w, mixer, None)

    assert torch.autograd.gradcheck(states, (u, x0, lam, w))

    def outputs(u, x0, A, C, w_D, w_gamma):
        return torch.func.functional_call(
            mixer, {"A": A, "C": C, "w_D": w_D, "w_gamma": w_gamma}, (u, x0), {"method": "parallel"}
        )

    params = [p.detach().clone().requires_grad_() for p in (mixer.A, mixer.C, mixer.w_D, mixer.w_gamma)]
    assert torch.autograd.gradcheck(outputs, (u, x0, *params))


def test_divergence_falls_back_to_sequential_and_warns_once(monkeypatch, caplog):
    torch.manual_seed(0)
    mixer = hsc.CoffeeMixer(4, 3)
    u, x0 = torch.randn(2, 20, 4), torch.randn(2, 4, 3)
    expected, expected_final, _grads_s = _run(mixer, u, x0, "sequential")

    def broken(a, b, initial_state=None):
        return torch.full_like(b, float("nan"))

    monkeypatch.setattr(coffee_mixer, "_solve_linear_recurrence", broken)
    with caplog.at_level(logging.WARNING, logger=coffee_mixer.__name__):
        y, final = mixer(u, x0, return_final_state=True, method="parallel")
        assert mixer.last_solve.method == "sequential (fallback)"
        mixer(u, x0, method="parallel")
    warnings = [r for r in caplog.records if "did not converge" in r.getMessage()]
    assert len(warnings) == 1
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(final, expected_final, rtol=0, atol=0)


def test_growth_falls_back(monkeypatch, caplog):
    torch.manual_seed(0)
    mixer = hsc.CoffeeMixer(4, 3)
    u = torch.randn(1, 10, 4)

    def huge(a, b, initial_state=None):
        return torch.full_like(b, 1e12)

    monkeypatch.setattr(coffee_mixer, "_solve_linear_recurrence", huge)
    with caplog.at_level(logging.WARNING, logger=coffee_mixer.__name__):
        y = mixer(u, method="parallel")
    assert mixer.last_solve.method == "sequential (fallback)"
    assert any("did not converge" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(y, mixer(u, method="sequential"), rtol=0, atol=0)


def test_bad_input_says_what():
    mixer = hsc.CoffeeMixer(4, 3)
    with pytest.raises(ValueError, match="hidden_size=4"):
        mixer(torch.randn(1, 5, 3))
    with pytest.raises(ValueError, match="initial_state"):
        mixer(torch.randn(1, 5, 4), torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="method"):
        mixer(torch.randn(1, 5, 4), method="scan")


def test_deepcopy_keeps_behaviour():
    torch.manual_seed(0)
    mixer = hsc.CoffeeMixer(4, 3)
    u = torch.randn(1, 12, 4)
    torch.testing.assert_close(copy.deepcopy(mixer)(u), mixer(u))


@pytest.mark.parametrize("gate", ["state", "input"])
def test_gates_and_mask_parallel_matches_sequential(gate):
    """The ablation gates (Table 6) and left padding: parallel == sequential (fp64, every gradient); a masked
    step leaves the state exactly as it was; the log-decay is Σ log(1 + λΔ) over the real steps only."""
    torch.manual_seed(1)
    mixer = hsc.CoffeeMixer(5, 3, gate=gate, dtype=torch.float64)
    _trained(mixer)
    u = torch.randn(3, 40, 5, dtype=torch.float64)
    x0 = torch.randn(3, 5, 3, dtype=torch.float64)
    mask = torch.ones(3, 40)
    mask[0, :7] = 0
    mask[2, :39] = 0
    results = {}
    for method in ("parallel", "sequential"):
        leaves = [u.clone().requires_grad_(), x0.clone().requires_grad_()]
        y, final, log_decay = mixer(leaves[0], leaves[1], method=method, mask=mask, return_log_decay=True)
        grads = torch.autograd.grad(
            (y * torch.linspace(-1, 1, 40, dtype=torch.float64)[:, None]).square().sum()
            + final.sum()
            + log_decay.sum(),
            leaves + list(mixer.parameters()),
        )
        results[method] = (y, final, log_decay, grads)
    for a, b in zip(results["parallel"][:3], results["sequential"][:3]):
        _close(a, b, 1e-10, "value")
    for a, b in zip(results["parallel"][3], results["sequential"][3]):
        _close(a, b, 1e-10, "grad")
    # row 0: 7 padding steps then 33 real ones == the 33 real ones alone
    _y0, f0, d0 = mixer(u[:1, 7:], x0[:1], method="sequential", return_log_decay=True)
    _close(results["sequential"][1][:1], f0, 1e-12, "masked final state")
    _close(results["sequential"][2][:1], d0, 1e-12, "masked log decay")
    assert (d0 < 0).all()


def test_linear_feedback_gate_and_bad_arguments():
    mixer = hsc.CoffeeMixer(2, 2, gate="linear_state", dtype=torch.float64)
    with torch.no_grad():
        mixer.w_D.fill_(0.1)
    u = 0.1 * torch.randn(1, 9, 2, dtype=torch.float64)
    _close(mixer(u, method="parallel"), mixer(u, method="sequential"), 1e-10, "linear feedback")
    with pytest.raises(ValueError, match="log-decay"):
        mixer(u, return_log_decay=True)
    with pytest.raises(ValueError, match="gate must be one of"):
        hsc.CoffeeMixer(2, 2, gate="softplus")
    with pytest.raises(ValueError, match="mask must be"):
        hsc.CoffeeMixer(2, 2)(torch.zeros(1, 3, 2), mask=torch.ones(1, 4))


def test_newton_windows():
    """The parallel forward over windows (here 16 steps, 100 steps in all, left padding across a window
    boundary) equals the loop; the info counts the windows and sums the iterations."""
    torch.manual_seed(2)
    mixer = _trained(hsc.CoffeeMixer(4, 3, dtype=torch.float64))
    mixer.newton_window = 16
    u, x0 = torch.randn(2, 100, 4, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    mask = torch.ones(2, 100)
    mask[1, :21] = 0
    y_p = final_p = grads_p = None
    for method in ("parallel", "sequential"):
        leaves = [u.clone().requires_grad_(), x0.clone().requires_grad_()]
        y, final = mixer(leaves[0], leaves[1], return_final_state=True, method=method, mask=mask)
        grads = torch.autograd.grad(y.square().sum() + final.sum(), leaves + list(mixer.parameters()))
        if method == "parallel":
            info = mixer.last_solve
            assert info.method == "parallel" and info.windows == 7 and 0 < info.iterations <= 100
            assert info.residual <= info.tolerance
            y_p, final_p, grads_p = y, final, grads
    _close(y_p, y, 1e-10, "output")
    _close(final_p, final, 1e-10, "final state")
    for a, b in zip(grads_p, grads):
        _close(a, b, 1e-10, "grad")


@pytest.fixture(scope="module")
def ih_model():
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return hsc.CoffeeForCausalLM.from_pretrained(os.path.join(root, "checkpoints", "coffee", "ih-coffee"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("L, batch", [(7, 8), (16, 64), (255, 2), (4096, 1)])
def test_parallel_matches_sequential_on_the_trained_induction_head_model(ih_model, dtype, L, batch):
    """The mixer of the shipped IH checkpoint (trained to >= 0.99 at L = 16, recipes/coffee.py) on the
    embeddings of fresh IH sequences of length L: parallel == sequential, values and every gradient. Its
    trained gates are steep and its embeddings large, so along these trajectories 38% of the step Jacobians
    exceed 1 in size: beyond one window Newton's scan blows up and the solver goes on with the clipped
    Jacobian (``last_solve.clipped``), still in parallel. The problem is then ill-conditioned: at L = 4096
    the fp32 loop's own output is 3e-5 and its grad u 2e-2 off the fp64 truth (and, by luck of the rounding,
    its grad of the initial state only 2e-6). fp64 holds to 1e-10; fp32 to max(1e-5, twice the fp32 loop's
    largest error), i.e. as accurate as the loop is."""
    from hf_statecompose.demo.induction_head import InductionHeadTask

    mixer = copy.deepcopy(ih_model.backbone.layers[0].mixer.ssm).to(dtype)
    ids = InductionHeadTask(seq_len=L).sample(batch, torch.Generator().manual_seed(5))["input_ids"]
    with torch.no_grad():
        u = ih_model.backbone.embeddings(ids).to(dtype)
    x0 = torch.zeros(batch, mixer.hidden_size, mixer.state_size, dtype=dtype)
    parallel = _run(mixer, u, x0, "parallel")
    info = mixer.last_solve
    assert info.method == "parallel" and info.iterations <= L and info.residual <= info.tolerance
    sequential = _run(mixer, u, x0, "sequential")
    if dtype == torch.float64:
        for what, err in _errors(parallel, sequential).items():
            assert err <= 1e-10, f"{what}: relative error {err:.3g} > 1e-10"
        return
    truth = _run(copy.deepcopy(mixer).double(), u.double(), x0.double(), "sequential")
    loop_errors = _errors(sequential, truth)
    bound = max(1e-5, 2 * max(loop_errors.values()))
    for what, err in _errors(parallel, truth).items():
        assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g} (fp32 loop: {loop_errors})"


def test_diverging_newton_goes_on_clipped_and_never_returns_a_wrong_trajectory(ih_model, caplog):
    """Back-to-back IH sequences (L = 512, far from the training distribution): Newton's scan overflows
    within a few iterations, the solve goes on with the clipped Jacobian and converges to the loop's
    trajectory."""
    from hf_statecompose.demo.induction_head import InductionHeadTask

    mixer = copy.deepcopy(ih_model.backbone.layers[0].mixer.ssm).double()
    ids = InductionHeadTask().sample(32, torch.Generator().manual_seed(5))["input_ids"].reshape(1, -1)
    with torch.no_grad():
        u = ih_model.backbone.embeddings(ids).double()
        y_p = mixer(u, method="parallel")
        info = mixer.last_solve
        y_s = mixer(u, method="sequential")
    assert info.method == "parallel" and info.clipped and info.residual <= info.tolerance
    _close(y_p, y_s, 1e-8, "clipped solve")
