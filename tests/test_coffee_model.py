"""COFFEE models (``coffee``): config, Auto registration and the Hub (trust_remote_code) round trip, the paper's
parameter counts, the core head's distance logits, gradients, the image classifier. Tiny configs throughout.
(Causality, ragged batches, incremental == full, generate() and copies, as for SeRpEnt: test_model_contract.py.)"""

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification

import hf_statecompose as hsc
from hf_statecompose.models.coffee.modeling_coffee import distance_logits

from architectures import coffee_lm

VOCAB = 40


tiny = coffee_lm  # the tiny model of tests/architectures.py (not enabled)


def ids_of(batch: int, length: int, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ config
def test_config_defaults_and_for_model():
    config = AutoConfig.for_model("coffee", vocab_size=64, hidden_size=48, num_hidden_layers=2)
    assert isinstance(config, hsc.CoffeeConfig)
    assert config.state_size == 8 and config.expand == 2 and config.intermediate_size == 96
    assert config.mixer_type == "coffee" and config.gate == "state" and config.head == "lm"
    assert config.output_filter is False and config.tie_word_embeddings is True
    assert config.image_size == 25 and config.num_labels == 10 and config.classifier_hidden_size == 25
    assert config.layer_types == ["linear_attention"] * 2 and config.mixer_size == 96
    core = hsc.CoffeeConfig(head="core", vocab_size=8, hidden_size=16)
    assert core.num_hidden_layers == 1 and core.mixer_size == 16
    assert hsc.CoffeeConfig().num_hidden_layers == 4
    again = hsc.CoffeeConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(mixer_type="s4"), "mixer_type"),
        (dict(gate="tanh"), "gate"),
        (dict(head="mlp"), "head"),
        (dict(state_size=0), "state_size"),
        (dict(hidden_size=-3), "hidden_size"),
        (dict(expand=1.5), "expand"),
        (dict(image_size=0), "image_size"),
        (dict(classifier_hidden_size=True), "classifier_hidden_size"),
        (dict(head="core", num_hidden_layers=2), "num_hidden_layers"),
        (dict(output_filter="yes"), "output_filter"),
        (dict(layer_norm_epsilon=0.0), "layer_norm_epsilon"),
    ],
)
def test_bad_configs_name_the_field(overrides, field):
    kwargs = dict(vocab_size=64, hidden_size=48, num_hidden_layers=2)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=field):
        hsc.CoffeeConfig(**kwargs)


def test_auto_classes_build_coffee_models():
    config = AutoConfig.for_model("coffee", vocab_size=64, hidden_size=48, num_hidden_layers=2)
    assert type(AutoModelForCausalLM.from_config(config)) is hsc.CoffeeForCausalLM
    assert type(AutoModel.from_config(config)) is hsc.CoffeeModel
    assert type(AutoModelForImageClassification.from_config(config)) is hsc.CoffeeForImageClassification
    from hf_statecompose import models

    assert models.CoffeeForCausalLM is hsc.CoffeeForCausalLM and models.CoffeeConfig is hsc.CoffeeConfig


