"""Family c of the adversarial trial: API misuse."""

from __future__ import annotations

import os
import tempfile

import torch

import hf_statecompose as hsc
from hf_statecompose import ComposableMambaCache, StateComposer

from .common import (
    ARCHS,
    VOCAB,
    _state_case,
    compare_logits,
    expect_error,
    generate_of,
    handled,
    ids_of,
    logits_of,
    logits_of_positional,
    silent,
    state_dict_of,
)

API_KINDS = (
    "past_states_empty",
    "past_states_single",
    "past_states_none_item",
    "past_states_tensor_item",
    "past_states_str_item",
    "past_states_nested_ok",
    "past_states_nested_wrong_len",
    "past_states_dict",
    "composition_unknown",
    "composition_int",
    "composition_none",
    "weights_negative",
    "weights_sum",
    "weights_len",
    "weights_nan",
    "weights_str",
    "weights_missing",
    "conv_unknown",
    "backend_unknown",
    "ids_float",
    "ids_1d",
    "ids_3d",
    "ids_empty",
    "ids_oov",
    "ids_negative",
    "ids_batch2",
    "mask_right_padding",
    "mask_all_zero",
    "mask_shape",
    "mask_float_half",
    "mask_value_2",
    "both_cache",
    "positional_states",
    "encode_str",
    "encode_list",
    "encode_float",
    "encode_3d",
    "encode_empty",
    "encode_oov",
    "encode_negative",
    "encode_right_padding",
    "encode_pad_no_mask",
    "encode_not_model",
    "encode_backend",
    "compose_empty",
    "compose_non_state",
    "compose_method_unknown",
    "compose_concat_no_model",
    "compose_weights_nan",
    "enable_not_model",
    "set_backend_unknown",
    "fingerprint_not_model",
    "save_to_dir",
    "save_missing_dir",
    "save_not_state",
    "load_dir",
    "load_none",
    "load_model_str",
    "load_device_bad",
    "generate_right_padding",
)


def gen_api(rng, scale):
    cases = []
    for kind in API_KINDS:
        archs = ARCHS if scale == "full" else (ARCHS[API_KINDS.index(kind) % len(ARCHS)],)
        for arch in archs:
            cases.append(("c", "api", {"arch": arch, "mutation": kind, "seed": rng.randrange(1 << 30)}))
    return cases


