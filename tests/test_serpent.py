"""SeRpEnt-Mamba (``serpent_mamba``): config, compression, the block against the token-by-token reference,
cache row operations, the fingerprint, gradients, Auto registration and the Hub (trust_remote_code) round trip.
Tiny configs throughout. (Causality, ragged batches, incremental == full, generate() and copies, as for COFFEE:
test_model_contract.py.)"""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import hf_statecompose as hsc
from hf_statecompose.models.serpent.modeling_serpent import SeRpEntMambaBlock, branch_ssm_config
from hf_statecompose.state.serpent_cache import CLOCK_BITS, ComposableSeRpEntCache

from architectures import serpent_lm

VOCAB = 61


tiny = serpent_lm  # the tiny model of tests/architectures.py (not enabled)


def ids_of(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def model():
    return tiny()


# ------------------------------------------------------------------------------------------ config
def test_config_defaults_and_for_model():
    config = AutoConfig.for_model("serpent_mamba", vocab_size=64, hidden_size=48, num_hidden_layers=2)
    assert isinstance(config, hsc.SeRpEntMambaConfig)
    assert config.branch_compressions == (1.0, 0.5, 0.1) and config.num_gaussians == 8
    assert config.resample_window == 5 and config.state_size == 16 and config.conv_kernel == 4
    assert config.intermediate_size == 96 and config.branch_hidden_size == 16 and config.branch_intermediate_size == 32
    assert config.branch_time_step_rank == 1
    default = hsc.SeRpEntMambaConfig()
    assert default.hidden_size % default.num_branches == 0 and default.intermediate_size % default.num_branches == 0
    again = hsc.SeRpEntMambaConfig.from_dict(config.to_dict())
    assert again.branch_compressions == config.branch_compressions and again.to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(branch_compressions=(1.0, 1.0, 0.5)), "branch_compressions"),
        (dict(branch_compressions=(1.0, 0.0, 0.5)), "branch_compressions"),
        (dict(branch_compressions=(1.0, 1.5, 0.5)), "branch_compressions"),
        (dict(branch_compressions=()), "branch_compressions"),
        (dict(hidden_size=50), "hidden_size"),
        (dict(intermediate_size=100), "intermediate_size"),
        (dict(num_gaussians=0), "num_gaussians"),
        (dict(resample_window=0), "resample_window"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    kwargs = dict(vocab_size=64, hidden_size=48, num_hidden_layers=2)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=field):
        hsc.SeRpEntMambaConfig(**kwargs)


def test_auto_classes_build_serpent_models():
    config = AutoConfig.for_model("serpent_mamba", vocab_size=64, hidden_size=48, num_hidden_layers=2)
    assert type(AutoModelForCausalLM.from_config(config)) is hsc.SeRpEntMambaForCausalLM
    assert type(AutoModel.from_config(config)) is hsc.SeRpEntMambaModel


