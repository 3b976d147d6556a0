"""Family b of the adversarial trial: in-memory state misuse."""

from __future__ import annotations

import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer

from .common import (
    ARCHS,
    VOCAB,
    _state_case,
    compare_logits,
    expect_error,
    handled,
    ids_of,
    logits_of,
    same_state,
    silent,
    state_dict_of,
)

MEMORY_KINDS = (
    "negative_delta",
    "nan_ssm",
    "inf_conv",
    "nan_delta",
    "shape_ssm",
    "shape_delta",
    "dtype_ssm",
    "dtype_conv",
    "dtype_delta",
    "meta_device",
    "A_inplace",
    "clone_A_inplace",
    "clone_ssm_inplace",
    "select_float",
    "select_float_tensor",
    "select_out_of_range",
    "select_duplicate_rows",
    "getitem_str",
    "other_model_state",
    "other_arch_state",
    "compose_mixed_models",
    "num_tokens_negative",
    "extras_missing",
    "batch_mismatch_states",
    "detach_shares",
    "repeat_interleave_bad",
)


def gen_memory(rng, scale):
    cases = []
    for n, kind in enumerate(MEMORY_KINDS):
        reps = (
            3
            if kind
            in ("negative_delta", "nan_ssm", "A_inplace", "clone_A_inplace", "select_float", "other_model_state")
            else 1
        )
        plan = [(arch, reps) for arch in ARCHS] if scale == "full" else [(ARCHS[n % len(ARCHS)], 1)]
        for arch, r in plan:
            for _ in range(r):
                cases.append(("b", "memory", {"arch": arch, "mutation": kind, "seed": rng.randrange(1 << 30)}))
    return cases


def run_memory_case(ctx, params):
    arch, kind, rng, model, ref, s1, s2, query = _state_case(ctx, params)
    layer = rng.randrange(s1.num_layers)

    def use_and_compare(states=None):
        return compare_logits(logits_of(model, query, states or [s1, s2]), ref["logits2"])

    if kind == "negative_delta":
        flat = s1.delta_sums[layer].view(-1)
        flat[rng.randrange(flat.numel())] = -rng.uniform(0.1, 5.0)
        return use_and_compare()
    if kind == "nan_ssm":
        s1.ssm_states[layer].view(-1)[rng.randrange(s1.ssm_states[layer].numel())] = float("nan")
        return use_and_compare()
    if kind == "inf_conv":
        target = s1.conv_states[layer] if s1.conv_states[layer].numel() else s1.ssm_states[layer]
        target.view(-1)[0] = float("inf")
        return use_and_compare()
    if kind == "nan_delta":
        s1.delta_sums[layer].view(-1)[0] = float("nan")
        return use_and_compare()
    if kind in ("shape_ssm", "shape_delta"):
        if kind == "shape_ssm":
            s1.ssm_states[layer] = s1.ssm_states[layer][..., :-1]
        else:
            s1.delta_sums[layer] = torch.cat([s1.delta_sums[layer], s1.delta_sums[layer][:, :1]], dim=1)
        return use_and_compare()
    if kind in ("dtype_ssm", "dtype_conv", "dtype_delta"):
        attr = {"dtype_ssm": "ssm_states", "dtype_conv": "conv_states", "dtype_delta": "delta_sums"}[kind]
        original = getattr(s1, attr)[layer]
        converted = original.to(rng.choice([torch.float64, torch.float16, torch.bfloat16]))
        # the reference: the same (rounded) values in the right dtype; a library that refuses, or that computes with
        # the values it was given, is right; anything else changed the result
        rounded = s1.clone()
        getattr(rounded, attr)[layer] = converted.to(original.dtype)
        getattr(s1, attr)[layer] = converted
        return compare_logits(
            logits_of(model, query, [s1, s2]),
            logits_of(model, query, [rounded, s2]),
            f"logits (vs the rounded values in {original.dtype})",
        )
    if kind == "meta_device":
        s1.ssm_states[layer] = torch.empty_like(s1.ssm_states[layer], device="meta")
        return use_and_compare()
    if kind == "A_inplace":
        s1.A[layer].mul_(rng.choice([2.0, 0.5]))
        return use_and_compare()
    if kind in ("clone_A_inplace", "clone_ssm_inplace"):
        original = ctx.states[arch][0]
        copy_ = original.clone()
        (copy_.A if kind == "clone_A_inplace" else copy_.ssm_states)[layer].mul_(2.0).add_(0.5)
        problem = same_state(state_dict_of(original), ref["s1"])
        if problem is not None:
            return silent(f"editing a clone() in place changed the original ({problem})")
        return compare_logits(
            logits_of(model, query, [original, ctx.states[arch][1]]), ref["logits2"], "the original's logits"
        )
    if kind in (
        "select_float",
        "select_float_tensor",
    ):  # torch refuses float indices; truncating them picks a row by accident
        row = {"select_float": rng.choice([0.5, 0.0, 0.99]), "select_float_tensor": torch.tensor([0.0])}[kind]
        return expect_error(lambda: s1.select(row))
    if kind == "select_out_of_range":
        return expect_error(lambda: s1.select(rng.choice([1, 5, -2, [0, 3]])))
    if kind == "select_duplicate_rows":
        rows = s1.select([0, 0])

        def check(_):
            for r in (0, 1):
                if same_state(state_dict_of(rows.select(r)), ref["s1"]) is not None:
                    return silent("select([0, 0]) rows differ from the state")
            return handled("select([0, 0]) = two copies")

        return check(rows)
    if kind == "getitem_str":
        return expect_error(lambda: s1["0"])
    if kind == "other_model_state":
        with torch.no_grad():
            foreign = hsc.encode(ctx.others[arch], ids_of(7, seed=params["seed"] % 1000))
        return use_and_compare([foreign, s2])
    if kind in ("other_arch_state", "compose_mixed_models"):
        other_arch = rng.choice([a for a in ARCHS if a != arch])
        foreign = ctx.states[other_arch][0].clone()
        if kind == "other_arch_state":
            return use_and_compare([s1, foreign])
        return expect_error(lambda: StateComposer("soup").compose([s1, foreign]))
    if kind == "num_tokens_negative":
        s1.num_tokens = torch.tensor([-5])
        return use_and_compare()
    if kind == "extras_missing":
        if arch != "serpent_mamba":
            s1.token_ids = torch.tensor(
                [[VOCAB + 7] * 3]
            )  # out-of-vocabulary context ids: refuse or leave the result unchanged
            return use_and_compare()
        s1.clocks[layer] = None
        return use_and_compare()
    if kind == "batch_mismatch_states":
        return expect_error(lambda: StateComposer("soup").compose([s1, ComposableMambaCache.stack([s2, s2])]))
    if kind == "detach_shares":
        detached = s1.detach()
        detached.ssm_states[layer].add_(1.0)
        problem = same_state(state_dict_of(s1), ref["s1"])
        return (
            handled("detach() copies")
            if problem is None
            else handled(f"detach() shares storage as torch's does ({problem})")
        )
    if kind == "repeat_interleave_bad":
        return expect_error(lambda: s1.repeat_interleave(rng.choice([-1, 1.5, "2"])))
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "b", "memory", "in-memory state misuse"
RUNNERS = {"memory": run_memory_case}


def generate(rng, scale, backends):
    return gen_memory(rng, scale)