def run_api_case(ctx, params):
    _arch, kind, rng, model, ref, s1, s2, query = _state_case(ctx, params)
    fwd = lambda states=None, q=query, **kw: logits_of(model, q, [s1, s2] if states is None else states, **kw)

    if kind == "past_states_empty":
        return expect_error(
            lambda: fwd([]), lambda out: compare_logits(out, ref["plain"], "logits (as without states)")
        )
    if kind == "past_states_single":
        return expect_error(lambda: fwd(s1), lambda out: compare_logits(out, ref["logits1"]))
    if kind in ("past_states_none_item", "past_states_tensor_item", "past_states_str_item"):
        bad = {
            "past_states_none_item": None,
            "past_states_tensor_item": torch.zeros(3),
            "past_states_str_item": "state",
        }[kind]
        return expect_error(lambda: fwd([s1, bad]))
    if kind == "past_states_nested_ok":
        return expect_error(lambda: fwd([[s1, s2]]), lambda out: compare_logits(out, ref["logits2"]))
    if kind == "past_states_nested_wrong_len":
        return expect_error(lambda: fwd([[s1], [s2]]))
    if kind == "past_states_dict":
        return expect_error(lambda: fwd({"a": s1}))
    if kind in ("composition_unknown", "composition_int"):
        return expect_error(
            lambda: fwd(composition=rng.choice(["nope", "PICASO_R", ""]) if kind == "composition_unknown" else 3)
        )
    if kind == "composition_none":
        return expect_error(
            lambda: fwd(composition=None),
            lambda out: compare_logits(out, ref["logits2"], "logits (default composition)"),
        )
    if kind.startswith("weights_"):
        weights = {
            "weights_negative": [1.5, -0.5],
            "weights_sum": [0.2, 0.2],
            "weights_len": [0.2, 0.3, 0.5],
            "weights_nan": [float("nan"), 1.0],
            "weights_str": ["a", "b"],
            "weights_missing": None,
        }[kind]
        return expect_error(lambda: fwd(composition=StateComposer("weighted", weights=weights)))
    if kind == "conv_unknown":
        return expect_error(lambda: StateComposer("soup", conv=rng.choice(["nope", 1, "Mean"])))
    if kind == "backend_unknown":
        return expect_error(lambda: StateComposer("soup", backend=rng.choice(["nope", "cuda", None])))
    if kind == "ids_float":
        return expect_error(lambda: fwd(q=query.float()))
    if kind == "ids_1d":
        return expect_error(
            lambda: fwd(q=query[0]), lambda out: compare_logits(out.reshape(ref["logits2"].shape), ref["logits2"])
        )
    if kind == "ids_3d":
        return expect_error(lambda: fwd(q=query[None]))
    if kind == "ids_empty":
        return expect_error(lambda: fwd(q=query[:, :0]))
    if kind in ("ids_oov", "ids_negative"):
        q = query.clone()
        q[0, rng.randrange(q.shape[1])] = VOCAB + rng.randrange(0, 100) if kind == "ids_oov" else -rng.randrange(1, 5)
        return expect_error(lambda: fwd(q=q))
    if kind == "ids_batch2":

        def check(out):
            ok = out.shape[0] == 2 and all(torch.equal(out[r : r + 1], ref["logits2"]) for r in range(2))
            return (
                handled("each row equals the reference")
                if ok
                else silent("a 2-row query with 1-row states: rows differ")
            )

        return expect_error(lambda: fwd(q=query.repeat(2, 1)), check)
    if kind.startswith("mask_"):
        mask = torch.ones_like(query)
        if kind == "mask_right_padding":
            q = torch.cat([query, torch.zeros(1, 2, dtype=torch.long)], 1)
            mask = torch.cat([mask, torch.zeros(1, 2, dtype=torch.long)], 1)
            return expect_error(
                lambda: fwd(q=q, attention_mask=mask),
                lambda out: compare_logits(out[:, : query.shape[1]], ref["logits2"], "logits of the real tokens"),
            )
        if kind == "mask_all_zero":
            mask.zero_()
        elif kind == "mask_shape":
            mask = torch.ones(1, query.shape[1] + 2, dtype=torch.long)
        elif kind == "mask_float_half":
            mask = torch.full(query.shape, 0.5)
        elif kind == "mask_value_2":
            mask = mask * 2
        return expect_error(lambda: fwd(attention_mask=mask))
    if kind == "generate_right_padding":
        q = torch.cat([query, torch.zeros(1, 2, dtype=torch.long)], 1)
        mask = torch.cat([torch.ones_like(query), torch.zeros(1, 2, dtype=torch.long)], 1)

        def check(out):
            return (
                handled("right-padded query generates as unpadded")
                if torch.equal(out, ref["gen2"])
                else silent("right padding accepted: generated tokens differ from the unpadded query's")
            )

        return expect_error(lambda: generate_of(model, q, [s1, s2], attention_mask=mask), check)
    if kind == "both_cache":
        from hf_statecompose.state.cache import ComposableMambaCache as C

        return expect_error(lambda: model(query, past_states=[s1], cache_params=C.empty_for(model)))
    if kind == "positional_states":
        # the attention mask by position, the states by name: refused ("by name") or the same logits
        return expect_error(
            lambda: logits_of_positional(model, query, [s1, s2]), lambda out: compare_logits(out, ref["logits2"])
        )
    # ------------------------------------------------------------------ encode
    ids = ids_of(7, seed=params["seed"] % 1000)
    with torch.no_grad():
        if kind == "encode_str":
            return expect_error(lambda: hsc.encode(model, "some text"))
        if kind == "encode_list":
            return expect_error(
                lambda: hsc.encode(model, ids[0].tolist()), lambda st: _state_check(st, hsc.encode(model, ids))
            )
        if kind == "encode_float":
            return expect_error(lambda: hsc.encode(model, ids.float()))
        if kind == "encode_3d":
            return expect_error(lambda: hsc.encode(model, ids[None]))
        if kind == "encode_empty":
            return expect_error(lambda: hsc.encode(model, ids[:, :0]))
        if kind in ("encode_oov", "encode_negative"):
            bad = ids.clone()
            bad[0, rng.randrange(bad.shape[1])] = VOCAB + 3 if kind == "encode_oov" else -2
            return expect_error(lambda: hsc.encode(model, bad))
        if kind == "encode_right_padding":
            padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
            mask = torch.cat([torch.ones_like(ids), torch.zeros(1, 3, dtype=torch.long)], 1)
            return expect_error(
                lambda: hsc.encode(model, padded, attention_mask=mask),
                lambda st: _state_check(st, hsc.encode(model, ids)),
            )
        if kind == "encode_pad_no_mask":
            padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
            return expect_error(lambda: hsc.encode(model, padded), lambda st: _state_check(st, hsc.encode(model, ids)))
        if kind == "encode_not_model":
            return expect_error(lambda: hsc.encode(rng.choice([None, "mamba", torch.nn.Linear(2, 2)]), ids))
        if kind == "encode_backend":
            return expect_error(lambda: hsc.encode(model, ids, backend=rng.choice(["nope", 3])))
    # ------------------------------------------------------------------ composer / setup
    if kind == "compose_empty":
        return expect_error(lambda: StateComposer("picaso_r").compose([]))
    if kind == "compose_non_state":
        return expect_error(lambda: StateComposer("soup").compose([s1, rng.choice([None, 3, torch.zeros(2)])]))
    if kind == "compose_method_unknown":
        return expect_error(lambda: hsc.compose_states([s1, s2], method=rng.choice(["nope", 7, None])))
    if kind == "compose_concat_no_model":
        return expect_error(lambda: StateComposer("concat").compose([s1, s2]))
    if kind == "compose_weights_nan":
        return expect_error(lambda: StateComposer("weighted", weights=[float("inf"), 0.0]).compose([s1, s2]))
    if kind == "enable_not_model":
        return expect_error(lambda: hsc.enable(rng.choice([None, "model", torch.nn.Linear(2, 2)])))
    if kind == "set_backend_unknown":
        return expect_error(lambda: hsc.set_backend(model, rng.choice(["nope", "cuda", 1])))
    if kind == "fingerprint_not_model":
        return expect_error(lambda: hsc.model_fingerprint(rng.choice([None, "m", torch.nn.Linear(2, 2)])))
    tmp = tempfile.mkdtemp(dir=ctx.workdir)
    if kind == "save_to_dir":
        return expect_error(lambda: s1.save(tmp))
    if kind == "save_missing_dir":
        return expect_error(lambda: s1.save(os.path.join(tmp, "missing", "x.safetensors")))
    if kind == "save_not_state":
        from hf_statecompose.state.serialization import save_state

        return expect_error(lambda: save_state(rng.choice([None, {"ssm": 1}, torch.zeros(2)]), os.path.join(tmp, "x")))
    path = os.path.join(tmp, "s.safetensors")
    s1.save(path)
    if kind == "load_dir":
        return expect_error(lambda: ComposableMambaCache.load(tmp, model=model))
    if kind == "load_none":
        return expect_error(lambda: ComposableMambaCache.load(None, model=model))
    if kind == "load_model_str":
        return expect_error(lambda: ComposableMambaCache.load(path, model="mamba"))
    if kind == "load_device_bad":
        return expect_error(lambda: ComposableMambaCache.load(path, model=model, device=rng.choice(["nope", 3.5])))
    raise ValueError(kind)


def _state_check(actual, expected):
    a, b = state_dict_of(actual), state_dict_of(expected)
    for name in sorted(b["tensors"]):
        x, y = a["tensors"].get(name), b["tensors"][name]
        if x is None or x.shape != y.shape or x.dtype != y.dtype:
            return silent(f"state differs from encoding the real tokens alone ({name} shape/dtype)")
        if name.startswith(("resample.clock", "resample.times")):
            if int((x - y).abs().max()) > 64:
                return silent(f"state differs from encoding the real tokens alone ({name})")
        elif x.is_floating_point():
            if not torch.allclose(x, y, rtol=1e-4, atol=1e-5):
                return silent(f"state differs from encoding the real tokens alone ({name})")
        elif not torch.equal(x, y):
            return silent(f"state differs from encoding the real tokens alone ({name})")
    return handled("equal to encoding the real tokens alone")


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "c", "api", "API misuse"
RUNNERS = {"api": run_api_case}


def generate(rng, scale, backends):
    return gen_api(rng, scale)
