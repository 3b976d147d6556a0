"""State files written by hf_statecompose 0.1.0 (before the cache layer became the unit of state, on
transformers 5.23) still load, on every transformers release of the tested range, and equal a fresh encoding.

``tests/data/state-0.1.0-*.safetensors`` were written by commit f7cdafc (0.1.0) from the models built below
(same seeds and configs) encoding the same ids."""

import pathlib

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache

from helpers import tiny_model

DATA = pathlib.Path(__file__).parent / "data"
IDS = torch.arange(3, 3 + 11)[None] % 99


def _model(arch):
    if arch == "serpent_mamba":
        config = hsc.SeRpEntMambaConfig(
            vocab_size=99,
            hidden_size=24,
            state_size=4,
            num_hidden_layers=2,
            branch_compressions=[1.0, 0.5],
            resample_window=2,
        )
        torch.manual_seed(0)
        return hsc.enable(hsc.SeRpEntMambaForCausalLM(config).eval())
    return tiny_model(arch, seed=0)


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "serpent_mamba"])
@torch.no_grad()
def test_a_0_1_0_state_file_loads_and_equals_a_fresh_encoding(arch):
    model = _model(arch)
    loaded = ComposableMambaCache.load(DATA / f"state-0.1.0-{arch}.safetensors", model=model)  # fingerprint checked
    fresh = hsc.encode(model, IDS)
    assert type(loaded) is type(fresh) and loaded.num_tokens.tolist() == [11]
    assert torch.equal(loaded.token_ids, fresh.token_ids)
    for i in range(fresh.num_layers):
        for name in ("ssm_states", "conv_states", "delta_sums", "A"):
            torch.testing.assert_close(getattr(loaded, name)[i], getattr(fresh, name)[i], rtol=1e-5, atol=1e-6)
    if arch == "serpent_mamba":
        for name in ("clocks", "window_inputs", "window_times", "window_valid", "last_outputs"):
            for v in range(fresh.num_layers):
                torch.testing.assert_close(getattr(loaded, name)[v], getattr(fresh, name)[v], rtol=1e-5, atol=1e-6)
    # and it generates as the fresh one does
    query = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(model(query, past_states=[loaded]).logits, model(query, past_states=[fresh]).logits)
