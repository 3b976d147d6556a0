"""The tables of a Lance store (:class:`~hf_statecompose.store.lance.LanceStateStore`), read without torch, LanceDB or
a model: their names, the header, and the store's statistics (:func:`dataset_stats`), which
:func:`read_lance_stats` reads with ``pylance`` alone (``hf-statecompose stats``). The layout is described in
:mod:`hf_statecompose.store.lance`.
"""

from __future__ import annotations

import json
import os

from .format import FORMAT_VERSION, unseal_bytes

HEADER_TABLE = "store_header"
STATES_TABLE = "states"


def import_lance():
    """``pylance`` (the ``lance`` module), or an ``ImportError`` naming the ``[scale]`` extra."""
    try:
        import lance
    except ImportError as error:
        raise ImportError(
            "the Lance store backend needs lancedb and pylance: pip install 'hf_statecompose[scale]' "
            "(or pip install -c constraints.txt lancedb pylance)"
        ) from error
    return lance


def table_uri(uri: str, table: str) -> str:
    """Where LanceDB keeps the table ``table`` of the database at ``uri``."""
    return f"{uri.rstrip('/')}/{table}.lance"


def dataset_stats(dataset, uri: str) -> dict:
    """``entries``, ``deleted_pending``, ``fragments``, ``bytes`` (all files of a local store; ``None`` on object
    storage), ``state_bytes_per_entry`` (tensor bytes of one entry's state) and ``blob_bytes_per_entry`` (its
    state column) of the states table, ``dataset`` (a ``lance.LanceDataset``)."""
    fragments = dataset.get_fragments()
    physical = sum(f.physical_rows for f in fragments)
    rows = dataset.count_rows()
    per_entry = blob = None
    if rows:
        first = dataset.to_table(columns=["state"], limit=1).column("state")[0].as_py()
        length = int.from_bytes(first[:8], "little")
        header = json.loads(first[8 : 8 + length])  # the blob's safetensors header says the sizes
        per_entry = sum(
            v["data_offsets"][1] - v["data_offsets"][0]
            for name, v in header.items()
            if name not in ("__metadata__", "token_ids", "num_tokens")
        )
        blob = len(first)
    local = "://" not in uri or uri.startswith("file://")
    total = None
    if local:
        root = uri[len("file://") :] if uri.startswith("file://") else uri
        total = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
    return {
        "entries": rows,
        "deleted_pending": physical - rows,
        "fragments": len(fragments),
        "bytes": total,
        "state_bytes_per_entry": per_entry,
        "blob_bytes_per_entry": blob,
    }


def stats_record(counts: dict, header: dict, indexed: bool, version: int) -> dict:
    """The stats of a Lance store, in :meth:`LanceStateStore.stats <hf_statecompose.store.lance.LanceStateStore.stats>`'s
    order: ``counts`` from :func:`dataset_stats`, the rest from the store's header and its states table."""
    return {
        "backend": "lance",
        **counts,
        "storage_dtype": header["storage_dtype"],
        "retriever": header["retriever"],
        "indexed": indexed,
        "version": version,
    }


def lance_header(rows: dict, where: str) -> dict:
    """The store header from the header table's rows (name -> row), its seal checked and its kind a Lance store's."""
    header = unseal_bytes(rows["header"]["json"].encode(), where, "header")
    if (
        header.get("format_version") != FORMAT_VERSION
        or header.get("kind") != "hf_statecompose.store"
        or header.get("backend") != "lance"
    ):
        raise ValueError(
            f"{where}: not an hf_statecompose Lance store header (format {header.get('format_version')!r})"
        )
    return header


def _has_vector_index(dataset) -> bool:
    """Whether the states table has its ANN index on ``vector`` (as ``LanceStateStore._has_index`` asks LanceDB)."""
    if hasattr(dataset, "describe_indices"):  # pylance >= 14 (list_indices is deprecated there)
        return any(list(index.field_names) == ["vector"] for index in dataset.describe_indices())
    return any(list(index.get("fields", ())) == ["vector"] for index in dataset.list_indices())


def read_lance_stats(uri: str, storage_options: dict | None = None) -> dict:
    """:meth:`LanceStateStore.stats <hf_statecompose.store.lance.LanceStateStore.stats>` of the Lance store at
    ``uri``, read-only, without its model, torch or LanceDB (``pylance`` only): the header's seal is verified, the
    states are not read. A ``ValueError`` if ``uri`` holds no Lance store; an ``ImportError`` without ``pylance``."""
    lance = import_lance()
    uri = os.fspath(uri)
    where = f"{uri} ({HEADER_TABLE})"
    try:
        header_table = lance.dataset(table_uri(uri, HEADER_TABLE), storage_options=storage_options)
    except (ValueError, OSError) as error:  # pylance: ValueError "Dataset at path ... was not found"
        raise ValueError(f"no Lance store at {uri} ({error})") from None
    try:
        rows = {r["name"]: r for r in header_table.to_table(columns=["name", "json"]).to_pylist()}
    except Exception as error:  # noqa: BLE001 - any failure to read the table is a damaged store
        raise ValueError(
            f"{where}: the store's header table is unreadable ({error!r:.120}); restore it from a backup"
        ) from None
    if "header" not in rows:
        raise ValueError(f"{where}: the store's header row is missing; restore it from a backup")
    header = lance_header(rows, where)
    try:
        states = lance.dataset(table_uri(uri, STATES_TABLE), storage_options=storage_options)
        counts = dataset_stats(states, uri)
        indexed = _has_vector_index(states)
        version = states.version
    except Exception as error:  # noqa: BLE001 - whatever Lance raises on a damaged table
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"the Lance store at {uri} cannot be read ({first[:120]}): its files are damaged; "
            "restore the store from a backup (or re-encode its passages)"
        ) from None
    return stats_record(counts, header, indexed, version)
