"""A toy architecture for ``test_architecture_table.py``: its own config, model classes and stock mixer class, in this
module (not transformers'), with Mamba's maths. Its row (:data:`TOY_ROW`) is Mamba's renamed and pointed at these
classes: registering it (``architectures.register``) is all ``enable``, ``encode``, the guard, the errors and the docs'
table need to know it."""

import dataclasses

import torch
from transformers import MambaConfig, MambaForCausalLM, MambaModel
from transformers.models.mamba.modeling_mamba import MambaMixer

from hf_statecompose.state.architectures import architecture

NAME = "toy_mamba"


class ToyMambaConfig(MambaConfig):
    model_type = NAME


class ToyMambaMixer(MambaMixer):
    """The toy's stock mixer: Mamba's, under its own class (``enable`` swaps it as the toy's row says)."""


def _toy_mixers(backbone) -> None:
    for block in backbone.layers:
        block.mixer.__class__ = ToyMambaMixer


class ToyMambaModel(MambaModel):
    config_class = ToyMambaConfig

    def __init__(self, config):
        super().__init__(config)
        _toy_mixers(self)

    def forward(self, *args, **kwargs):  # its own (the guard wraps it); arguments with past_states go by name
        return super().forward(*args, **kwargs)


class ToyMambaForCausalLM(MambaForCausalLM):
    config_class = ToyMambaConfig

    def __init__(self, config):
        super().__init__(config)
        _toy_mixers(self.backbone)

    def forward(self, *args, **kwargs):  # its own (the guard wraps it); arguments with past_states go by name
        return super().forward(*args, **kwargs)


TOY_ROW = dataclasses.replace(
    architecture("mamba"),
    name=NAME,
    display_name="ToyMamba",
    model_module=__name__,
    model_classes=("ToyMambaModel", "ToyMambaForCausalLM"),
    mixer_class="ToyMambaMixer",
)


def toy_model(seed: int = 0) -> ToyMambaForCausalLM:
    torch.manual_seed(seed)
    config = ToyMambaConfig(
        vocab_size=64, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, pad_token_id=0, eos_token_id=1
    )
    return ToyMambaForCausalLM(config).eval()
