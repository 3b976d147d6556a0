"""Family k of the adversarial trial (issue 29, item 8): ``generate(..., attention=...)``, what users try first to
place a hybrid's keys. ``attention="shared"`` / ``"none"`` beside a method name must equal
``StateComposer(method, attention=...)`` (and, to show the case can fail, differ from the default placement); an
unknown value, a conflicting ``StateComposer``, and ``attention=`` without ``past_states`` are refused."""

from __future__ import annotations

import random

import torch

import hf_statecompose as hsc
from hf_statecompose import StateComposer

from .common import build_hybrid, expect_error, handled, ids_of, silent

VALID = ("shared_generate", "none_generate", "shared_forward")
INVALID = ("unknown_value", "wrong_case", "non_string", "conflicting_composer", "without_past_states")
KINDS = VALID + INVALID
CI = ("shared_generate", "shared_forward", "unknown_value", "conflicting_composer")


def run_attention_case(ctx, params):
    kind = params["mutation"]
    model = build_hybrid(seed=params["seed"] % 1000, attention_first=False)
    states = [hsc.encode(model, ids_of(5, seed=params["seed"])), hsc.encode(model, ids_of(9, seed=params["seed"] + 1))]
    query = ids_of(4, seed=params["seed"] + 2)
    if kind in VALID:
        placement = kind.split("_")[0]

        def run(**kwargs):
            with torch.no_grad():
                if kind.endswith("forward"):
                    return model(query, past_states=states, **kwargs).logits
                out = model.generate(
                    query, past_states=states, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                    output_logits=True, **kwargs,
                )  # fmt: skip
                return torch.stack(out.logits, 1)

        composer = run(composition=StateComposer("soup", attention=placement))
        default = run(composition="soup")
        if torch.equal(composer, default):
            return handled(f"(placement {placement!r} gives the default's logits here: no evidence)")
        given = run(composition="soup", attention=placement)
        if torch.equal(given, composer):
            return handled(f"attention={placement!r} equals StateComposer('soup', attention={placement!r})")
        if torch.equal(given, default):
            return silent(f"attention={placement!r} ignored: the default placement's logits")
        return silent(f"attention={placement!r}: logits of neither placement")
    if kind == "unknown_value":
        return expect_error(lambda: model.generate(query, past_states=states, attention="shard", max_new_tokens=1))
    if kind == "wrong_case":
        return expect_error(lambda: model(query, past_states=states, attention="SHARED"))
    if kind == "non_string":
        return expect_error(lambda: model(query, past_states=states, attention=1))
    if kind == "conflicting_composer":
        composer = StateComposer("soup", attention="concat")
        return expect_error(lambda: model(query, past_states=states, composition=composer, attention="shared"))
    if kind == "without_past_states":
        return expect_error(lambda: model(query, attention="shared"))
    raise AssertionError(kind)


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "k", "attention_kwarg", "generate(attention=)"
RUNNERS = {"attention_kwarg": run_attention_case}


def generate(rng: random.Random, scale, backends):
    kinds = KINDS if scale == "full" else CI
    return [
        (CATEGORY, "attention_kwarg", {"mutation": k, "arch": "bamba", "seed": rng.randrange(1 << 30)}) for k in kinds
    ]
