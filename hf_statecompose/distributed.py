"""``encode_corpus``: encode a corpus into a Lance store on Ray Data (needs the ``[scale]`` extra).

The driver reads the passages, gives each an entry id (from its ``id`` field, else from its text),
drops the ids the store already holds, sorts the rest by length and hands them to Ray Data;
``map_batches`` runs :class:`_EncodeActor` on a pool of actors (one GPU each when the cluster has GPUs,
else ``cpus_per_actor`` CPUs each), so each actor loads the model once. Each call gets consecutive
passages of similar length, encodes them as one left-padded batch and commits them to the Lance store
itself (one Lance commit per batch, inserting only ids not stored yet): nothing goes back to the driver
but ids. A rerun skips what is stored; a worker killed mid-run loses no committed batch (Ray retries
its batch; the ids it had committed are skipped), and a rerun completes the set. What would make every
actor fail (a folder store, another model's or retriever's Lance store, a missing checkpoint) is refused
on the driver before Ray starts (:func:`check_before_ray`).

Nothing here is pickled by us: passages travel as Arrow strings (metadata as JSON), states as
safetensors bytes in Lance. Ray itself serializes the actor's constructor arguments (the model spec,
the retriever and loader factories) to start the actors.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable

from .compat import quiet_loading
from .store.format import check_count, checked_json
from .store.lance import DIMENSION_PROBE, HEADER_TABLE, STATES_TABLE, LanceStateStore, import_lancedb, read_lance_header


def entry_id_for(passage_id=None, text: str | None = None) -> str:
    """The store id of a passage: from its own id when it has one, else from its text (identical texts
    without ids are one entry)."""
    key = f"id:{passage_id}" if passage_id is not None else f"text:{text}"
    return hashlib.blake2b(key.encode("utf-8"), digest_size=8).hexdigest()


def load_model_spec(spec):
    """``(model, tokenizer)`` for ``"demo"`` / ``"demo-mamba"`` / ``"demo-mamba2"`` (the embedded demo
    models), a local checkpoint folder, or a zero-argument callable returning ``(model, tokenizer)``."""
    if callable(spec):
        model, tokenizer = spec()
    else:
        from .demo import DEMO_SPECS, load_demo

        if spec in DEMO_SPECS:
            return load_demo(DEMO_SPECS[spec])
        _checkpoint_config(spec)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(spec, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
        if not tokenizer("a")["input_ids"]:  # transformers makes an empty tokenizer from a config without vocabulary
            raise ValueError(
                f"model {os.fspath(spec)!r}: its tokenizer has no vocabulary (it turns text into no tokens); save the real one beside the model"
            )
    from .generation.integration import enable

    return enable(model), tokenizer


def _checkpoint_config(spec):
    """The config of the model that ``spec`` names (a demo name or a checkpoint folder), read without its
    weights; ``ValueError`` naming the problem when it names none, or not a model that states compose for."""
    from .demo import DEMO_DIR, DEMO_SPECS, checkpoint_problem
    from .state.architectures import ARCHITECTURES, supported_text

    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"model_path must be a demo name, a checkpoint folder or a callable, got {type(spec).__name__}")
    folder = DEMO_DIR / DEMO_SPECS[spec] if spec in DEMO_SPECS else spec
    problem = None if spec in DEMO_SPECS else checkpoint_problem(spec)
    if problem:
        raise ValueError(f"model {problem}")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"model {os.fspath(spec)!r}: its config.json does not load ({error}); fix or re-save the checkpoint"
        ) from None
    if config.model_type not in ARCHITECTURES:
        raise ValueError(
            f"model {os.fspath(spec)!r} is a {config.model_type!r} model, not one of {supported_text()}: "
            "its states cannot be stored or composed"
        )
    return config


def _probe_retriever(retriever, store_dim: int | None, where: str) -> None:
    """The retriever embeds two texts as a ``[2, E]`` array, with the store's ``E`` if it has one."""
    import torch

    if not callable(retriever):
        raise TypeError(
            f"the retriever factory returned a {type(retriever).__name__}, not a callable list[str] -> [n, E] vectors"
        )
    vectors = torch.as_tensor(retriever([DIMENSION_PROBE, "a"]))
    if vectors.dim() != 2 or vectors.shape[0] != 2:
        raise ValueError(f"the retriever returned shape {tuple(vectors.shape)} for 2 texts; expected [n, E]")
    if store_dim is not None and vectors.shape[1] != store_dim:
        raise ValueError(
            f"the retriever gives {vectors.shape[1]}-dim vectors; the Lance store at {where} holds {store_dim}-dim ones: "
            "pass the retriever that built it, or encode into a new store"
        )


