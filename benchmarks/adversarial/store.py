"""Family d of the adversarial trial: store (folder + lance)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import signal
import tempfile
import time
from pathlib import Path

import torch

from .common import (
    NEW_TEXTS,
    _write_all,
    classify_exception,
    expect_error,
    handled,
    lost,
    open_store,
    run_forked,
    silent,
    state_dict_of,
)

STORE_KINDS = (
    "control",
    "flip",
    "truncate",
    "symlink_store",
    "symlink_shards",
    "symlink_deleted",
    "forged_manifest",
    "path_is_file",
    "parent_is_file",
    "add_bad",
    "readd",
    "readd_ids",
    "bad_ids",
    "get_A_inplace",
    "get_ssm_inplace",
    "concurrent_same",
    "concurrent_disjoint",
    "readonly",
    "wrong_model",
    "header_missing",
    "delete_compact",
    "kill_add",
    "kill_delete",
    "kill_compact",
)
ADD_BAD = (
    "None",
    "[None]",
    "[blank]",
    "str",
    "metadata_dict",
    "metadata_obj",
    "batch0",
    "batch_bool",
    "[bytes]",
    "[int]",
    "[]",
)
BAD_IDS = (
    "get_short",
    "get_int",
    "get_empty_list",
    "get_absent",
    "delete_absent",
    "delete_empty",
    "delete_traversal",
    "entries_bad",
    "retrieve_k_negative",
    "retrieve_k_str",
    "retrieve_empty",
    "retrieve_exclude_str",
    "retrieve_none",
    "get_upper",
)
FOLDER_ONLY = ("symlink_shards", "symlink_deleted", "forged_manifest", "header_missing")
LANCE_ONLY = ("readd_ids",)


def gen_store(rng, scale, backends):
    counts = {
        "flip": 12,
        "truncate": 6,
        "add_bad": len(ADD_BAD),
        "bad_ids": len(BAD_IDS),
        "kill_add": 10,
        "kill_delete": 14,
        "kill_compact": 10,
        "concurrent_same": 3,
        "concurrent_disjoint": 2,
        "forged_manifest": 3,
    }
    ci = {
        "flip": 4,
        "truncate": 2,
        "add_bad": 4,
        "bad_ids": 5,
        "kill_add": 3,
        "kill_delete": 4,
        "kill_compact": 3,
        "concurrent_same": 1,
        "concurrent_disjoint": 1,
        "forged_manifest": 1,
    }
    cases = []
    for backend in backends:
        for kind in STORE_KINDS:
            if (kind in FOLDER_ONLY and backend != "folder") or (kind in LANCE_ONLY and backend != "lance"):
                continue
            n = (counts if scale == "full" else ci).get(kind, 1)
            for i in range(n):
                params = {"backend": backend, "mutation": kind, "seed": rng.randrange(1 << 30)}
                if kind == "add_bad":
                    params["variant"] = ADD_BAD[i % len(ADD_BAD)] if scale == "full" else rng.choice(ADD_BAD)
                if kind == "bad_ids":
                    params["variant"] = BAD_IDS[i % len(BAD_IDS)] if scale == "full" else rng.choice(BAD_IDS)
                cases.append(("d", "store", params))
    return cases


def _copy_store(ctx, backend):
    dst = os.path.join(tempfile.mkdtemp(dir=ctx.workdir), "store")
    shutil.copytree(ctx.store_refs[backend]["path"], dst, symlinks=True)
    return dst


def _verify_store(ctx, backend, path, expect_ids=None, gone=(), extra=None, model=None) -> dict:
    """Reopen and read every entry: texts, states and retrieval against the reference. Returns handled / silent
    (for a case without a kill) with what differs; an exception propagates (classified)."""
    ref = ctx.store_refs[backend]
    store = open_store(ctx, backend, path, model=model)
    expect_ids = set(ref["ids"]) - set(gone) if expect_ids is None else set(expect_ids)
    have = set(store.ids())
    missing = sorted(expect_ids - have)
    if missing:
        return {"outcome": "missing", "detail": f"{len(missing)} entries missing after reopening ({missing[:2]})"}
    reappeared = sorted(set(gone) & have)
    if reappeared:
        return {"outcome": "wrong", "detail": f"deleted entries present: {reappeared[:2]}"}
    known = [i for i in sorted(expect_ids) if i in ref["tensors"]]
    for entry_id, state, entry in zip(known, store.get(known), store.entries(known)):
        if entry.text != ref["texts"][entry_id]:
            return {"outcome": "wrong", "detail": f"entry {entry_id} text differs"}
        tensors = state_dict_of(state)["tensors"]
        for name, t in ref["tensors"][entry_id].items():
            if name not in tensors or not torch.equal(tensors[name], t):
                return {"outcome": "wrong", "detail": f"entry {entry_id} tensor {name} differs"}
    for entry_id in known[:2]:
        top = store.retrieve(ref["texts"][entry_id], k=1, load_states=False)
        if not top or top[0].id != entry_id:
            return {"outcome": "wrong", "detail": f"retrieve(text of {entry_id}) did not return it"}
    extra_ids = sorted(have - expect_ids)
    if extra is not None:
        return extra(store, have)
    if extra_ids:
        return {"outcome": "wrong", "detail": f"{len(extra_ids)} unexpected entries"}
    return {"outcome": "ok", "detail": f"{len(have)} entries verified"}


def _as_case(verdict: dict, bad="silent") -> dict:
    if verdict["outcome"] == "ok":
        return handled(verdict["detail"])
    return {"outcome": bad, "detail": verdict["detail"]}


def _store_files(path):
    out = []
    for root, _, files in os.walk(path):
        for name in files:
            if name != ".lock":
                out.append(os.path.join(root, name))
    return sorted(out)


def _snapshot(folder):
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                out[os.path.relpath(os.path.join(root, name), folder)] = handle.read()
    return out


def run_store_case(ctx, params):
    backend, kind = params["backend"], params["mutation"]
    rng = random.Random(params["seed"])
    ref = ctx.store_refs[backend]
    if kind.startswith("kill_"):
        return run_kill_trial(ctx, backend, kind, rng)
    if kind.startswith("concurrent_"):
        return run_concurrent(ctx, backend, kind, rng)
    if kind == "readonly":
        return run_readonly(ctx, backend)
    path = _copy_store(ctx, backend)
    if kind == "control":
        return _as_case(_verify_store(ctx, backend, path))
    if kind in ("flip", "truncate"):
        target = rng.choice(_store_files(path))
        with open(target, "rb") as handle:
            data = bytearray(handle.read())
        if kind == "flip" and data:
            data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        else:
            data = data[: rng.randrange(len(data))] if data else data
        with open(target, "wb") as handle:
            handle.write(bytes(data))
        params["target"] = os.path.relpath(target, path)
        verdict = _verify_store(ctx, backend, path)
        if verdict["outcome"] == "ok":
            return handled(f"{params['target']} damaged: " + verdict["detail"])
        return silent(f"{params['target']} damaged and accepted: {verdict['detail']}")
    if kind == "symlink_store":
        link = path + "-link"
        os.symlink(path, link)
        return _as_case(_verify_store(ctx, backend, link))
    if kind in ("symlink_shards", "symlink_deleted"):
        sub = "shards" if kind == "symlink_shards" else "deleted"
        outside = os.path.join(os.path.dirname(path), "outside")
        shutil.copytree(os.path.join(path, sub), outside)
        shutil.rmtree(os.path.join(path, sub))
        os.symlink(outside, os.path.join(path, sub))
        sentinels = (
            [("0" * 32) + ".safetensors", ".tmp-user-notes", "notes.txt"]
            if sub == "shards"
            else ["0123456789abcdef", ".tmp-user", "notes.txt"]
        )
        for name in sentinels:
            with open(os.path.join(outside, name), "wb") as handle:
                handle.write(b"user data outside the store")
        before = {k: v for k, v in _snapshot(outside).items() if k in sentinels}
        store = open_store(ctx, backend, path)
        store.delete([ref["ids"][0]])
        store.compact()
        after = _snapshot(outside)
        changed = [k for k in before if after.get(k) != before[k]]
        if changed:
            return silent(f"{sub}/ is a symlink: compaction removed or changed files outside the store: {changed}")
        return _as_case(_verify_store(ctx, backend, path, gone=[ref["ids"][0]]))
    if kind == "forged_manifest":
        from hf_statecompose.store.format import seal as _seal
        from hf_statecompose.store.format import unseal as _unseal

        shards = sorted(p for p in os.listdir(os.path.join(path, "shards")) if p.endswith(".json"))
        victim, donor = rng.sample(shards, 2)
        manifest = _unseal(Path(path, "shards", donor), "manifest")
        import uuid

        forged = uuid.uuid4().hex
        shutil.copy(
            os.path.join(path, "shards", donor[:-5] + ".safetensors"),
            os.path.join(path, "shards", forged + ".safetensors"),
        )
        # a self-consistent manifest (sealed) for a copy of the donor shard, with all its entries, that claims to
        # supersede the donor and the victim: the victim's entries were neither deleted nor copied into it
        manifest.update(shard=forged, supersedes=sorted([victim[:-5], donor[:-5]]))
        with open(os.path.join(path, "shards", forged + ".json"), "wb") as handle:
            handle.write(_seal(manifest))
        store = open_store(ctx, backend, path)
        victims = [i for i in ref["ids"] if i not in store.ids()]
        store.compact()
        gone = [i for i in ref["ids"] if i not in open_store(ctx, backend, path).ids()]
        if gone:
            return silent(
                f"a forged manifest superseding shard {victim[:8]} made {len(gone)} entries vanish without an error "
                f"(before compaction: {len(victims)})"
            )
        return handled("forged manifest without effect")
    if kind == "path_is_file":
        file_path = os.path.join(os.path.dirname(path), "a_file")
        with open(file_path, "w") as handle:
            handle.write("x")
        return expect_error(lambda: open_store(ctx, backend, file_path))
    if kind == "parent_is_file":
        file_path = os.path.join(os.path.dirname(path), "a_file")
        with open(file_path, "w") as handle:
            handle.write("x")
        return expect_error(lambda: open_store(ctx, backend, os.path.join(file_path, "store")))
    store = open_store(ctx, backend, path)
    if kind == "add_bad":
        variant = params["variant"]
        call = {
            "None": lambda: store.add(None, show_progress=False),
            "[None]": lambda: store.add([None], show_progress=False),
            "[blank]": lambda: store.add(["   "], show_progress=False),
            "str": lambda: store.add("some text", show_progress=False),
            "metadata_dict": lambda: store.add(["new text"], metadata={"a": 1}, show_progress=False),
            "metadata_obj": lambda: store.add(["new text"], metadata=[{"a": object()}], show_progress=False),
            "batch0": lambda: store.add(["new text"], batch_size=0, show_progress=False),
            "batch_bool": lambda: store.add(["new text"], batch_size=True, show_progress=False),
            "[bytes]": lambda: store.add([b"bytes"], show_progress=False),
            "[int]": lambda: store.add([123], show_progress=False),
            "[]": lambda: store.add([], show_progress=False),
        }[variant]
        if variant == "[]":
            return expect_error(
                call,
                lambda ids: (
                    _as_case(_verify_store(ctx, backend, path)) if ids == [] else silent(f"add([]) returned {ids}")
                ),
            )
        return expect_error(call)
    if kind in ("readd", "readd_ids"):
        n = rng.randrange(1, 4)
        chosen = ref["ids"][:n]
        texts = [ref["texts"][i] for i in chosen]
        kwargs = {"ids": chosen} if kind == "readd_ids" else {}

        def check(ids):
            again = open_store(ctx, backend, path)
            stored = [e.text for e in again.entries(again.ids())]
            dup = sorted(t for t in set(stored) if stored.count(t) > 1)
            if dup or len(again) != len(ref["ids"]):
                return silent(f"re-adding {n} stored texts left {len(again)} entries (duplicates: {len(dup)})")
            return _as_case(_verify_store(ctx, backend, path))

        return expect_error(lambda: store.add(texts, show_progress=False, **kwargs), check)
    if kind == "bad_ids":
        variant = params["variant"]
        absent = "0123456789abcdef"
        calls = {
            "get_short": (lambda: store.get("zz"), None),
            "get_int": (lambda: store.get(5), None),
            "get_empty_list": (
                lambda: store.get([]),
                lambda out: handled() if out == [] else silent(f"get([]) -> {out!r:.40}"),
            ),
            "get_absent": (lambda: store.get([absent]), None),
            "delete_absent": (lambda: store.delete([absent]), None),
            "delete_empty": (lambda: store.delete([]), lambda _: _as_case(_verify_store(ctx, backend, path))),
            "delete_traversal": (lambda: store.delete(["../../../etc/passwd"]), None),
            "entries_bad": (lambda: store.entries(["x" * 16]), None),
            "retrieve_k_negative": (lambda: store.retrieve("fox", k=-1), None),
            "retrieve_k_str": (lambda: store.retrieve("fox", k="2"), None),
            "retrieve_empty": (
                lambda: store.retrieve("", k=1),
                lambda out: handled("empty query answered") if isinstance(out, list) else silent("?"),
            ),
            "retrieve_exclude_str": (
                lambda: store.retrieve("red fox", k=1, exclude=ref["ids"][0]),
                lambda out: (
                    handled("a str exclude read as one id")
                    if out and out[0].id != ref["ids"][0]
                    else silent("exclude=<one id as str> did not exclude it")
                ),
            ),
            "retrieve_none": (lambda: store.retrieve(None), None),
            "get_upper": (lambda: store.get(ref["ids"][0].upper()), None),
        }
        fn, accept = calls[variant]
        return expect_error(fn, accept)
    if kind in ("get_A_inplace", "get_ssm_inplace"):
        first, second = ref["ids"][0], ref["ids"][1]
        state = store.get(first)
        (state.A if kind == "get_A_inplace" else state.ssm_states)[0].mul_(2.0).add_(0.25)
        for entry_id in (first, second):
            again = state_dict_of(store.get(entry_id))["tensors"]
            for name, t in ref["tensors"][entry_id].items():
                if not torch.equal(again[name], t):
                    return silent(
                        f"editing a get() state's {'A' if kind == 'get_A_inplace' else 'ssm'} in place changed what "
                        f"get({'the same' if entry_id == first else 'another'} id) returns ({name})"
                    )
        return _as_case(_verify_store(ctx, backend, path))
    if kind == "wrong_model":
        return expect_error(lambda: open_store(ctx, backend, path, model=ctx.others["mamba2"]))
    if kind == "header_missing":
        os.remove(os.path.join(path, "store.json"))
        return expect_error(lambda: open_store(ctx, backend, path))
    if kind == "delete_compact":
        gone = rng.sample(ref["ids"], 2)
        store.delete(gone)
        store.compact()
        return _as_case(_verify_store(ctx, backend, path, gone=gone), bad="lost")
    raise ValueError(kind)


def run_readonly(ctx, backend):
    """The store (folder and files) read-only, opened and read by an unprivileged user (root ignores modes)."""
    path = _copy_store(ctx, backend)
    for folder in (ctx.workdir, os.path.dirname(path)):
        os.chmod(folder, 0o755)
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o555)
        for name in files:
            os.chmod(os.path.join(root, name), 0o444)
    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    return _as_case(_verify_store(ctx, backend, path))


def run_concurrent(ctx, backend, kind, rng):
    """Two processes add at the same time: the same texts (and, on Lance, the same ids) or different ones."""
    path = _copy_store(ctx, backend)
    import uuid

    same = kind == "concurrent_same"
    texts = [rng.sample(NEW_TEXTS, 3)] * 2 if same else [NEW_TEXTS[:3], NEW_TEXTS[3:]]
    ids = [uuid.uuid4().hex[:16] for _ in range(3)]
    start = time.time() + 1.5  # both open first, then add at once

    def writer(n):
        def fn():
            store = open_store(ctx, backend, path)
            time.sleep(max(0.0, start - time.time()))
            kwargs = {"ids": ids if same else [uuid.uuid4().hex[:16] for _ in range(3)]} if backend == "lance" else {}
            out = store.add(texts[n], show_progress=False, **kwargs)
            return {"outcome": "handled", "detail": json.dumps(out)}

        return fn

    results = [None, None]
    import threading

    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, run_forked(writer(n), 60))) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if r["outcome"] != "handled"]
    written = [json.loads(r["detail"]) for r in results if r["outcome"] == "handled"]

    def extra(store, have):
        entries = store.entries(sorted(have))
        stored = [e.text for e in entries]
        for out in written:
            if any(i not in have for i in out):
                return {"outcome": "missing", "detail": "an id returned by add() is missing"}
        expected_new = (
            len(texts[0]) if same else sum(len(t) for t, r in zip(texts, results) if r["outcome"] == "handled")
        )
        if len(have) != len(ctx.store_refs[backend]["ids"]) + expected_new or len(set(stored)) != len(stored):
            return {
                "outcome": "wrong",
                "detail": f"{len(have) - len(ctx.store_refs[backend]['ids'])} new entries for "
                f"{expected_new} texts (duplicates: {len(stored) - len(set(stored))})",
            }
        return {"outcome": "ok", "detail": "one copy of each text"}

    def check():
        try:
            return _verdict_case(_verify_store(ctx, backend, path, extra=extra))
        except Exception as error:  # noqa: BLE001
            return lost(f"store unreadable after two concurrent writers: {classify_exception(error)['detail']}")

    verdict = run_forked(check, 60)
    if verdict["outcome"] != "handled":
        return verdict
    # the store is right; a writer that was refused is judged by its error (a clear "busy" is fine)
    return min(errors, key=lambda r: r["outcome"] == "clear") if errors else verdict


def _verdict_case(verdict):
    return {"ok": handled, "missing": lost, "wrong": silent}[verdict["outcome"]](verdict["detail"])


def run_kill_trial(ctx, backend, kind, rng):
    """Fork a writer, SIGKILL it after a random delay during its operation, then reopen and check that no
    committed entry is lost and a multi-id delete is all or nothing."""
    path = _copy_store(ctx, backend)
    ref = ctx.store_refs[backend]
    op = kind[len("kill_") :]
    to_delete = rng.sample(ref["ids"], 3)
    if op == "compact":  # something to compact: delete two first (committed before the trial)
        pre = rng.sample(ref["ids"], 2)
        run_forked(lambda: (open_store(ctx, backend, path).delete(pre), handled())[1], 60)
    else:
        pre = []
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        try:
            store = open_store(ctx, backend, path)
            _write_all(w, b"S\n")
            if op == "add":
                for text in NEW_TEXTS:
                    out = store.add([text], show_progress=False)
                    _write_all(w, ("A" + json.dumps(out) + "\n").encode())
            elif op == "delete":
                store.delete(to_delete)
                _write_all(w, b"D\n")
            else:
                store.compact()
                _write_all(w, b"C\n")
            _write_all(w, b"E\n")
        finally:
            os._exit(0)
    os.close(w)
    buffer = b""
    deadline = time.monotonic() + 60
    delay = {"add": rng.uniform(0, 0.6), "delete": rng.uniform(0, 0.03), "compact": rng.uniform(0, 0.3)}[op]
    started = None
    while time.monotonic() < deadline:
        timeout = 0.005 if started is not None else deadline - time.monotonic()
        ready, _, _ = select.select([r], [], [], max(0.0, timeout))
        if ready:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buffer += chunk
            if started is None and b"S\n" in buffer:
                started = time.monotonic()
        if started is not None and time.monotonic() - started >= delay:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            break
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    with contextlib.suppress(BlockingIOError, OSError):
        os.set_blocking(r, False)
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buffer += chunk
    os.close(r)
    lines = buffer.decode(errors="replace").splitlines()
    added = [i for line in lines if line.startswith("A") for i in json.loads(line[1:])]
    delete_done = "D" in lines

    def check():
        store_ids_expected = set(ref["ids"]) - set(pre) | set(added)
        if op == "delete":
            try:
                store = open_store(ctx, backend, path)
            except Exception as error:  # noqa: BLE001
                return lost(f"store unopenable after kill -9 during delete: {classify_exception(error)['detail']}")
            have = set(store.ids())
            present = [i for i in to_delete if i in have]
            if delete_done and present:
                return lost(f"delete returned but {len(present)} of 3 entries are still present")
            if 0 < len(present) < 3:
                return lost(f"kill -9 during delete([a, b, c]): half applied ({3 - len(present)} of 3 deleted)")
            gone = [] if len(present) == 3 else to_delete
            verdict = _verify_store(ctx, backend, path, expect_ids=set(ref["ids"]) - set(gone), gone=gone)
        else:
            try:
                verdict = _verify_store(
                    ctx,
                    backend,
                    path,
                    expect_ids=store_ids_expected,
                    gone=pre,
                    extra=(lambda s, have: {"outcome": "ok", "detail": f"{len(have)} entries"})
                    if op == "add"
                    else None,
                )
            except Exception as error:  # noqa: BLE001
                return lost(
                    f"store unopenable / unreadable after kill -9 during {op}: {classify_exception(error)['detail']}"
                )
        if verdict["outcome"] == "ok":
            return handled(
                f"killed after {delay * 1000:.0f} ms ({'done' if 'E' in lines else 'mid-operation'}): {verdict['detail']}"
            )
        return lost(f"after kill -9 during {op} ({delay * 1000:.0f} ms): {verdict['detail']}")

    return run_forked(check, 60)


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "d", "store", "store (folder + lance)"
RUNNERS = {"store": run_store_case}


def generate(rng, scale, backends):
    return gen_store(rng, scale, backends)