def test_auto_registration_in_a_fresh_process_keeps_the_import_light():
    code = """
        import sys
        import hf_statecompose
        assert "torch" not in sys.modules
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification
        config = AutoConfig.for_model("coffee", vocab_size=64, hidden_size=48, num_hidden_layers=2)
        print(type(AutoModelForCausalLM.from_config(config)).__name__,
              type(AutoModelForImageClassification.from_config(config)).__name__)
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "CoffeeForCausalLM CoffeeForImageClassification" and "hook" not in done.stderr


def test_tied_and_untied_heads():
    tied = tiny(tie_word_embeddings=True)
    assert tied.lm_head.weight.data_ptr() == tied.backbone.embeddings.weight.data_ptr()
    untied = tiny()
    assert untied.lm_head.weight.data_ptr() != untied.backbone.embeddings.weight.data_ptr()


# ------------------------------------------------------------------------------------------ the paper's models
def test_core_module_has_the_papers_parameter_count_and_orthonormal_embeddings():
    torch.manual_seed(0)
    model = hsc.CoffeeForCausalLM(hsc.CoffeeConfig(head="core", vocab_size=8, hidden_size=16, state_size=8))
    assert sum(p.numel() for p in model.parameters()) == 3 * 16 * 8 + 8 * 16 == 512
    E = model.backbone.embeddings.weight.detach()
    assert torch.allclose(E @ E.T, torch.eye(8), atol=1e-5)  # App. H.2: orthonormal embedding vectors
    mixer = model.backbone.layers[0].mixer
    assert not hasattr(mixer, "in_proj") and model.backbone.norm_f is None and model.lm_head is None
    assert torch.equal(mixer.ssm.A, torch.full((16, 8), mixer.ssm.A_INIT))


def test_core_logits_are_the_logit_of_the_softmin_of_the_distances():
    torch.manual_seed(0)
    y, E = torch.randn(3, 5, 6, dtype=torch.float64), torch.randn(7, 6, dtype=torch.float64)
    d = torch.cdist(y, E[None].expand(3, -1, -1))
    p = torch.softmax(-d, -1)
    torch.testing.assert_close(distance_logits(y, E), torch.log(p / (1 - p)))
    # stable where p rounds to 1: s = (0, -200) gives logits (200, -200), not inf
    far = distance_logits(torch.zeros(1, 2), torch.tensor([[0.0, 0.0], [200.0, 0.0]]))
    torch.testing.assert_close(far, torch.tensor([[200.0, -200.0]]))
    y.requires_grad_(True)
    distance_logits(y, E).sum().backward()
    assert torch.isfinite(y.grad).all()


def test_core_loss_is_the_shifted_cross_entropy_of_the_logits():
    model = tiny(head="core", num_hidden_layers=1, vocab_size=8, hidden_size=16)
    ids = torch.randint(0, 8, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 8), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_image_classifier_counts_runs_and_learns():
    torch.manual_seed(0)
    model = hsc.CoffeeForImageClassification(hsc.CoffeeConfig(state_size=2))
    assert sum(p.numel() for p in model.parameters()) == 3385  # App. I.2: 4 · 150 + 2525 + 260
    assert len(model.mixers) == 4 and all(m.hidden_size == 25 for m in model.mixers)
    images, labels = torch.rand(3, 25, 25), torch.tensor([1, 7, 3])
    out = model(pixel_values=images, labels=labels)
    assert out.logits.shape == (3, 10) and out.loss.ndim == 0
    assert torch.equal(model(pixel_values=images[:, None]).logits, out.logits)  # [B, 1, H, W] too
    out.loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name
    # each reading is what it says: rows top to bottom, columns, and both reversed
    with torch.no_grad():
        last = [
            model.mixers[k](seq)[:, -1]
            for k, seq in enumerate((images, images.transpose(1, 2), images.flip(1), images.transpose(1, 2).flip(1)))
        ]
        expected = model.classifier_out(torch.nn.functional.gelu(model.classifier_in(torch.cat(last, -1))))
    torch.testing.assert_close(out.logits.detach(), expected)
    with pytest.raises(ValueError, match="image_size=25"):
        model(pixel_values=torch.rand(2, 24, 25))
    # the loss is the cross-entropy of these logits with these labels, and it learns: 5 Adam steps (seeded above,
    # deterministic) lower it at every step, to 2/3 of where it started (measured 2.31 -> 1.29), moving every
    # parameter
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, labels))
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(pixel_values=images, labels=labels).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(model(pixel_values=images, labels=labels).loss.item())
    assert losses[0] == pytest.approx(out.loss.item())
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    assert losses[-1] < 2 / 3 * losses[0], losses
    for name, parameter in model.named_parameters():
        assert not torch.equal(parameter, before[name]), name


# ------------------------------------------------------------------------------------------ copies, gradients
def test_gradients_reach_every_parameter():
    model = tiny().train()
    ids = ids_of(2, 12)
    model(ids, labels=ids).loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize("mixer_type", ["s6", "s6_linearized"])
def test_baseline_mixers_run_as_models(mixer_type):
    model = tiny(head="core", num_hidden_layers=1, vocab_size=8, hidden_size=16, state_size=8, mixer_type=mixer_type)
    # the paper's 3nD + D² + |M|D (plus the bias of W_D)
    assert sum(p.numel() for p in model.parameters()) == 3 * 8 * 16 + 16 * 16 + 16 + 8 * 16
    assert model.backbone.layers[0].mixer.ssm.W_D.weight.std() > 0.5  # its own N(0, 1) init, not transformers' 0.02
    ids = torch.randint(0, 8, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        cache, steps = None, []
        for t in range(10):
            out = model(ids[:, t : t + 1], cache_params=cache, use_cache=True)
            cache, steps = out.cache_params, steps + [out.logits]
    assert rel(torch.cat(steps, 1), full) < 1e-4
    with pytest.raises(TypeError, match="mixer_type='coffee'"):
        hsc.enable(model)


# ------------------------------------------------------------------------------------------ Hub form
def test_save_pretrained_and_trust_remote_code_in_a_fresh_process(tmp_path):
    model = tiny()
    folder = tmp_path / "coffee"
    model.save_pretrained(folder)
    names = set(os.listdir(folder))
    assert {"config.json", "modeling_coffee.py", "configuration_coffee.py"} <= names
    config = (folder / "config.json").read_text()
    assert '"AutoModelForCausalLM": "modeling_coffee.CoffeeForCausalLM"' in config
    assert '"AutoConfig": "configuration_coffee.CoffeeConfig"' in config
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
            out = model.generate(data["ids"], max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
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
    assert type(loaded) is hsc.CoffeeForCausalLM
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)


@pytest.mark.parametrize("head", ["core", "classifier"])
def test_save_and_load_the_papers_models(tmp_path, head):
    torch.manual_seed(0)
    if head == "core":
        model = hsc.CoffeeForCausalLM(hsc.CoffeeConfig(head="core", vocab_size=8, hidden_size=16, state_size=8)).eval()
        inputs = {"input_ids": torch.randint(0, 8, (2, 6))}
        auto = AutoModelForCausalLM
    else:
        model = hsc.CoffeeForImageClassification(hsc.CoffeeConfig(state_size=2)).eval()
        inputs = {"pixel_values": torch.rand(2, 25, 25)}
        auto = AutoModelForImageClassification
    model.save_pretrained(tmp_path / head)
    loaded = auto.from_pretrained(tmp_path / head).eval()
    assert type(loaded) is type(model)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)