def check_before_ray(
    model_path,
    store_uri,
    retriever: Callable | None = None,
    storage_dtype: str | None = None,
    store_options: dict | None = None,
) -> None:
    """Refuse on the driver, before Ray starts, what would make every actor fail (Ray reports that as an
    ``ActorDiedError`` and kilobytes of trace): a store path that holds a folder store or other files, a
    model spec naming no loadable Mamba checkpoint, a retriever that gives no ``[n, E]`` vectors, and a
    Lance store built with another model, tokenizer, retriever, embedding dimension or storage dtype.
    The store's header is read without a model; the model is loaded here only when the store exists
    (its fingerprint, the one check that needs the weights)."""
    uri = os.fspath(store_uri)
    options = dict(store_options or {})
    exists = True
    if "://" not in uri:
        folder = os.path.abspath(uri)
        exists = os.path.exists(folder)
        if exists and not os.path.isdir(folder):
            raise ValueError(f"{uri} is a file, not a Lance store folder: give a new folder or an existing Lance store")
        if os.path.isfile(os.path.join(folder, "store.json")):
            raise ValueError(
                f"{uri} holds a folder store, not a Lance store: encode into a new folder, or copy this store into a "
                f"Lance store first (hf-statecompose store migrate {uri} NEW_FOLDER)"
            )
        if exists and any(not name.endswith(".lance") for name in os.listdir(folder)):
            raise ValueError(
                f"{uri} exists and is not a Lance store (it holds other files): give a new or empty folder, or a Lance store"
            )
    header = (
        read_lance_header(uri, options.get("storage_options")) if exists else None
    )  # (connecting creates the folder)
    config = None if callable(model_path) else _checkpoint_config(model_path)
    if header is None:  # a new store: nothing to match yet
        if retriever is not None:
            _probe_retriever(retriever(), None, uri)
        return
    recorded = (header.get("model_type"), header.get("num_hidden_layers"), header.get("hidden_size"))
    if config is not None and (config.model_type, config.num_hidden_layers, config.hidden_size) != recorded:
        raise ValueError(
            f"the Lance store at {uri} was built with another model ({recorded[0]}, {recorded[1]} layers, hidden {recorded[2]}; "
            f"recorded as {header.get('info', {}).get('model', '?')!r}) than {os.fspath(model_path)!r} ({config.model_type}, "
            f"{config.num_hidden_layers} layers, hidden {config.hidden_size}): pass the model that built it, or encode into a new store"
        )
    model, tokenizer = load_model_spec(model_path)
    # the fingerprint, tokenizer, retriever name and storage dtype checks of opening the store
    store = LanceStateStore(
        uri,
        model,
        tokenizer,
        retriever=retriever() if retriever is not None else None,
        storage_dtype=storage_dtype,
        **options,
    )
    _probe_retriever(store.retriever, store.embedding_dim, uri)


