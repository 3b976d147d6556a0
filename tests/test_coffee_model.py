"""COFFEE models (``coffee``): config, Auto registration and the Hub (trust_remote_code) round trip, the paper's
parameter counts, causality, ragged batches, incremental == full, generate(), copies, the image classifier.
Tiny configs throughout."""

import copy
import io
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

from helpers import load_saved, pickle_round_trip

VOCAB = 40


def tiny(seed: int = 0, **overrides) -> hsc.CoffeeForCausalLM:
    """A tiny random COFFEE LM; an untied N(0, 1) head spreads the logits (greedy does not echo one token)."""
    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        state_size=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    model = hsc.CoffeeForCausalLM(hsc.CoffeeConfig(**kwargs)).eval()
    if model.lm_head is not None and not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 1.0)
    return model


def ids_of(batch: int, length: int, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module", params=["lm", "core"])
def model(request):
    if request.param == "core":
        return tiny(head="core", num_hidden_layers=1)
    return tiny()


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


# ------------------------------------------------------------------------------------------ causality
@pytest.mark.parametrize("padded", [False, True])
def test_later_tokens_change_no_earlier_logit(model, padded):
    """The prefill is a Newton solve with one stopping rule for the whole batch: earlier logits may move by
    rounding when later tokens change (the solve may take another step), never more."""
    ids = ids_of(3, 24)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :5] = 0
        mask[2, :9] = 0
    changed = ids.clone()
    p = 14
    changed[:, p + 1 :] = ids_of(3, 24 - p - 1, seed=7)
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        after = model(changed, attention_mask=mask).logits
    assert rel(after[:, : p + 1], before[:, : p + 1]) < 1e-5
    assert rel(after[:, p + 1 :], before[:, p + 1 :]) > 1e-3  # the perturbation does reach later tokens


def test_padding_content_is_ignored(model):
    ids = ids_of(2, 16)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    other = ids.clone()
    other[0, :6] = ids_of(1, 6, seed=3)
    with torch.no_grad():
        a, b = model(ids, attention_mask=mask).logits, model(other, attention_mask=mask).logits
    assert rel(a[:, 6:], b[:, 6:]) < 1e-5


def test_ragged_batch_rows_equal_each_row_alone(model):
    ids = ids_of(3, 20)
    lengths = [20, 13, 4]
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, -n:] = 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for row, n in enumerate(lengths):
            alone = model(ids[row : row + 1, -n:]).logits[0]
            assert rel(batched[row, -n:], alone) < 1e-5


# ------------------------------------------------------------------------------------------ incremental
def test_token_by_token_and_chunks_equal_the_full_forward(model):
    ids = ids_of(2, 22)
    with torch.no_grad():
        full = model(ids).logits
        cache, steps = None, []
        for t in range(ids.shape[1]):
            out = model(ids[:, t : t + 1], cache_params=cache, use_cache=True)
            cache, steps = out.cache_params, steps + [out.logits]
        first = model(ids[:, :9], use_cache=True)
        second = model(ids[:, 9:], cache_params=first.cache_params, use_cache=True)
    assert rel(torch.cat(steps, 1), full) < 1e-4
    assert rel(torch.cat([first.logits, second.logits], 1), full) < 1e-4
    assert cache.num_tokens.tolist() == [22, 22] and cache.architecture == "coffee"
    E = model.config.mixer_size * model.config.state_size
    assert cache.ssm_states[0].shape == (2, E, 1) and cache.conv_states[0].shape == (2, E, 0)
    assert cache.delta_sums[0].shape == (2, E) and (cache.delta_sums[0] >= 0).all()
    assert torch.equal(cache.A[0], -torch.ones(E, 1))


def test_padded_prompt_then_tokens_equals_the_full_forward(model):
    ids = ids_of(2, 18)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        prompt = model(ids[:, :10], attention_mask=mask[:, :10], use_cache=True)
        cache, steps = prompt.cache_params, []
        for t in range(10, 18):
            out = model(ids[:, t : t + 1], cache_params=cache, use_cache=True)
            cache, steps = out.cache_params, steps + [out.logits]
    assert rel(torch.cat(steps, 1), full[:, 10:]) < 1e-4
    assert cache.num_tokens.tolist() == [18, 11]


def greedy_by_full_forwards(model, ids, new_tokens, mask=None):
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(new_tokens):
            step_mask = (
                None
                if mask is None
                else torch.cat([mask, mask.new_ones(ids.shape[0], ids.shape[1] - mask.shape[1])], 1)
            )
            nxt = model(ids, attention_mask=step_mask).logits[:, -1].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], 1)
    return ids


def test_generate_greedy_and_left_padded_batch(model):
    ids = ids_of(2, 9)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out, greedy_by_full_forwards(model, ids, 8, mask))
    alone = model.generate(ids[1:, 4:], max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(out[1, 9:], alone[0, 5:])
    if model.config.head == "lm":  # a real test: not one token repeated (the random core module may echo)
        assert len(set(out[0, 9:].tolist())) > 1


def test_generate_sampling_is_the_full_forward_distribution(model):
    ids = ids_of(1, 8)
    torch.manual_seed(3)
    out = model.generate(
        ids,
        max_new_tokens=6,
        do_sample=True,
        top_k=0,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    with torch.no_grad():
        full = model(out.sequences[:, :-1]).logits[:, ids.shape[1] - 1 :]
    assert rel(torch.stack(out.scores, 1), full) < 1e-4


def test_generate_beams_and_return_sequences(model):
    ids = ids_of(2, 7)
    beams = model.generate(
        ids,
        max_new_tokens=5,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        early_stopping=False,
        length_penalty=0.0,
        eos_token_id=None,
    )
    with torch.no_grad():  # every returned beam's score is its log-probability under full forwards
        logits = model(beams.sequences[:, :-1]).logits[:, ids.shape[1] - 1 :]
        tokens = beams.sequences[:, ids.shape[1] :]
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0].sum(-1)
    assert torch.allclose(beams.sequences_scores, logp, atol=1e-4)
    torch.manual_seed(4)
    sampled = model.generate(
        ids,
        max_new_tokens=5,
        do_sample=True,
        top_k=0,
        num_return_sequences=2,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    assert sampled.sequences.shape[0] == 4 and torch.equal(sampled.sequences[1::2, :7], ids)
    with torch.no_grad():
        full = model(sampled.sequences[:, :-1]).logits[:, ids.shape[1] - 1 :]
    assert rel(torch.stack(sampled.scores, 1), full) < 1e-4


# ------------------------------------------------------------------------------------------ copies, gradients
def test_model_survives_deepcopy_pickle_and_torch_save(model):
    ids = ids_of(2, 10)
    with torch.no_grad():
        expected = model(ids).logits
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        # the standard asks models to survive pickle / torch.save: these bytes are made here, never a user's file
        for clone in (copy.deepcopy(model), pickle_round_trip(model), load_saved(buffer)):
            assert torch.equal(clone(ids).logits, expected)


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


def test_past_states_are_refused_until_the_model_is_enabled():
    model = tiny()
    ids = ids_of(1, 4)
    for call in (lambda: model(ids, past_states=[object()]), lambda: model.backbone(ids, past_states=[object()])):
        with pytest.raises(ValueError, match=r"past_states needs hf_statecompose\.enable"):
            call()
