"""COFFEE's (and SeRpEnt's) ``output_hidden_states`` has the layout of transformers' ``MambaModel``: each layer's
output, then the final hidden state; ``num_hidden_layers + 1`` tensors, the last one ``last_hidden_state``."""

import pytest
import torch
from transformers import MambaConfig, MambaModel

import hf_statecompose as hsc

VOCAB = 40


def coffee(head: str, layers: int = 3) -> hsc.CoffeeForCausalLM:
    torch.manual_seed(0)
    config = hsc.CoffeeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=layers,
        state_size=4,
        head=head,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return hsc.CoffeeForCausalLM(config).eval()


def serpent(layers: int = 3) -> hsc.SeRpEntMambaForCausalLM:
    torch.manual_seed(0)
    config = hsc.SeRpEntMambaConfig(
        vocab_size=VOCAB,
        hidden_size=24,
        num_hidden_layers=layers,
        state_size=4,
        resample_window=3,
        num_gaussians=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return hsc.SeRpEntMambaForCausalLM(config).eval()


def ids_of(batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


def test_stock_mamba_layout_is_what_we_match():
    """The reference: MambaModel returns each layer's output, then the final (normed) one; no embeddings."""
    torch.manual_seed(0)
    model = MambaModel(MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=3)).eval()
    ids = ids_of(2, 5)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3 + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    assert torch.equal(model.norm_f(out.hidden_states[-2]), out.hidden_states[-1])
    assert not torch.equal(out.hidden_states[0], model.embeddings(ids))


@pytest.mark.parametrize("layers", [1, 3])
def test_coffee_lm_hidden_states_are_mamba_s(layers):
    model = coffee("lm", layers)
    ids = ids_of(2, 5)
    with torch.no_grad():
        out = model.backbone(ids, output_hidden_states=True)
        lm = model(ids, output_hidden_states=True)
        as_tuple = model.backbone(ids, output_hidden_states=True, return_dict=False)
    hidden = out.hidden_states
    assert len(hidden) == layers + 1, f"{len(hidden)} hidden states for {layers} layers (MambaModel: layers + 1)"
    assert len(lm.hidden_states) == layers + 1 and len(as_tuple[-1]) == layers + 1
    assert torch.equal(hidden[-1], out.last_hidden_state)
    assert torch.equal(model.backbone.norm_f(hidden[-2]), hidden[-1])
    # the first is the first layer's output, not the embeddings
    with torch.no_grad():
        first = model.backbone.layers[0](model.backbone.embeddings(ids), None, None)
    assert torch.equal(hidden[0], first)


def test_coffee_core_hidden_states_are_layers_plus_one():
    """The core module (App. F) has no final norm: its final hidden state is the last layer's output."""
    model = coffee("core", layers=1)
    ids = ids_of(2, 5)
    with torch.no_grad():
        out = model.backbone(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 1 + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    assert torch.equal(out.hidden_states[0], out.last_hidden_state)


def test_serpent_hidden_states_are_mamba_s():
    model = serpent(layers=3)
    ids = ids_of(2, 5)
    with torch.no_grad():
        out = model.backbone(ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3 + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    assert torch.equal(model.backbone.norm_f(out.hidden_states[-2]), out.hidden_states[-1])
