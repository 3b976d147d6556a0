"""Family j of the adversarial trial (issue 29, item 7): errors of a Lance store, worded as the folder store's. On a
read-only store ``compact()``, ``add`` and ``delete`` must raise ``PermissionError`` naming the store (today:
``compact`` returns normally, ``add`` / ``delete`` surface ``RuntimeError: lance error ... object_store.rs``); the
folder store is the control. An oracle beyond the classifier: the error must name the store's path."""

from __future__ import annotations

import os
import random

from .common import STORE_TEXTS, classify_exception, open_store, silent

KINDS = ("readonly_compact", "readonly_add", "readonly_delete")


def _read_only(path):
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o555)
        for name in files:
            os.chmod(os.path.join(root, name), 0o444)


def run_lance_error_case(ctx, params):
    kind, backend = params["mutation"], params["backend"]
    folder = os.path.join(ctx.workdir, f"{backend}-{kind}-{os.getpid()}")
    os.makedirs(folder)
    path = os.path.join(folder, "store")
    store = open_store(ctx, backend, path)
    ids = store.add(STORE_TEXTS[:3], show_progress=False)
    store.delete(ids[:1])  # something for compact to do
    del store
    os.chmod(ctx.workdir, 0o755)
    os.chmod(folder, 0o755)
    _read_only(path)
    if os.getuid() == 0:  # root ignores modes: drop to nobody (this child only)
        os.setgid(65534)
        os.setuid(65534)
    store = open_store(ctx, backend, path)
    call = {
        "readonly_compact": store.compact,
        "readonly_add": lambda: store.add(["a new passage"], show_progress=False),
        "readonly_delete": lambda: store.delete(ids[1:2]),
    }[kind]
    try:
        call()
    except BaseException as error:  # noqa: BLE001 (classified, then the store's name is checked)
        verdict = classify_exception(error)
        if verdict["outcome"] == "clear" and not isinstance(error, OSError):
            return {"outcome": "unclear", "detail": verdict["detail"] + " (not a PermissionError / OSError)"}
        if verdict["outcome"] == "clear" and "store" not in str(error) and path not in str(error):
            return {"outcome": "unclear", "detail": verdict["detail"] + " (does not name the store)"}
        return verdict
    return silent(f"{kind.split('_')[1]} on a read-only {backend} store returned normally")


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "j", "lance_errors", "read-only store errors"
RUNNERS = {"lance_errors": run_lance_error_case}


def generate(rng: random.Random, scale, backends):
    chosen = [b for b in ("lance", "folder") if b in backends]
    return [
        (CATEGORY, "lance_errors", {"mutation": k, "backend": b, "seed": rng.randrange(1 << 30)})
        for k in KINDS
        for b in chosen
    ]
