"""Family e of the adversarial trial: CLI."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .common import (
    PROG_ERROR,
    ROOT,
    STORE_TEXTS,
    handled,
    silent,
)

CLI_KINDS = (
    "no_command",
    "unknown_command",
    "build_missing_input",
    "build_store_is_file",
    "build_bad_jsonl",
    "build_blank_input",
    "build_bad_model",
    "build_bad_batch",
    "query_no_store",
    "query_empty_text",
    "query_k_negative",
    "query_bad_composition",
    "query_corrupt_header",
    "query_flipped_manifest",
    "stats_on_file",
    "stats_not_store",
    "delete_bad_id",
    "delete_absent_id",
    "compact_not_store",
    "migrate_dest_is_file",
    "migrate_src_missing",
    "encode_corpus_missing_input",
    "build_latin1",
    "query_ok",
    "stats_ok",
    "subprocess_no_args",
    "subprocess_bad_k",
    "subprocess_help",
)
CLI_CI = (
    "no_command",
    "build_store_is_file",
    "build_bad_jsonl",
    "query_no_store",
    "query_corrupt_header",
    "stats_on_file",
    "delete_bad_id",
    "delete_absent_id",
    "migrate_dest_is_file",
    "query_ok",
    "subprocess_no_args",
    "subprocess_bad_k",
)


def gen_cli(rng, scale):
    kinds = CLI_KINDS if scale == "full" else CLI_CI
    reps = 2 if scale == "full" else 1
    return [
        ("e", "cli", {"mutation": k, "seed": rng.randrange(1 << 30)})
        for k in kinds
        for _ in range(reps if k.startswith("query_flip") else 1)
    ]


def cli_setup(ctx):
    """A store built by the CLI with the embedded demo model (once, in a subprocess)."""
    folder = os.path.join(ctx.workdir, "cli")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "passages.jsonl"), "w") as handle:
        handle.write("".join(json.dumps({"text": t}) + "\n" for t in STORE_TEXTS[:3]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_statecompose",
            "build",
            os.path.join(folder, "store"),
            os.path.join(folder, "passages.jsonl"),
            "--model",
            "demo",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    if done.returncode != 0:
        raise RuntimeError(f"CLI setup failed: {done.stderr[-2000:]}")
    ctx.cli_store = os.path.join(folder, "store")


def _cli_outcome(code, err, out, expect_ok=None) -> dict:
    lines = err.strip().splitlines()
    if (
        code == 2
        and len(lines) == 1
        and lines[0].startswith(PROG_ERROR)
        and "Traceback" not in err
        and len(lines[0]) <= 400 + len(PROG_ERROR)
    ):
        return {"outcome": "clear", "detail": lines[0][:300]}
    if code == 0:
        if expect_ok is None:
            return silent(f"exit 0 for a user error (stdout {out.strip()[:80]!r})")
        return expect_ok(out)
    return {"outcome": "unclear", "detail": f"exit {code}, {len(lines)} stderr lines: {' | '.join(lines[-2:])[:300]}"}


def run_cli_case(ctx, params):
    kind = params["mutation"]
    rng = random.Random(params["seed"])
    tmp = tempfile.mkdtemp(dir=ctx.workdir)
    a_file = os.path.join(tmp, "a_file")
    with open(a_file, "w") as handle:
        handle.write("x")
    good = os.path.join(ctx.workdir, "cli", "passages.jsonl")
    store = os.path.join(tmp, "store")
    shutil.copytree(ctx.cli_store, store)
    if kind.startswith("subprocess_"):
        argv = {
            "subprocess_no_args": [],
            "subprocess_bad_k": ["query", store, "fox", "-k", "-3"],
            "subprocess_help": ["--help"],
        }[kind]
        done = subprocess.run(
            [sys.executable, "-m", "hf_statecompose", *argv],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
        return _cli_outcome(
            done.returncode,
            done.stderr,
            done.stdout,
            (lambda out: handled("help printed") if "usage" in out else silent("no help"))
            if kind == "subprocess_help"
            else None,
        )
    bad_jsonl = os.path.join(tmp, "bad.jsonl")
    with open(bad_jsonl, "w") as handle:
        handle.write('{"text": "fine"}\n{oops\n')
    blank = os.path.join(tmp, "blank.txt")
    with open(blank, "w") as handle:
        handle.write("\n\n  \n")
    latin1 = os.path.join(tmp, "latin1.txt")
    with open(latin1, "wb") as handle:
        handle.write("caf\xe9 au lait\n".encode("latin-1"))
    expect_ok = None
    if kind in ("query_corrupt_header", "query_flipped_manifest"):
        target = (
            os.path.join(store, "store.json")
            if kind == "query_corrupt_header"
            else os.path.join(
                store,
                "shards",
                rng.choice([n for n in os.listdir(os.path.join(store, "shards")) if n.endswith(".json")]),
            )
        )
        data = bytearray(Path(target).read_bytes())
        data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
        Path(target).write_bytes(bytes(data))
    argv = {
        "no_command": [],
        "unknown_command": ["frobnicate"],
        "build_missing_input": ["build", os.path.join(tmp, "new"), os.path.join(tmp, "missing.jsonl")],
        "build_store_is_file": ["build", a_file, good, "--model", "demo"],
        "build_bad_jsonl": ["build", os.path.join(tmp, "new"), bad_jsonl, "--model", "demo"],
        "build_blank_input": ["build", os.path.join(tmp, "new"), blank, "--model", "demo"],
        "build_bad_model": ["build", os.path.join(tmp, "new"), good, "--model", tmp],
        "build_bad_batch": ["build", os.path.join(tmp, "new"), good, "--batch-size", "0"],
        "build_latin1": ["build", os.path.join(tmp, "new"), latin1, "--model", "demo"],
        "query_no_store": ["query", os.path.join(tmp, "nowhere"), "fox"],
        "query_empty_text": ["query", store, "  "],
        "query_k_negative": ["query", store, "fox", "-k", "-1"],
        "query_bad_composition": ["query", store, "fox", "--composition", "nope"],
        "query_corrupt_header": ["query", store, "red fox", "--max-new-tokens", "2"],
        "query_flipped_manifest": ["query", store, "red fox", "--max-new-tokens", "2"],
        "stats_on_file": ["stats", a_file],
        "stats_not_store": ["stats", tmp],
        "delete_bad_id": ["delete", store, "../../etc"],
        "delete_absent_id": ["delete", store, "0123456789abcdef"],
        "compact_not_store": ["compact", tmp],
        "migrate_dest_is_file": ["store", "migrate", store, a_file],
        "migrate_src_missing": ["store", "migrate", os.path.join(tmp, "nope"), os.path.join(tmp, "dst")],
        "encode_corpus_missing_input": ["encode-corpus", os.path.join(tmp, "dst"), os.path.join(tmp, "missing.jsonl")],
        "query_ok": ["query", store, "red fox", "-k", "1", "--max-new-tokens", "2", "--json"],
        "stats_ok": ["stats", store],
    }[kind]
    if kind == "query_ok":
        expect_ok = lambda out: (
            handled("query answered") if json.loads(out).get("passages") or json.loads(out) else silent("empty answer")
        )
    elif kind == "stats_ok":
        expect_ok = lambda out: (
            handled("stats") if json.loads(out).get("entries") == 3 else silent(f"stats: {out[:80]}")
        )
    elif kind == "query_flipped_manifest":
        expect_ok = None
    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd_out = os.open(out_path, os.O_WRONLY | os.O_CREAT)
            fd_err = os.open(err_path, os.O_WRONLY | os.O_CREAT)
            os.dup2(fd_out, 1)
            os.dup2(fd_err, 2)
            sys.stdout = os.fdopen(1, "w", buffering=1)
            sys.stderr = os.fdopen(2, "w", buffering=1)
            from hf_statecompose.cli import main

            try:
                code = main(argv) or 0
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else 1
            except BaseException:  # noqa: BLE001 (an uncaught error: its traceback, as the interpreter would print it)
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done_pid, status = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"outcome": "hang", "detail": "CLI call ran past 120 s"}
        time.sleep(0.02)
    code = os.waitstatus_to_exitcode(status)
    err = Path(err_path).read_text(errors="replace")
    out = Path(out_path).read_text(errors="replace")
    if kind in ("query_corrupt_header", "query_flipped_manifest") and code == 0:
        return (
            handled("a flipped byte without effect on the answer")
            if "red fox" in out or out
            else silent("empty answer")
        )
    return _cli_outcome(code, err, out, expect_ok)


# ------------------------------------------------------------------------------------------------ the family
CATEGORY, NAME, TITLE = "e", "cli", "CLI"
RUNNERS = {"cli": run_cli_case}


def generate(rng, scale, backends):
    return gen_cli(rng, scale)
