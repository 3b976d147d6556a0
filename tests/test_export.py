"""torch.export and torch.compile(fullgraph=True) of SeRpEnt and COFFEE forwards work as they do for stock Mamba:
a plain forward, one with ``use_cache`` (the cache's fingerprint is not hashed from FakeTensors), a left-padded
batch with its mask, and a generate-style prefill + one-token step; the traced graphs give eager's outputs."""

import pytest
import torch
from transformers import MambaConfig, MambaForCausalLM

import hf_statecompose as hsc
from hf_statecompose import compat

VOCAB = 40


def tiny(arch: str):
    torch.manual_seed(0)
    special = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if arch == "mamba":
        config = MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=2, **special)
        return MambaForCausalLM(config).eval()
    if arch == "serpent":  # one branch that resamples (κ = 0.5): some tokens create no grid point
        config = hsc.SeRpEntMambaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=1,
            state_size=4,
            branch_compressions=(1.0, 0.5),
            resample_window=2,
            num_gaussians=2,
            **special,
        )
        return hsc.SeRpEntMambaForCausalLM(config).eval()
    config = hsc.CoffeeConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4, **special)
    return hsc.CoffeeForCausalLM(config).eval()


_models = {}


def model_of(arch):
    if arch not in _models:
        _models[arch] = tiny(arch)
    return _models[arch]


class Plain(torch.nn.Module):
    def __init__(self, model, use_cache):
        super().__init__()
        self.model, self.use_cache = model, use_cache

    def forward(self, ids):
        return self.model(ids, use_cache=self.use_cache).logits


class Masked(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(ids, attention_mask=mask).logits


class PrefillAndStep(torch.nn.Module):
    """What generate runs: a prefill with use_cache, then one token continuing the cache."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, next_ids):
        cache = compat.output_cache(self.model(ids, use_cache=True))
        return self.model(next_ids, use_cache=True, **compat.cache_kwargs(cache)).logits


def ids_of(batch, length=5, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def cases(model):
    ids, next_ids = ids_of(2), ids_of(2, 1, seed=2)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # row 0 left padded
    return {
        "plain": (Plain(model, False), (ids,)),
        "use_cache": (Plain(model, True), (ids,)),
        "left_padded": (Masked(model), (ids, mask)),
        "prefill_and_step": (PrefillAndStep(model), (ids, next_ids)),
    }


def close(actual, expected):
    assert actual.shape == expected.shape
    assert torch.allclose(actual, expected, rtol=1e-5, atol=1e-5), float((actual - expected).abs().max())


# stock Mamba allows all of these on the installed torch (torch 2.13): the baseline, once, in its longest case
EXPORTED = [
    (arch, case) for arch in ("serpent", "coffee") for case in ("plain", "use_cache", "left_padded", "prefill_and_step")
]
COMPILED = [(arch, case) for arch in ("serpent", "coffee") for case in ("plain", "use_cache", "prefill_and_step")]


@pytest.mark.parametrize("arch, case", [("mamba", "prefill_and_step")] + EXPORTED)
def test_torch_export_equals_eager(arch, case):
    module, args = cases(model_of(arch))[case]
    with torch.no_grad():
        expected = module(*args)
    exported = torch.export.export(module, args).module()
    close(exported(*args), expected)  # with autograd on, as a user runs it
    with torch.no_grad():
        close(exported(*args), expected)


@pytest.mark.parametrize("arch, case", COMPILED)
def test_torch_compile_fullgraph_equals_eager(arch, case):
    torch._dynamo.reset()
    module, args = cases(model_of(arch))[case]
    with torch.no_grad():
        expected = module(*args)
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        close(compiled(*args), expected)


def test_eager_caches_still_carry_the_model_fingerprint():
    model = model_of("coffee")
    with torch.no_grad():
        cache = compat.output_cache(model(ids_of(1, 4), use_cache=True))
    assert cache.fingerprint == hsc.model_fingerprint(model) != ""


def test_a_cache_made_while_tracing_names_no_model_and_is_refused_clearly():
    """A cache built inside a traced graph cannot hash the weights: it carries no fingerprint, and generate
    refuses it as past_states with the reason (not as "another model")."""
    from hf_statecompose.state.fingerprint import TRACED_FINGERPRINT

    model = hsc.enable(tiny("coffee"))
    seen = []

    def grab(module, args, kwargs, output):
        seen.append(compat.output_cache(output))

    handle = model.backbone.register_forward_hook(grab, with_kwargs=True)
    try:
        torch.export.export(Plain(model, True), (ids_of(1, 4),))
    finally:
        handle.remove()
    assert seen and seen[0].fingerprint == TRACED_FINGERPRINT
    traced = hsc.encode(model, ids_of(1, 4))
    traced.fingerprint = TRACED_FINGERPRINT
    with pytest.raises(ValueError, match=r"inside torch\.compile / torch\.export.*encode the contexts eagerly"):
        model.generate(ids_of(1, 2), past_states=[traced], max_new_tokens=1)
