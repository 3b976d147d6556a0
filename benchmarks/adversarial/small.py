"""Family l of the adversarial trial (issue 29, item 9): small ones. A model with ``A_log = -inf`` somewhere (decay
exactly 1) must compose its own states (refusing them as "altered" is a false message: outcome ``unclear``);
store metadata with a lone surrogate must be refused by a message that names the metadata."""

from __future__ import annotations

import os
import random

import torch

import hf_statecompose as hsc

from .common import build_model, classify_exception, close_logits, ids_of, open_store

KINDS = ("a_log_minus_inf_one_state", "a_log_minus_inf_compose", "metadata_lone_surrogate", "metadata_surrogate_key")


def run_small_case(ctx, params):
    kind = params["mutation"]
    if kind.startswith("a_log"):
        arch = params["arch"]
        model = build_model(arch, seed=params["seed"] % 1000)
        with torch.no_grad():
            model.backbone.layers[0].mixer.A_log.view(-1)[0] = float("-inf")  # A = -exp(-inf) = 0: decay 1
        context, other, query = (ids_of(n, seed=params["seed"] + k) for k, n in enumerate((9, 6, 4)))
        with torch.no_grad():
            reference = model(torch.cat([context, query], 1)).logits[:, context.shape[1] :]
            states = [hsc.encode(model, context), hsc.encode(model, other)]
            try:
                if kind.endswith("one_state"):
                    logits = model(query, past_states=states[:1]).logits
                    return close_logits(logits, reference, what="one state + query")
                composed = model(query, past_states=states, composition="soup").logits
            except ValueError as error:  # a refusal of the model's own states: its message is false
                verdict = classify_exception(error)
                return {"outcome": "unclear", "detail": "refused the model's own states: " + verdict["detail"]}
        if not bool(torch.isfinite(composed).all()):
            return {"outcome": "silent", "detail": "composed logits not finite"}
        return {"outcome": "handled", "detail": "composed (finite)"}
    folder = os.path.join(ctx.workdir, f"surrogate-{os.getpid()}")
    store = open_store(ctx, "folder", folder)
    metadata = {"note": "a\ud800b"} if kind == "metadata_lone_surrogate" else {"a\udc00": "x"}
    try:
        store.add(["a passage"], metadata=[metadata], show_progress=False)
    except BaseException as error:  # noqa: BLE001 (classified, then: does it say metadata?)
        verdict = classify_exception(error)
        if verdict["outcome"] == "clear" and "metadata" not in str(error):
            return {"outcome": "unclear", "detail": verdict["detail"] + " (does not mention metadata)"}
        return verdict
    return {"outcome": "silent", "detail": "metadata with a lone surrogate accepted"}


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "l", "small", "A_log, metadata"
RUNNERS = {"small": run_small_case}


def generate(rng: random.Random, scale, backends):
    cases = []
    for kind in KINDS:
        archs = ("mamba", "mamba2") if kind.startswith("a_log") and scale == "full" else ("mamba2",)
        cases += [(CATEGORY, "small", {"mutation": kind, "arch": a, "seed": rng.randrange(1 << 30)}) for a in archs]
    return cases
