"""Family i of the adversarial trial (issue 29, item 6): what the fingerprint must see or refuse. A parametrization
whose Python state changes after encoding (the weights the forward uses change, the fingerprint must too), a
``torch.compile``d model called with ``past_states`` (equal to eager, or refused in one line), a model whose weights
accelerate offloaded (``cpu_offload``: equal to the model in memory, or refused naming offload)."""

from __future__ import annotations

import random

import torch

import hf_statecompose as hsc

from .common import build_model, close_logits, expect_error, handled, ids_of

KINDS = ("parametrization_state_changed", "compiled_model", "offloaded_model")


class _Scale(torch.nn.Module):
    """A parametrization with Python state: the weight the forward uses is ``s`` times the stored one."""

    def __init__(self):
        super().__init__()
        self.s = 1.0

    def forward(self, weight):
        return weight * self.s


def run_fingerprint_case(ctx, params):
    kind = params["mutation"]
    arch = params["arch"]
    model = build_model(arch, seed=params["seed"] % 1000)
    context, query = ids_of(9, seed=params["seed"]), ids_of(4, seed=params["seed"] + 1)
    if kind == "parametrization_state_changed":
        from torch.nn.utils import parametrize

        layer = model.backbone.layers[0].mixer.out_proj
        parametrize.register_parametrization(layer, "weight", _Scale())
        with torch.no_grad():
            state = hsc.encode(model, context)
        layer.parametrizations.weight[0].s = 3.0  # the model now computes with 3x the weight the state was made by
        # refusing the stale state is the fix; accepting it is a result for another model
        return expect_error(lambda: model(query, past_states=[state]))
    with torch.no_grad():
        state = hsc.encode(model, context)
        reference = model(query, past_states=[state]).logits
    if kind == "compiled_model":
        compiled = torch.compile(model, backend="eager")  # dynamo without inductor: no C++ build in the trial
        with torch.no_grad():
            logits = compiled(query, past_states=[state]).logits
        return close_logits(logits, reference, tol=1e-5, what="compiled model's logits")
    if kind == "offloaded_model":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=torch.device("cpu"))
        with torch.no_grad():
            logits = model(query, past_states=[state]).logits
        return close_logits(logits, reference, tol=1e-5, what="offloaded model's logits")
    return handled("no case")


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "i", "fingerprint", "fingerprint, torch"
RUNNERS = {"fingerprint": run_fingerprint_case}


def generate(rng: random.Random, scale, backends):
    archs = ("mamba", "mamba2") if scale == "full" else ("mamba2",)
    return [
        (CATEGORY, "fingerprint", {"mutation": k, "arch": a, "seed": rng.randrange(1 << 30)})
        for k in KINDS
        for a in archs
    ]
