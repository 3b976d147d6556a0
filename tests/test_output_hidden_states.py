"""``output_hidden_states`` of this package's models follows transformers' MambaModel: each layer's output, then the
final hidden state (after the last norm, replacing the last layer's output): ``num_hidden_layers + 1`` tensors."""

import pytest
import torch

import hf_statecompose as hsc


def _serpent(layers):
    config = hsc.SeRpEntMambaConfig(
        vocab_size=99,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=layers,
        branch_compressions=(1.0, 0.5),
        state_size=8,
    )
    return hsc.SeRpEntMambaForCausalLM(config)


def _serpent_block(model, index, hidden):
    from hf_statecompose.state.serpent_cache import ComposableSeRpEntCache

    real = torch.ones(hidden.shape[:2], dtype=torch.bool)
    return model.backbone.layers[index](hidden, ComposableSeRpEntCache._for_config(model.config, hidden.dtype), real)


def _coffee(layers):
    return hsc.CoffeeForCausalLM(
        hsc.CoffeeConfig(vocab_size=99, hidden_size=32, num_hidden_layers=layers, state_size=4)
    )


def _coffee_block(model, index, hidden):
    return model.backbone.layers[index](hidden, None, None)


@pytest.mark.parametrize(
    "make, block", [(_serpent, _serpent_block), (_coffee, _coffee_block)], ids=["serpent", "coffee"]
)
@pytest.mark.parametrize("layers", [1, 3])
def test_hidden_states_are_each_layer_output_then_the_final_state(make, block, layers):
    torch.manual_seed(0)
    model = make(layers).eval()
    ids = torch.randint(0, 99, (2, 5))
    with torch.no_grad():
        out = model.backbone(ids, output_hidden_states=True)
        states = out.hidden_states
        assert len(states) == layers + 1
        torch.testing.assert_close(states[0], block(model, 0, model.backbone.embeddings(ids)))  # layer 0's output
        for index in range(layers - 1):  # layer i + 1's output, from layer i's
            torch.testing.assert_close(block(model, index + 1, states[index]), states[index + 1])
        assert torch.equal(states[-1], out.last_hidden_state)  # the last: after the final norm
        assert len(model.backbone(ids, output_hidden_states=True, return_dict=False)[-1]) == layers + 1
        assert len(model(ids, output_hidden_states=True).hidden_states) == layers + 1