def _normalise(passages, text_field: str) -> tuple[list[str], list[str], list[str]]:
    """``(ids, texts, metadata JSON)`` of a ``.jsonl`` path, a list of strings or a list of dicts."""
    if isinstance(passages, (str, os.PathLike)):
        from .store.passages import parse_passages_jsonl

        path = os.fspath(passages)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no passages file {path}")
        with open(path, encoding="utf-8") as handle:
            texts, metadata = parse_passages_jsonl(handle.read(), path, text_field)
    else:
        if isinstance(passages, (bytes, dict)) or not isinstance(passages, Iterable):
            raise TypeError("passages must be a .jsonl path, a list of strings or a list of {'text': ...} dicts")
        texts, metadata = [], []
        for n, passage in enumerate(passages):
            if isinstance(passage, str):
                passage = {text_field: passage}
            if not isinstance(passage, dict) or not isinstance(passage.get(text_field), str):
                raise TypeError(
                    f"passage {n} is a {type(passage).__name__}, not a string or a dict with a string {text_field!r}"
                )
            passage = dict(passage)
            texts.append(passage.pop(text_field))
            metadata.append(passage)
    ids, metas = [], []
    for n, (text, meta) in enumerate(zip(texts, metadata)):
        if not text.strip():
            raise ValueError(f"passage {n} is empty; every entry needs some text to encode")
        checked_json(meta, f"metadata of passage {n}")
        ids.append(entry_id_for(meta.get("id"), text))
        metas.append(json.dumps(meta, sort_keys=True, ensure_ascii=False))
    if len(set(ids)) != len(ids):
        seen, dupes = set(), []
        for entry_id, text in zip(ids, texts):
            if entry_id in seen:
                dupes.append(text[:40])
            seen.add(entry_id)
        raise ValueError(
            f"{len(dupes)} passages repeat another's id or (without ids) its text, e.g. {dupes[0]!r}; "
            "give each passage a unique 'id' field or drop the repeats"
        )
    return ids, texts, metas


def stored_ids(store_uri, storage_options: dict | None = None) -> set[str]:
    """Ids in the Lance store at ``store_uri`` (empty if there is no store yet); no model needed."""
    lancedb, _ = import_lancedb()
    db = lancedb.connect(os.fspath(store_uri), storage_options=storage_options)
    listing = db.list_tables() if hasattr(db, "list_tables") else db.table_names()
    names = set(getattr(listing, "tables", listing))
    if HEADER_TABLE not in names or STATES_TABLE not in names:
        return set()
    return set(db.open_table(STATES_TABLE).search().select(["id"]).limit(None).to_arrow().column("id").to_pylist())


class _EncodeActor:
    """One Ray actor: loads the model (and retriever) once, encodes and commits one batch per call."""

    def __init__(
        self, model, store_uri, retriever=None, storage_dtype=None, store_options=None, device=None, threads=None
    ):
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        with quiet_loading():  # each actor's "Loading weights" bars would interleave in the driver's output
            model, tokenizer = load_model_spec(model)
            if device is not None:
                model = model.to(device)
            self.store = LanceStateStore(
                store_uri,
                model,
                tokenizer,
                retriever=retriever() if retriever is not None else None,
                storage_dtype=storage_dtype,
                **(store_options or {}),
            )

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        ids, texts, metas = (
            [str(i) for i in batch["id"]],
            [str(t) for t in batch["text"]],
            [json.loads(m) for m in batch["metadata"]],
        )
        present = set(self.store._rows(ids, ["id"]))  # a retried batch, or another run meanwhile
        todo = [n for n, entry_id in enumerate(ids) if entry_id not in present]
        if todo:
            rows = self.store.encode_rows([texts[n] for n in todo], [metas[n] for n in todo], [ids[n] for n in todo])
            self.store.write_rows(rows, skip_existing=True)
        written = set(todo)
        return {"id": np.array(ids), "written": np.array([n in written for n in range(len(ids))])}


