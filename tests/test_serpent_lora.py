"""LoRA on ``dt_proj`` trains on SeRpEnt's branch SSMs (this package's selective-SSM path, the model's only one):
the adapter is called, not bypassed through ``dt_proj.weight``; a fresh adapter (B = 0) leaves the results bit for
bit. transformers' Mamba-1 / FalconMamba ignore such an adapter in their own forward, so their state path refuses
it (it would make states disagree with the model)."""

import pytest
import torch

import hf_statecompose as hsc

from helpers import random_ids, tiny_model

peft = pytest.importorskip("peft")

VOCAB = 61


def serpent(seed: int = 0) -> hsc.SeRpEntMambaForCausalLM:
    torch.manual_seed(seed)
    config = hsc.SeRpEntMambaConfig(
        vocab_size=VOCAB,
        hidden_size=24,
        num_hidden_layers=2,
        state_size=4,
        resample_window=3,
        num_gaussians=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return hsc.SeRpEntMambaForCausalLM(config).eval()


def with_lora(model, random_b: bool = False, seed: int = 1):
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["dt_proj"]))
    if random_b:  # PEFT starts B at 0: a non-zero adapter
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    return wrapped


def lora_parameters(model):
    found = {n: p for n, p in model.named_parameters() if "lora_" in n and "dt_proj" in n}
    assert found, "no LoRA parameters on dt_proj"
    return found


def ids_of(batch, length, seed=1):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def train_step(model, loss_fn):
    """One AdamW step; returns the LoRA parameters before it."""
    params = lora_parameters(model)
    before = {n: p.detach().clone() for n, p in params.items()}
    optimizer = torch.optim.AdamW(params.values(), lr=1e-2)
    loss = loss_fn()
    loss.backward()
    missing = [n for n, p in params.items() if "lora_B" in n and (p.grad is None or not p.grad.abs().sum() > 0)]
    assert not missing, f"LoRA on dt_proj got no gradient: {missing[:2]}"
    optimizer.step()
    optimizer.zero_grad()
    return before


def test_serpent_fresh_lora_on_dt_proj_changes_nothing():
    model = serpent()
    ids = ids_of(2, 9)
    with torch.no_grad():
        expected = model(ids).logits
        actual = with_lora(model)(ids).logits
    assert torch.equal(actual, expected)


def test_serpent_lora_on_dt_proj_trains_and_changes_the_output():
    model = with_lora(serpent())
    ids = ids_of(2, 9)
    with torch.no_grad():
        before_out = model(ids, use_cache=True)
    model.train()
    before = train_step(model, lambda: model(input_ids=ids, labels=ids).loss)
    model.eval()
    changed = [n for n, p in lora_parameters(model).items() if not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in changed), "an optimizer step left LoRA's weights on dt_proj unchanged"
    with torch.no_grad():
        after_out = model(ids, use_cache=True)
    # Δ changed: the state's ΣΔ and SSM states (what Δ shapes directly; this tiny model's logits barely feel Δ)
    for name in ("delta_sums", "ssm_states"):
        moved = max(
            float((a - b).abs().max()) for a, b in zip(getattr(after_out.cache, name), getattr(before_out.cache, name))
        )
        assert moved > 0, f"the trained LoRA on dt_proj left the output's {name} as they were"


def test_serpent_lora_on_dt_proj_equals_merging_it():
    """The adapter enters Δ as dt_proj(x) does: LoRA with random B equals merging it into dt_proj's weight."""
    model = with_lora(serpent(), random_b=True)
    ids = ids_of(2, 9)
    with torch.no_grad():
        adapted = model(ids, use_cache=True)
        merged = model.merge_and_unload()(ids, use_cache=True)
        base = serpent()(ids, use_cache=True)
    assert torch.allclose(adapted.logits, merged.logits, rtol=1e-4, atol=1e-6)
    for a, m, _b in zip(adapted.cache.delta_sums, merged.cache.delta_sums, base.cache.delta_sums):
        assert torch.allclose(a, m, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(adapted.cache.delta_sums, base.cache.delta_sums))


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba"])
def test_stock_mamba_refuses_an_adapter_on_dt_proj_and_the_merged_model_is_exact(arch):
    """transformers' own Mamba-1 / FalconMamba forward reads dt_proj.weight and ignores an adapter on dt_proj, so
    the state path refuses it (states would disagree with the model's forward); merged, states are exact again."""
    model = with_lora(tiny_model(arch), random_b=True)
    context, query = random_ids(7), random_ids(4)
    with pytest.raises(ValueError, match=r"dt_proj is wrapped .*ignores an adapter on dt_proj.*merge_and_unload"):
        hsc.encode(model, context)
    with torch.no_grad():
        merged = model.merge_and_unload()
        ours = merged(query, past_states=[hsc.encode(merged, context)]).logits
        full = merged(torch.cat([context, query], 1)).logits[:, -query.shape[1] :]
        base = tiny_model(arch)(torch.cat([context, query], 1)).logits[:, -query.shape[1] :]
    assert not torch.allclose(full, base, rtol=1e-3)  # the merged adapter matters
    assert torch.allclose(ours, full, rtol=1e-4, atol=1e-4), float((ours - full).abs().max())
