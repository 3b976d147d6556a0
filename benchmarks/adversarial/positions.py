"""Family h of the adversarial trial (issue 29, item 5): hybrid key positions that no encode can produce, set in
memory (``set_positions``) or in a resealed state file: a gap, an offset far beyond the context, a maximum whose
``max + 1`` overflows int64; and, as controls, a value below -1 and padding after a real key (both refused before
issue 29). Accepted, the state is compared with the context + query it claims to be (logits within 1e-4)."""

from __future__ import annotations

import os
import random

import torch

import hf_statecompose as hsc

from .common import _parsed, _resave, build_hybrid, close_logits, ids_of

INT64_MAX = torch.iinfo(torch.int64).max
KINDS = ("gap", "far_offset", "int64_overflow", "below_minus_one", "padding_after_key")
WHERE = ("memory", "file")
CI = (("gap", "memory"), ("far_offset", "file"), ("int64_overflow", "memory"), ("below_minus_one", "file"))


def _bad_positions(kind, length):
    positions = torch.arange(length, dtype=torch.long)[None]
    if kind == "gap":
        return torch.where(positions >= length // 2, positions + 7, positions)
    if kind == "far_offset":
        return positions + 10**6
    if kind == "int64_overflow":
        return torch.cat([positions[:, :-1], torch.tensor([[INT64_MAX]])], dim=-1)
    if kind == "below_minus_one":
        return torch.cat([torch.tensor([[-5]]), positions[:, 1:]], dim=-1)
    if kind == "padding_after_key":
        return torch.cat([positions[:, :-1], torch.tensor([[-1]])], dim=-1)
    raise AssertionError(kind)


def run_positions_case(ctx, params):
    kind, where = params["mutation"], params["variant"]
    model = build_hybrid(seed=params["seed"] % 1000)
    context, query = ids_of(8, seed=params["seed"]), ids_of(4, seed=params["seed"] + 1)
    with torch.no_grad():
        reference = model(torch.cat([context, query], 1)).logits[:, context.shape[1] :]
        state = hsc.encode(model, context)
    bad = _bad_positions(kind, state.context_length)
    if where == "memory":
        state.set_positions(bad)
        loaded = state
    else:
        path = os.path.join(ctx.workdir, f"positions-{os.getpid()}.safetensors")
        state.save(path)
        with open(path, "rb") as handle:
            tensors, meta = _parsed(handle.read())
        for name in list(tensors):
            if "positions" in name:
                tensors[name] = bad.clone()
        with open(path, "wb") as handle:
            handle.write(_resave(tensors, meta))
        loaded = hsc.ComposableMambaCache.load(path)  # refusing here (or at use) is the fix
    with torch.no_grad():
        logits = model(query, past_states=[loaded]).logits
    return close_logits(logits, reference, what=f"logits with {kind} key positions")


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "h", "positions", "hybrid key positions"
RUNNERS = {"positions": run_positions_case}


def generate(rng: random.Random, scale, backends):
    pairs = [(k, w) for k in KINDS for w in WHERE] if scale == "full" else list(CI)
    return [
        (CATEGORY, "positions", {"mutation": k, "variant": w, "arch": "bamba", "seed": rng.randrange(1 << 30)})
        for k, w in pairs
    ]