def encode_corpus(
    passages,
    model_path,
    store_uri,
    *,
    retriever: Callable | None = None,
    batch_size: int = 16,
    num_actors: int | None = None,
    num_gpus_per_actor: float | None = None,
    cpus_per_actor: int = 1,
    storage_dtype: str | None = None,
    text_field: str = "text",
    show_progress: bool = True,
    store_options: dict | None = None,
    ray_remote_args: dict | None = None,
) -> dict:
    """Encode ``passages`` with ``model_path`` into the Lance store at ``store_uri`` on Ray Data.

    Args:
        passages: a ``.jsonl`` path (one ``{"text": ..., ...}`` per line), or a list of strings or dicts;
            fields besides the text are metadata. A passage's ``id`` field, if any, names its entry
            (``entry_id_for``); without one its text does.
        model_path: ``"demo"`` / ``"demo-mamba"`` / ``"demo-mamba2"``, a local checkpoint folder, or a
            zero-argument callable returning ``(model, tokenizer)`` (called once in every actor).
        store_uri: the Lance store (created if missing): a local folder or an object-storage URI.
        retriever: a zero-argument callable returning the retriever (called once per actor); ``None``:
            the default all-MiniLM-L6-v2.
        batch_size: passages per ``map_batches`` call: one left-padded forward and one Lance commit.
        num_actors: actor pool size (default: the cluster's GPUs, else its CPUs // ``cpus_per_actor``).
        num_gpus_per_actor: default 1 when the cluster has GPUs, else 0 (CPU actors).
        store_options: keyword arguments of :class:`~hf_statecompose.store.lance.LanceStateStore`
            (``storage_options`` for object storage, index settings).
        ray_remote_args: extra Ray options of the actors (e.g. ``{"max_restarts": 0}``: fail instead of
            restarting a dead actor; by default Ray restarts it and retries its batches).

    Uses the running Ray (``ray.init()`` first to join a cluster); starts a local one otherwise, after
    :func:`check_before_ray` (a wrong store, model or retriever raises here, before Ray starts).
    Returns ``{"passages", "already_stored", "encoded", "entries"}``: ``encoded`` counts the rows this
    run's batches wrote (a batch that Ray re-executes after they were committed writes none again),
    ``entries`` the corpus's ids in the store at the end.
    """
    try:
        import ray
        import ray.data
    except ImportError as error:
        raise ImportError(
            "encode_corpus needs Ray Data: pip install 'hf_statecompose[scale]' (or pip install -c constraints.txt 'ray[data]')"
        ) from error
    batch_size = check_count(batch_size, "batch_size", 1)
    cpus_per_actor = check_count(cpus_per_actor, "cpus_per_actor", 1)
    if not callable(model_path) and not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(
            f"model_path must be a demo name, a checkpoint folder or a callable, got {type(model_path).__name__}"
        )
    if retriever is not None and not callable(retriever):
        raise TypeError("retriever must be a zero-argument callable returning the retriever (a class works)")
    ids, texts, metas = _normalise(passages, text_field)
    store_options = dict(store_options or {})
    check_before_ray(model_path, store_uri, retriever, storage_dtype, store_options)
    done = stored_ids(store_uri, store_options.get("storage_options"))
    todo = sorted((n for n, entry_id in enumerate(ids) if entry_id not in done), key=lambda n: (len(texts[n]), n))
    result = {"passages": len(ids), "already_stored": len(ids) - len(todo), "encoded": 0}
    if todo:
        if not ray.is_initialized():
            ray.init()
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        if num_gpus_per_actor is None:
            num_gpus_per_actor = 1 if gpus else 0
        if num_actors is None:
            num_actors = max(1, gpus if num_gpus_per_actor else int(resources.get("CPU", 1)) // cpus_per_actor)
        num_actors = check_count(num_actors, "num_actors", 1)
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = bool(show_progress)
        # sorted by length: consecutive rows, hence each batch, have similar lengths (little padding)
        rows = [{"id": ids[n], "text": texts[n], "metadata": metas[n]} for n in todo]
        dataset = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows) // batch_size, 4 * num_actors)))
        encoded = dataset.map_batches(
            _EncodeActor,
            batch_size=batch_size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=num_actors),
            num_gpus=num_gpus_per_actor,
            num_cpus=cpus_per_actor,
            fn_constructor_kwargs={
                "model": model_path,
                "store_uri": os.fspath(store_uri),
                "retriever": retriever,
                "storage_dtype": storage_dtype,
                "store_options": store_options,
                "device": "cuda" if num_gpus_per_actor else None,
                "threads": cpus_per_actor,
            },
            **dict(ray_remote_args or {}),
        )
        result["encoded"] = sum(
            int(batch["written"].sum()) for batch in encoded.iter_batches(batch_size=None, batch_format="numpy")
        )
    result["entries"] = len(stored_ids(store_uri, store_options.get("storage_options")) & set(ids))
    return result