def test_auto_registration_in_a_fresh_process_keeps_the_import_light():
    code = """
        import sys
        import hf_statecompose
        assert "torch" not in sys.modules
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.for_model("serpent_mamba", vocab_size=64, hidden_size=48, num_hidden_layers=2)
        print(type(AutoModelForCausalLM.from_config(config)).__name__)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "SeRpEntMambaForCausalLM" and "hook" not in done.stderr


def test_tied_and_untied_heads():
    tied = tiny()
    assert tied.lm_head.weight.data_ptr() == tied.backbone.embeddings.weight.data_ptr()
    untied = tiny(tie_word_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.backbone.embeddings.weight.data_ptr()


# ------------------------------------------------------------------------------------------ compression
def test_compressed_lengths_and_the_uncompressed_branch(model):
    ids = ids_of(2, 30)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache_params
    assert isinstance(cache, ComposableSeRpEntCache) and cache.num_layers == 2 * 3 and cache.is_filled()
    assert cache.num_tokens.tolist() == [30, 30]
    for v in range(cache.num_layers):
        kappa = model.config.branch_compressions[v % 3]
        grid_points = cache.clocks[v] >> CLOCK_BITS  # the compressed length L̄
        assert ((grid_points >= int(kappa * 30)) & (grid_points <= 30)).all()
        if kappa == 1.0:  # δ = 1 exactly: one grid point per token, each on the grid
            assert (cache.clocks[v] == 30 << CLOCK_BITS).all()
    assert cache.ssm_states[0].shape == (2, model.config.branch_intermediate_size, 4)
    assert cache.log_decay(1).shape == cache.ssm_states[1].shape


def reference_branch(branch, normed: torch.Tensor) -> torch.Tensor:
    """Branch b of one sequence, token by token in plain Python (eqs. 12–15 with the causal rules of the
    modeling module's docstring); the SSM is the stock transformers MambaMixer from a zero state."""
    length = normed.shape[0]
    delta = branch.time_steps(normed[None], torch.ones(1, length, dtype=torch.bool))[0]
    clock, grid, points = [], [], []
    for l in range(length):
        clock.append((clock[-1] if clock else 0) + round(float(delta[l]) * (1 << CLOCK_BITS)))
        grid.append(clock[l] >> CLOCK_BITS)
        if grid[l] > (grid[l - 1] if l else 0):  # token l creates grid point j = grid[l]
            j = grid[l]
            before = [k for k in range(l + 1) if clock[k] <= j << CLOCK_BITS][-branch.window :][::-1]  # latest first
            features = []
            for slot in range(branch.window):
                if slot < len(before):
                    k = before[slot]
                    d = branch.log_delta_bar.exp() * (j - clock[k] / (1 << CLOCK_BITS))
                    features += [normed[k], torch.exp(-((d - branch.gaussian_means) ** 2))]
                else:
                    features += [torch.zeros(normed.shape[1] + branch.gaussian_means.numel())]
            points.append(branch.resample_proj(torch.cat(features)))
    outputs = branch.ssm(torch.stack(points)[None])[0]  # ȳ, one per grid point
    return torch.stack([outputs[g - 1] if g else torch.zeros(branch.branch_hidden_size) for g in grid])


@pytest.mark.parametrize("compressions", [(1.0,), (1.0, 0.5, 0.3), (0.7, 0.25)])
def test_block_equals_the_token_by_token_reference(compressions):
    model = tiny(branch_compressions=compressions, num_hidden_layers=1, hidden_size=12)
    block = model.backbone.layers[0]
    with torch.no_grad():
        x = model.backbone.embeddings(ids_of(1, 13))
        normed = block.norm(x)[0]
        expected = x[0] + torch.cat([reference_branch(branch, normed) for branch in block.mixer.branches], -1)
        cache = ComposableSeRpEntCache._for_config(model.config, torch.float32)
        got = block(x, cache, torch.ones(1, 13, dtype=torch.bool))[0]
    assert rel(got, expected) < 1e-5
    if compressions == (1.0,):  # κ = 1: one grid point per token
        assert int(cache.clocks[0]) == 13 << CLOCK_BITS


# ------------------------------------------------------------------------------------------ cache objects
def test_cache_row_operations_keep_the_resampling_extras(model):
    ids = ids_of(3, 12)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache_params
        nxt = ids_of(3, 1, seed=5)
        expected = model(nxt, cache_params=copy.deepcopy(cache)).logits
        picked = cache.select([2, 0])
        assert torch.equal(picked.window_inputs[4], cache.window_inputs[4][[2, 0]])
        assert rel(model(nxt[[2, 0]], cache_params=picked).logits, expected[[2, 0]]) < 1e-6
        reordered = cache.clone()
        reordered.reorder_cache(torch.tensor([1, 1, 0]))
        assert rel(model(nxt[[1, 1, 0]], cache_params=reordered).logits, expected[[1, 1, 0]]) < 1e-6
        stacked = ComposableSeRpEntCache.stack([cache.select([0]), cache.select([1, 2])])
        assert rel(model(nxt, cache_params=stacked).logits, expected) < 1e-6
        repeated = cache.clone()
        repeated.batch_repeat_interleave(2)
        assert (
            rel(model(nxt.repeat_interleave(2, 0), cache_params=repeated).logits, expected.repeat_interleave(2, 0))
            < 1e-6
        )
    assert repr(cache).startswith("ComposableSeRpEntCache(")
    assert cache.fingerprint == hsc.model_fingerprint(model) and cache.architecture == "serpent_mamba"


def test_fingerprint_covers_the_resampling_weights(model):
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.backbone.layers[1].mixer.branches[2].gaussian_means[0] += 1
    assert hsc.model_fingerprint(other) != hsc.model_fingerprint(model)
    head_only = copy.deepcopy(model)
    head_only.config.tie_word_embeddings = False
    head_only.lm_head.weight = torch.nn.Parameter(head_only.lm_head.weight.detach() + 1)
    assert hsc.model_fingerprint(head_only) == hsc.model_fingerprint(model)


# ------------------------------------------------------------------------------------------ gradients
def test_gradients_reach_every_resampling_parameter():
    model = tiny().train()
    ids = ids_of(2, 16)
    loss = model(ids, labels=ids).loss
    loss.backward()
    for branch in (model.backbone.layers[0].mixer.branches[b] for b in range(3)):
        named = {
            "θ_Γ": branch.resample_proj.weight,
            "μ": branch.gaussian_means,
            "log Δ̄": branch.log_delta_bar,
            "SSM": branch.ssm.A_log,
        }
        if branch.delta_proj is not None:
            named["θ_Δ"] = branch.delta_proj.weight
        for name, parameter in named.items():
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
            assert parameter.grad.abs().sum() > 0, name


def test_gradcheck_of_a_block_in_float64(monkeypatch):
    """gradcheck of one block (a κ = 1 and a κ = 0.4 branch) w.r.t. its input and every resampling parameter.

    Two things are piecewise constant in δ and get straight-through gradients: the grid decisions (a
    floor) and the clock's fixed-point rounding, which the distances' values come from. The decisions:
    gradcheck perturbs by 1e-6, and the decisions of these inputs are checked to be the same at ±1e-6.
    The rounding: at the model's 2^-20 resolution a 1e-6 step moves the value in steps as large as the
    step itself, so this test runs the clock at 2^-40, where the straight-through gradient must match
    finite differences."""
    from hf_statecompose.models.serpent import modeling_serpent

    monkeypatch.setattr(modeling_serpent, "CLOCK_BITS", 40)
    monkeypatch.setattr(modeling_serpent, "CLOCK_ONE", 1 << 40)
    torch.manual_seed(0)
    config = hsc.SeRpEntMambaConfig(
        vocab_size=8,
        hidden_size=6,
        intermediate_size=6,
        num_hidden_layers=1,
        state_size=2,
        resample_window=2,
        num_gaussians=2,
        branch_compressions=(1.0, 0.4),
        residual_in_fp32=False,
    )
    block = SeRpEntMambaBlock(config, branch_ssm_config(config), 0).double()
    for branch in block.mixer.branches:
        torch.nn.init.uniform_(branch.gaussian_means, 0, 2)
    x = torch.randn(1, 5, 6, dtype=torch.float64, requires_grad=True)
    real = torch.ones(1, 5, dtype=torch.bool)
    compressed = block.mixer.branches[1]
    params = [
        compressed.delta_proj.weight,
        compressed.resample_proj.weight,
        compressed.gaussian_means,
        compressed.log_delta_bar,
        block.mixer.branches[0].gaussian_means,
    ]

    def run(x, *_):
        return block(x, ComposableSeRpEntCache._for_config(config, torch.float64), real)

    def grid_points(x):
        cache = ComposableSeRpEntCache._for_config(config, torch.float64)
        with torch.no_grad():
            block(x, cache, real)
        return [c >> 40 for c in cache.clocks]

    base = grid_points(x)
    for step in (1e-6, -1e-6):
        assert all(torch.equal(a, b) for a, b in zip(grid_points(x + step), base))
    assert 1 <= int(base[1]) < 5  # the compressed branch did compress
    assert torch.autograd.gradcheck(run, (x, *params), eps=1e-6, atol=1e-5, rtol=1e-4, fast_mode=True)


# ------------------------------------------------------------------------------------------ Hub form
def test_save_pretrained_and_trust_remote_code_in_a_fresh_process(tmp_path, model):
    folder = tmp_path / "serpent"
    model.save_pretrained(folder)
    names = set(os.listdir(folder))
    assert {"config.json", "modeling_serpent.py", "configuration_serpent.py"} <= names
    config = (folder / "config.json").read_text()
    assert '"AutoModelForCausalLM": "modeling_serpent.SeRpEntMambaForCausalLM"' in config
    assert '"AutoConfig": "configuration_serpent.SeRpEntMambaConfig"' in config
    ids = ids_of(2, 11)
    with torch.no_grad():
        expected = model(ids).logits
    save_file({"ids": ids, "logits": expected}, tmp_path / "expected.safetensors")
    code = f"""
        import sys, torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        assert "hf_statecompose" not in sys.modules
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        data = load_file({str(tmp_path / "expected.safetensors")!r})
        with torch.no_grad():
            assert torch.equal(model(data["ids"]).logits, data["logits"])
            out = model.generate(data["ids"], max_new_tokens=3, do_sample=False, pad_token_id=0)
        print("same", out.shape[1])
    """
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "same 14"

    # and in this process (hf_statecompose imported): plain from_pretrained gives the package's class
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is hsc.SeRpEntMambaForCausalLM
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)


def test_rows_without_a_new_grid_point_keep_their_branch_state_exactly(model):
    ids = ids_of(4, 9)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache_params
        before = copy.deepcopy(cache)
        assert all(torch.equal(a, b) for a, b in zip(before.window_inputs, cache.window_inputs))
        model(ids_of(4, 1, seed=9), cache_params=cache)
    checked = 0
    for v in range(cache.num_layers):
        idle = (cache.clocks[v] >> CLOCK_BITS) == (before.clocks[v] >> CLOCK_BITS)  # rows that made no grid point
        for name in ("ssm_states", "conv_states", "delta_sums", "last_outputs"):
            now, then = getattr(cache, name)[v], getattr(before, name)[v]
            assert torch.equal(now[idle], then[idle]), name
        checked += int(idle.sum())
    assert checked > 0  # the κ = 0.1 and 0.5 branches do skip tokens
