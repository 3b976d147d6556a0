"""Family g of the adversarial trial (issue 29, item 4): the method registry takes what it is given. A ``kernel_id``
no kernel implements, weight functions whose output is no weight (negative, sums other than 1, non-finite, a
``[n]`` tensor, an integer dtype), weight specs that cannot be imported, ``unregister`` of an unhashable name."""

from __future__ import annotations

import random

import torch

from hf_statecompose import StateComposer
from hf_statecompose.ops.compose import methods

from .common import accepted_invalid, expect_error, handled, silent

KERNEL_IDS = ("kernel_id_5", "kernel_id_99", "kernel_id_negative")
BAD_OUTPUTS = (
    "weights_negative",
    "weights_sum_0",
    "weights_sum_2",
    "weights_1e30",
    "weights_nan",
    "weights_vector_n",
    "weights_int_dtype",
)
BAD_SPECS = ("weights_missing_module", "weights_int_spec", "weights_missing_attribute")
UNREGISTER = ("unregister_list", "unregister_dict", "unregister_builtin")
KINDS = KERNEL_IDS + BAD_OUTPUTS + BAD_SPECS + UNREGISTER
CI = (
    "kernel_id_99",
    "weights_negative",
    "weights_sum_2",
    "weights_vector_n",
    "weights_missing_module",
    "unregister_list",
)


def _softmax_weights(log_decays):
    """A valid decay-based weight function (convex, per element): the states that decay least weigh most."""
    return torch.softmax(log_decays, dim=0)


def _bad_weights(kind):
    def weights(log_decays):
        n = log_decays.shape[0]
        uniform = torch.full_like(log_decays, 1.0 / n)
        if kind == "weights_negative":
            return -uniform
        if kind == "weights_sum_0":
            return torch.zeros_like(log_decays)
        if kind == "weights_sum_2":
            return 2 * uniform
        if kind == "weights_1e30":
            return uniform * 1e30
        if kind == "weights_nan":
            return uniform.masked_fill(torch.ones_like(uniform, dtype=torch.bool), float("nan"))
        if kind == "weights_vector_n":
            return torch.full((n,), 1.0 / n, dtype=log_decays.dtype, device=log_decays.device)
        if kind == "weights_int_dtype":
            return torch.ones_like(log_decays, dtype=torch.int64)
        raise AssertionError(kind)

    return weights


def _method(name, **fields):
    fields = {"summary": "adversarial", "delta_sum": "uniform", "conv": "mean", "weights": _softmax_weights, **fields}
    return methods.CompositionMethod(name=name, **fields)


def run_registry_case(ctx, params):
    kind = params["mutation"]
    arch = params["arch"]
    s1, s2 = (s.clone() for s in ctx.states[arch])
    model = ctx.models[arch]
    if kind in KERNEL_IDS:
        kernel_id = {"kernel_id_5": 5, "kernel_id_99": 99, "kernel_id_negative": -1}[kind]
        methods.register(_method("adv_kernel", kernel_id=kernel_id))  # refusing here is the fix
        methods.register(_method("adv_plain"))
        with torch.no_grad():
            got = StateComposer("adv_kernel").compose([s1, s2], model=model)
            want = StateComposer("adv_plain").compose([s1, s2], model=model)
        diff = max(float((a - b).abs().max()) for a, b in zip(got.ssm_states, want.ssm_states))
        if diff <= 1e-5:
            return handled(f"kernel_id {kernel_id} accepted and composed with the method's own weights")
        return silent(f"kernel_id {kernel_id} accepted; the state differs from its own weights' by {diff:.3g}")
    if kind in BAD_OUTPUTS:
        methods.register(_method("adv_bad", weights=_bad_weights(kind)))
        return expect_error(lambda: StateComposer("adv_bad").compose([s1, s2], model=model))
    if kind in BAD_SPECS:
        spec = {
            "weights_missing_module": "no_such_module_hsc:fn",
            "weights_int_spec": 42,
            "weights_missing_attribute": "hf_statecompose.ops.compose.weights:no_such_function",
        }[kind]
        return expect_error(lambda: methods.register(_method("adv_spec", weights=spec)))
    if kind == "unregister_list":
        return expect_error(lambda: methods.unregister(["adv_x"]))
    if kind == "unregister_dict":
        return expect_error(lambda: methods.unregister({"name": "adv_x"}))
    if kind == "unregister_builtin":
        return expect_error(lambda: methods.unregister("soup"))
    return accepted_invalid(f"unknown case {kind}")


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "g", "registry", "method registry"
RUNNERS = {"registry": run_registry_case}


def generate(rng: random.Random, scale, backends):
    kinds = KINDS if scale == "full" else CI
    archs = ("mamba", "mamba2") if scale == "full" else ("mamba",)
    return [
        (CATEGORY, "registry", {"mutation": k, "arch": a, "seed": rng.randrange(1 << 30)}) for k in kinds for a in archs
    ]
