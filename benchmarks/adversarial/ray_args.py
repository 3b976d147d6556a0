"""Family f of the adversarial trial: Ray encode_corpus args."""

from __future__ import annotations

import os
import tempfile

from .common import (
    expect_error,
)

RAY_KINDS = (
    "passages_none",
    "passages_dict",
    "passages_int_item",
    "passages_missing_field",
    "passages_blank",
    "passages_missing_file",
    "passages_duplicate_ids",
    "passages_bad_metadata",
    "batch_zero",
    "cpus_zero",
    "model_path_int",
    "retriever_not_callable",
    "text_field_missing",
)
RAY_CI = ("passages_none", "passages_blank", "passages_duplicate_ids")


def gen_ray(rng, scale):
    return [
        ("f", "ray", {"mutation": k, "seed": rng.randrange(1 << 30)})
        for k in (RAY_KINDS if scale == "full" else RAY_CI)
    ]


def run_ray_case(ctx, params):
    """Argument misuse of ``encode_corpus``: refused before Ray starts (no cluster is started for these)."""
    from hf_statecompose.distributed import encode_corpus

    kind = params["mutation"]
    tmp = tempfile.mkdtemp(dir=ctx.workdir)
    store = os.path.join(tmp, "store")
    passages, kwargs = ["a fine passage", "another one"], {}
    if kind == "passages_none":
        passages = None
    elif kind == "passages_dict":
        passages = {"text": "x"}
    elif kind == "passages_int_item":
        passages = ["x", 5]
    elif kind == "passages_missing_field":
        passages = [{"body": "x"}]
    elif kind == "passages_blank":
        passages = ["fine", "   "]
    elif kind == "passages_missing_file":
        passages = os.path.join(tmp, "missing.jsonl")
    elif kind == "passages_duplicate_ids":
        passages = [{"text": "a", "id": "same"}, {"text": "b", "id": "same"}]
    elif kind == "passages_bad_metadata":
        passages = [{"text": "a", "when": float("nan")}]
    elif kind == "batch_zero":
        kwargs = {"batch_size": 0}
    elif kind == "cpus_zero":
        kwargs = {"cpus_per_actor": 0}
    elif kind == "model_path_int":
        return expect_error(lambda: encode_corpus(passages, 3, store, show_progress=False))
    elif kind == "retriever_not_callable":
        kwargs = {"retriever": "minilm"}
    elif kind == "text_field_missing":  # dicts without the named field (plain strings would be read as that field)
        passages, kwargs = [{"text": "a"}, {"text": "b"}], {"text_field": "body"}
    return expect_error(lambda: encode_corpus(passages, "demo", store, show_progress=False, **kwargs))


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "f", "ray_args", "Ray encode_corpus args"
RUNNERS = {"ray": run_ray_case}


def generate(rng, scale, backends):
    return gen_ray(rng, scale)
