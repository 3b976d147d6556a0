"""``StateStore(uri, model, tokenizer, backend="lance")``: the store in LanceDB tables, for corpora that
outgrow one folder and one process. Needs the ``[scale]`` extra (``lancedb``, ``pylance``).

Layout of a Lance store at ``uri`` (a LanceDB database: a local folder or an object-storage URI)::

    store_header.lance   two rows, written once when the store is created (one Lance commit):
                         "header": the sealed JSON header of a folder store (format, model fingerprint and
                         summary, storage dtype, retriever name and embedding dimension, tokenizer record,
                         ``info``) plus ``backend: "lance"`` and the checksum of A;
                         "A": the model's A tensors (the same for every state: stored once), safetensors
    states.lance         one row per entry: id, text, metadata (canonical JSON), num_tokens, vector (the
                         unit-norm retrieval embedding, fixed-size float32 list), state, tensor_digest, seal

``state`` is the bytes of a state file (:mod:`hf_statecompose.state.serialization`: safetensors, the
``hf_statecompose`` metadata with format version, architecture, fingerprint, model dtype, config and the
blake2b ``tensor_digest`` of every tensor) for one entry, except that ``A`` is not repeated in every row
(for Mamba-1 it is as large as the SSM state): the reader takes it from the header table, checksum-verified.
A hybrid model's entries also hold the keys, values and positions of their own tokens at each attention layer
(``attn.keys.i``, ...; ``keys_dtype`` in the metadata), as a hybrid state file does.
``seal`` is a blake2b digest over id, text, metadata, num_tokens, the vector's bytes and tensor_digest:
a changed byte anywhere in a row is refused, never read as other text or another state.

Guarantees, from Lance's commit model (every write is a new table version made visible by one atomic
manifest commit; readers read one version): a reader sees an ``add`` batch, a ``delete`` (one commit for
all its ids) or a compaction whole or not at all; ``get`` and ``retrieve`` read ids, vectors and states
from one version. Ids are random (``add``) or given (``add(ids=...)``,
:func:`hf_statecompose.distributed.encode_corpus`); writes with given ids insert only ids not yet stored
(``merge_insert`` on ``id``, which is the table's unenforced primary key), and Lance refuses, as a
conflict, a commit inserting an id that another commit inserted since the writer read the table: the
write is retried on the new version and skips that id, so concurrent, retried or repeated writes of an
id store it once (stores made before this declare the key at their first write). Every commit (``add``,
``delete``, ``compact``, ``repair``) that loses to other writers' conflicting commits is retried with
jittered exponential backoff (:func:`retry_contended`), then fails with a ``TimeoutError`` naming the
contention. A store holding an entry more than once (written before, or outside this API) reads
identical copies as one entry and refuses differing ones, naming :meth:`LanceStateStore.repair`
(``hf-statecompose store repair``), which keeps the first verified copy. Every state read is verified:
the row's seal, the state file's metadata and fingerprint, its tensor digest, then dtypes, shapes,
finite values and ΣΔ >= 0 against the model (as a folder store does).
No pickle: rows are Arrow columns, states safetensors.

A read-only store (a read-only mount, no write permission) opens and reads; ``add`` (of texts not stored yet),
``delete``, ``compact``, ``repair`` and ``build_index`` then raise one ``PermissionError`` naming the store, before
anything is encoded or changed (a local store is checked first; on object storage, by the first write). Lance's
input/output failures (``RuntimeError: lance error: LanceError(IO) ...``) are a ``PermissionError`` (read-only,
no permission) or an ``OSError`` with the errno (``ENOSPC``: a full disk) naming the store (:func:`io_error`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import numbers
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import torch

from ..state.cache import ComposableMambaCache
from ..state.fingerprint import architecture_of
from ..state.serialization import FORMAT_VERSION as STATE_FORMAT_VERSION
from ..state.serialization import _check_metadata, _dense, _digest
from ..state.validation import check_finite, expected_num_layers
from .base import StateStore, progress_bar, register_backend
from .format import (
    FORMAT_VERSION,
    STORAGE_DTYPES,
    StoreEntry,
    canonical,
    check_count,
    check_id,
    check_opened_header,
    checksum,
    content_id,
    seal,
    unseal_bytes,
)
from .lance_files import HEADER_TABLE, STATES_TABLE, dataset_stats, lance_header, stats_record

# below this many entries a query is an exact scan (fast enough, and PQ training wants data); compact()
# builds the ANN index once the table holds this many
DEFAULT_INDEX_THRESHOLD = 10_000
# embedded once when a store is created, to fix the retriever's dimension
DIMENSION_PROBE = "an hf_statecompose store"


def import_lancedb():
    try:
        import lancedb
        import pyarrow
    except ImportError as error:
        raise ImportError(
            "the Lance store backend needs lancedb and pylance: pip install 'hf_statecompose[scale]' "
            "(or pip install -c constraints.txt lancedb pylance)"
        ) from error
    return lancedb, pyarrow


def row_seal(entry_id: str, text: str, metadata_json: str, num_tokens: int, vector: bytes, tensor_digest: str) -> str:
    body = canonical(
        [entry_id, text, metadata_json, int(num_tokens), hashlib.sha256(vector).hexdigest(), tensor_digest]
    )
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def _blob_metadata(blob: bytes, where: str) -> dict:
    """The ``hf_statecompose`` metadata of state-file bytes, checked as a state file's is."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < 9 or blob[8:9] != b"{":
        raise ValueError(f"{where}: the state is not safetensors bytes (corrupted); delete and re-add the entry")
    length = int.from_bytes(blob[:8], "little")
    if 8 + length > len(blob):
        raise ValueError(
            f"{where}: the state is truncated ({len(blob)} bytes, its header claims {length}); delete and re-add the entry"
        )
    try:
        header = json.loads(blob[8 : 8 + length])
        meta = json.loads(header["__metadata__"]["hf_statecompose"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{where}: the state's metadata is corrupted ({error!r:.80}); delete and re-add the entry"
        ) from None
    _check_metadata(meta, where)
    return meta


# the id column's field metadata that makes it the table's (unenforced) primary key: every merge insert
# on it then records the ids it inserts, and Lance's commit check refuses (as a retryable conflict) a
# merge insert that adds an id another commit added since it read the table; without it both commit
PRIMARY_KEY = "lance-schema:unenforced-primary-key"
# what Lance's optimistic commits raise when another process committed a conflicting change first (a
# compaction rewriting the fragment a delete touches, two merge inserts of one id, ...), or when a
# compaction removed the version an operation began on: each is retried on the latest version
_CONTENTION = ("commit conflict", "please retry", "too many concurrent writers", "concurrent transaction")


def contended(error: BaseException) -> bool:
    """Whether ``error`` is Lance telling a writer that other writers got in first (worth a retry)."""
    text = str(error).lower()
    return any(mark in text for mark in _CONTENTION) or ("_versions/" in text and "not found" in text)


# the errno Lance's IO errors carry in their text: "lance error: LanceError(IO): Read-only file system (os error 30) ..."
_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def io_error(error: BaseException, where: str, what: str) -> OSError | None:
    """The clear error for ``error``, which Lance raised while ``what`` on the store ``where``, if it is an
    input/output failure (``None`` otherwise): a ``PermissionError`` for a read-only file system or missing
    write permission, an ``OSError`` with ``ENOSPC`` for a full disk (or quota), an ``OSError`` naming the
    errno for other IO failures. Lance reports them as ``RuntimeError: lance error: LanceError(IO): ...
    (os error N), .../object_store.rs``; Python's own ``OSError`` subclasses are mapped by their errno."""
    if isinstance(error, TimeoutError):  # retry_contended's: already clear
        return None
    text = str(error)
    if isinstance(error, OSError) and error.errno is not None:
        code: int | None = error.errno
    else:
        found = _OS_ERROR.search(text)
        code = int(found.group(1)) if found else None
        if code is None and "LanceError(IO)" not in text:
            return None
    reason = os.strerror(code) if code is not None else (text.strip().splitlines() or ["input/output error"])[0][:160]
    if code in _READ_ONLY:
        return PermissionError(
            code,
            f"{where} is read-only: {reason} while {what} (a Lance store without write access can be read, not "
            "created or changed: add, delete, compact and repair need it; copy the store to a writable place)",
        )
    if code in _NO_SPACE:
        return OSError(
            code,
            f"{where}: no space left on the device while {what} ({reason}); nothing half-written is visible (every "
            "Lance commit is atomic): free some space and retry",
        )
    return OSError(code if code is not None else errno.EIO, f"{where}: {what} failed: {reason}")


def retry_contended(
    operation: Callable,
    what: str,
    where: str,
    attempts: int = 10,
    base_delay: float = 0.05,
    max_delay: float = 2.0,
    budget: float = 120.0,
    refresh: Callable | None = None,
    sleep: Callable = time.sleep,
):
    """``operation()``, retried while Lance reports contention (:func:`contended`): at most ``attempts``
    times and no new attempt after ``budget`` seconds, sleeping a jittered, exponentially growing delay
    between attempts (``base_delay`` doubling up to ``max_delay``; half of it fixed, half random, so that
    writers that collided spread out) and calling ``refresh`` before each retry. Any other error is
    raised at once; contention that outlasts the attempts is a ``TimeoutError`` (an ``OSError``) naming
    it and what to do."""
    started, delay = time.monotonic(), base_delay
    for attempt in range(1, attempts + 1):
        try:
            return operation()
        except Exception as error:  # noqa: BLE001 - lancedb raises contention as RuntimeError / OSError / its own types
            if not contended(error):
                raise
            if attempt == attempts or time.monotonic() - started > budget:
                raise TimeoutError(
                    f"{where}: {what} failed {attempt} times in {time.monotonic() - started:.1f} s: other processes kept committing "
                    f"conflicting changes to the Lance table (last: {str(error).splitlines()[0][:160]}); retry when fewer processes "
                    "write at once (e.g. compact while no deletes run), or raise the store's write_attempts"
                ) from None
        sleep(delay / 2 + random.uniform(0, delay / 2))
        delay = min(max_delay, 2 * delay)
        if refresh is not None:
            refresh()


class LanceStateStore(StateStore):
    """A :class:`~hf_statecompose.StateStore` in LanceDB (see the module docstring); made by
    ``StateStore(uri, model, tokenizer, backend="lance", ...)`` or directly.

    Args beyond the folder store's:
        storage_options: passed to ``lancedb.connect`` (object-storage credentials, endpoint, region).
        index_threshold: entries from which :meth:`compact` builds the ANN index (exact search below).
        index_type: ``"IVF_PQ"`` (default) or ``"IVF_HNSW_SQ"``; ``nprobes`` / ``refine_factor`` tune
            the search (``refine_factor`` re-ranks ``k * refine_factor`` candidates by exact distance).
        read_consistency_interval: how stale a read may be (default 0: every read sees the latest
            commit; on object storage a few seconds saves a round trip per query).
    """

    backend = "lance"
    # attempts of a commit under contention (see retry_contended; under 10 s of backoff in all)
    write_attempts = 10

    def __init__(
        self,
        uri,
        model,
        tokenizer,
        retriever: Callable | None = None,
        storage_dtype: str | None = None,
        info: dict | None = None,
        *,
        storage_options: dict | None = None,
        index_threshold: int = DEFAULT_INDEX_THRESHOLD,
        index_type: str = "IVF_PQ",
        nprobes: int = 32,
        refine_factor: int | None = 10,
        read_consistency_interval: float = 0.0,
        backend: str | None = None,
    ):
        lancedb, pa = import_lancedb()
        if uri is None or not isinstance(uri, (str, os.PathLike)):
            raise TypeError(f"uri must be a path or a URI string, got {type(uri).__name__}")
        self.uri = os.fspath(uri)
        self.path = self.uri  # named in messages, as a folder store's path
        self._check_local_path(self.uri)
        tokenizer_info, info = self._bind(model, tokenizer, retriever, storage_dtype, info)
        self.index_threshold = check_count(index_threshold, "index_threshold", 1)
        if index_type not in ("IVF_PQ", "IVF_HNSW_SQ"):
            raise ValueError(f"index_type must be 'IVF_PQ' or 'IVF_HNSW_SQ', got {index_type!r}")
        self.index_type = index_type
        self.nprobes = check_count(nprobes, "nprobes", 1)
        self.refine_factor = None if refine_factor is None else check_count(refine_factor, "refine_factor", 1)
        if "://" not in self.uri and os.path.isfile(os.path.join(self.uri, "store.json")):
            raise ValueError(
                f"{self.uri} holds a folder store: open it without backend='lance' (or copy it: hf-statecompose store migrate)"
            )
        self._pa = pa
        with self._io_errors("opening the store"):  # (a new local store's folder is made here)
            self._db = lancedb.connect(
                self.uri,
                read_consistency_interval=timedelta(seconds=float(read_consistency_interval)),
                storage_options=storage_options,
            )
            names = set(self._table_names())
        if HEADER_TABLE not in names:
            if STATES_TABLE in names and self._db.open_table(STATES_TABLE).count_rows() > 0:
                raise ValueError(
                    f"the Lance store at {self.uri} holds a {STATES_TABLE} table but no {HEADER_TABLE}: restore it from a backup "
                    "(a store is never re-adopted without its header: another model would read its states wrongly)"
                )
            with self._io_errors("creating the store"):
                self._create(model, tokenizer_info, storage_dtype or "fp32", info)
        self.header, self._A = self._read_header()
        check_opened_header(self.header, self.uri, self.fingerprint, self.retriever_name, tokenizer_info, storage_dtype)
        self.storage_dtype = STORAGE_DTYPES[self.header["storage_dtype"]]
        self.embedding_dim = int(self.header["embedding_dim"])
        template = self._state_template
        self._blob_meta = {
            "format_version": STATE_FORMAT_VERSION,
            "architecture": template["architecture"],
            "fingerprint": self.fingerprint,
            "model_dtype": str(template["model_dtype"]),
            "model_info": dict(template["model_info"]),
            "num_layers": expected_num_layers(model.config),
            "config": model.config.to_dict(),
            "A": "stored once per store (store_header row 'A')",
            "storage_dtype": self.header["storage_dtype"],
        }
        if self._attention_layers:  # a hybrid's keys and values, as a state file records their dtype
            self._blob_meta["keys_dtype"] = str(self._keys_dtype)
        self.table = self._read(lambda: self._db.open_table(STATES_TABLE))

    # ------------------------------------------------------------------------------------ creation
    def _table_names(self) -> list[str]:
        listing = self._db.list_tables() if hasattr(self._db, "list_tables") else self._db.table_names()
        return list(getattr(listing, "tables", listing))

    def _schema(self, dim: int):
        pa = self._pa
        return pa.schema(
            [
                pa.field("id", pa.string(), nullable=False, metadata={PRIMARY_KEY: "true"}),
                ("text", pa.string()),
                ("metadata", pa.string()),
                ("num_tokens", pa.int64()),
                ("vector", pa.list_(pa.float32(), dim)),
                ("state", pa.large_binary()),
                ("tensor_digest", pa.string()),
                ("seal", pa.string()),
            ]
        )

    def _create(self, model, tokenizer_info: dict, storage_dtype: str, info: dict) -> None:
        from safetensors.torch import save

        dim = int(self._embed([DIMENSION_PROBE]).shape[1])  # the retriever's dimension, fixed now
        ids = torch.tensor([self._tokenize(["A"])[0][0].tolist()])
        probe = ComposableMambaCache.encode(model, ids)
        A = {f"A.{layer}": _dense(a).to(torch.float32) for layer, a in enumerate(probe.A)}
        header = {
            "format_version": FORMAT_VERSION,
            "kind": "hf_statecompose.store",
            "backend": "lance",
            "fingerprint": self.fingerprint,
            "architecture": architecture_of(model),
            "model_type": model.config.model_type,
            "num_hidden_layers": model.config.num_hidden_layers,
            "hidden_size": model.config.hidden_size,
            "storage_dtype": storage_dtype,
            "retriever": self.retriever_name,
            "embedding_dim": dim,
            "tokenizer": tokenizer_info,
            "info": info,
            "A_checksum": checksum(A),
        }
        pa = self._pa
        # the states table first, the header last: the header's commit is the store's
        try:
            self._db.create_table(STATES_TABLE, schema=self._schema(dim), exist_ok=True)
        except Exception:  # noqa: BLE001 - two processes creating the store at once (Ray actors): one wins
            if STATES_TABLE not in self._table_names():
                raise
        rows = pa.table(
            {
                "name": ["header", "A"],
                "json": [seal(header).decode(), ""],
                "blob": pa.array([b"", save(A)], pa.large_binary()),
            }
        )
        try:
            self._db.create_table(HEADER_TABLE, data=rows, mode="create")
        except (ValueError, OSError, RuntimeError) as error:  # another process created it first: use theirs
            if HEADER_TABLE not in self._table_names():
                raise ValueError(f"cannot create the Lance store at {self.uri}: {error}") from None

    def _read_header(self) -> tuple[dict, list[torch.Tensor]]:
        from safetensors.torch import load

        where = f"{self.uri} ({HEADER_TABLE})"
        try:
            rows = {r["name"]: r for r in self._db.open_table(HEADER_TABLE).to_arrow().to_pylist()}
        except Exception as error:  # noqa: BLE001 - any failure to read the table is a damaged store
            raise ValueError(
                f"{where}: the store's header table is unreadable ({error!r:.120}); restore it from a backup"
            ) from None
        if set(rows) != {"header", "A"}:
            raise ValueError(
                f"{where}: the store's header table is damaged (rows {sorted(rows)}); restore it from a backup"
            )
        header = lance_header(rows, where)
        if (
            header.get("storage_dtype") not in STORAGE_DTYPES
            or not isinstance(header.get("tokenizer"), dict)
            or not isinstance(header.get("embedding_dim"), int)
        ):
            raise ValueError(f"{where}: malformed store header; restore it from a backup")
        try:
            A = load(rows["A"]["blob"])
        except Exception as error:  # noqa: BLE001
            raise ValueError(
                f"{where}: the stored A tensors are unreadable ({error!r:.80}); restore the store from a backup"
            ) from None
        if checksum(A) != header.get("A_checksum"):
            raise ValueError(
                f"{where}: the stored A tensors do not match their checksum (corrupted); restore the store from a backup"
            )
        num_layers = expected_num_layers(self.model.config)
        if set(A) != {f"A.{layer}" for layer in range(num_layers)}:
            raise ValueError(f"{where}: the stored A tensors are not those of a {num_layers}-layer model")
        return header, [A[f"A.{layer}"] for layer in range(num_layers)]

    # ------------------------------------------------------------------------------------ ids
    def refresh(self) -> None:
        """See other processes' commits now (reads already do with ``read_consistency_interval=0``)."""
        self.table.checkout_latest()

    def __len__(self) -> int:
        return self._read(self.table.count_rows)

    def _read(self, read):
        """``read()``, a read of the table; a failure inside Lance (its files damaged: a flipped byte, a
        truncated data file) is one clear error, not Lance's own message."""
        try:
            return read()
        except Exception as error:  # noqa: BLE001 - whatever Lance raises on a damaged table
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ValueError(
                f"the Lance store at {self.uri} cannot be read ({first[:120]}): its files are damaged; "
                "restore the store from a backup (or re-encode its passages)"
            ) from None

    def ids(self) -> list[str]:
        return list(
            dict.fromkeys(
                self._read(lambda: self.table.search().select(["id"]).limit(None).to_arrow().column("id").to_pylist())
            )
        )

    def __contains__(self, entry_id) -> bool:
        try:
            check_id(entry_id, "entry")
        except (TypeError, ValueError):
            return False
        return self.table.count_rows(f"id = '{entry_id}'") > 0

    @staticmethod
    def _in(ids: Sequence[str]) -> str:
        # ids are checked against the hex pattern before they get here: nothing to escape
        return "(" + ", ".join(f"'{i}'" for i in ids) + ")"

    def _ambiguous(self, entry_id: str) -> ValueError:
        return ValueError(
            f"entry {entry_id} is stored more than once in {self.uri} with different contents (a store written before "
            f"writes were made idempotent, or by a writer outside this API): run `hf-statecompose store repair {self.uri}` "
            "(or store.repair()) to keep its first verified copy"
        )

    def _one_copy_each(self, rows: list[dict]) -> dict[str, dict]:
        """``rows`` by id, the first of each id's copies; copies that differ (another seal) are refused.
        Rows of the id column only (an existence check) are not compared."""
        out: dict[str, dict] = {}
        for row in rows:
            first = out.setdefault(row["id"], row)
            if first is not row and "seal" in row and first["seal"] != row["seal"]:
                raise self._ambiguous(row["id"])
        return out

    def _rows(self, ids: Sequence[str], columns: list[str]) -> dict[str, dict]:
        """The rows of ``ids`` that are stored (columns ``columns``, plus ``seal`` unless only ids are
        asked for), one per id: identical copies of an entry (see :meth:`repair`) read as one."""
        wanted = sorted(set(ids))
        if columns != ["id"] and "seal" not in columns:
            columns = [*columns, "seal"]
        rows: dict[str, dict] = {}
        for start in range(0, len(wanted), 1024):  # filters of bounded length
            chunk = wanted[start : start + 1024]
            query = self.table.search().where(f"id IN {self._in(chunk)}").select(columns).limit(None)
            rows.update(self._one_copy_each(self._read(lambda: query.to_arrow().to_pylist())))  # noqa: B023 - _read calls it at once
        return rows

    def entries(self, ids: Sequence[str] | None = None) -> list[StoreEntry]:
        """Text and metadata of entries (no state read), each row's seal checked."""
        columns = ["id", "text", "metadata", "num_tokens", "vector", "tensor_digest", "seal"]
        if ids is None:
            rows = self._one_copy_each(
                self._read(lambda: self.table.search().select(columns).limit(None).to_arrow().to_pylist())
            )
            return [self._entry(row) for row in rows.values()]
        ids = self._check_ids(ids, "ids")
        found = self._rows(ids, columns)
        missing = [i for i in ids if i not in found]
        if missing:
            raise KeyError(f"no entries {missing[:5]} in the store at {self.uri} (deleted, or never added)")
        return [self._entry(found[i]) for i in ids]

    def _vector_bytes(self, vector) -> bytes:
        return torch.tensor(vector, dtype=torch.float32).numpy().tobytes()

    def _check_row(self, row: dict) -> None:
        entry_id = row.get("id")
        if not isinstance(entry_id, str) or len(entry_id) != 16:
            raise ValueError(f"{self.uri}: a row holds a malformed id {str(entry_id)[:40]!r} (corrupted)")
        vector = row["vector"]
        if vector is None or len(vector) != self.embedding_dim:
            raise ValueError(
                f"entry {entry_id} of {self.uri}: its vector is malformed (corrupted); delete and re-add it"
            )
        seal = row_seal(
            entry_id, row["text"], row["metadata"], row["num_tokens"], self._vector_bytes(vector), row["tensor_digest"]
        )
        if seal != row["seal"]:
            raise ValueError(
                f"entry {entry_id} of {self.uri}: the row does not match its seal (corrupted or edited); delete and re-add it"
            )

    def _entry(self, row: dict, score: float | None = None) -> StoreEntry:
        self._check_row(row)
        return StoreEntry(row["id"], row["text"], json.loads(row["metadata"]), int(row["num_tokens"]), score=score)

    # ------------------------------------------------------------------------------------ add
    def add(
        self,
        texts: Iterable[str],
        metadata: Sequence[dict] | None = None,
        batch_size: int = 16,
        show_progress: bool = True,
        ids: Sequence[str] | None = None,
    ) -> list[str]:
        """Encode ``texts`` in batches of ``batch_size`` and store them; each batch is one Lance commit.

        ``ids`` (optional, 16 lowercase hex digits each): the entries' ids. Without them, ids come from
        the content (:func:`~hf_statecompose.store.format.content_id` of text and metadata, as the folder
        store's), so a text already stored with the same metadata is not added again. Ids already stored
        are skipped (not encoded again, not duplicated, also under concurrent writers: ``id`` is the
        table's primary key), so a repeated or resumed ``add`` is safe. Returns the ids, in order (new and
        skipped)."""
        texts, metadata, batch_size = self._check_add(texts, metadata, batch_size)
        if ids is not None:
            ids = self._check_ids(ids, "ids")
            if len(ids) != len(texts):
                raise ValueError(f"{len(texts)} texts but {len(ids)} ids")
            if len(set(ids)) != len(ids):
                raise ValueError("ids must be unique")
        else:
            ids = [content_id(text, meta) for text, meta in zip(texts, metadata)]
        stored = set(self._rows(ids, ["id"])) if ids else set()
        first: dict[str, int] = {}
        for n, entry_id in enumerate(ids):
            first.setdefault(entry_id, n)  # a text repeated in this call: stored once
        todo = [n for entry_id, n in first.items() if entry_id not in stored]
        if todo:  # (texts all stored: nothing to write, as in a folder store)
            self._check_writable("add")
        progress = progress_bar(len(todo), show_progress)
        try:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                rows = self.encode_rows(
                    [texts[n] for n in chunk], [metadata[n] for n in chunk], [ids[n] for n in chunk]
                )
                self.write_rows(rows, skip_existing=True)
                progress.update(len(chunk))
        finally:
            progress.close()
        return ids

    def encode_rows(self, texts: list[str], metadata: list[dict], ids: list[str], device=None):
        """One Arrow table of rows for ``texts`` (one forward pass over the left-padded batch); written by
        :meth:`write_rows`. Used by ``add`` and by the Ray actors of ``encode_corpus``."""
        input_ids, mask, token_lists = self._tokenize(texts)
        device = device if device is not None else next(self.model.parameters()).device
        input_ids, mask = input_ids.to(device), mask.to(device)
        state = ComposableMambaCache.encode(self.model, input_ids, attention_mask=mask)
        check_finite(state, "the encoded batch")
        vectors = self._embed(texts)
        if vectors.shape[1] != self.embedding_dim:
            raise ValueError(
                f"the retriever returned {vectors.shape[1]}-dim vectors; the store holds {self.embedding_dim}-dim ones"
            )
        from safetensors.torch import save

        columns: dict[str, list] = {name: [] for name in self._schema(self.embedding_dim).names}
        for row, (entry_id, text, meta, tokens) in enumerate(zip(ids, texts, metadata, token_lists)):
            tensors = self._entry_tensors(state, row, tokens)
            tensors["num_tokens"] = torch.tensor([len(tokens)], dtype=torch.long)
            digest = _digest(tensors)
            blob = save(
                tensors,
                metadata={"hf_statecompose": json.dumps({**self._blob_meta, "tensor_digest": digest}, default=repr)},
            )
            vector = vectors[row].contiguous()
            meta_json = canonical(meta).decode()
            columns["id"].append(entry_id)
            columns["text"].append(text)
            columns["metadata"].append(meta_json)
            columns["num_tokens"].append(len(tokens))
            columns["vector"].append(vector.tolist())
            columns["state"].append(blob)
            columns["tensor_digest"].append(digest)
            columns["seal"].append(row_seal(entry_id, text, meta_json, len(tokens), vector.numpy().tobytes(), digest))
        return self._pa.table(columns, schema=self._schema(self.embedding_dim))

    def write_rows(self, rows, skip_existing: bool = True) -> None:
        """Commit ``rows`` (from :meth:`encode_rows`) as one Lance version; with ``skip_existing``, ids
        already stored are left as they are: a ``merge_insert`` on the id, the table's primary key, so
        that of concurrent writes of one id Lance commits one and retries the others, which then find it
        stored (a retried, repeated or concurrent write never duplicates an entry)."""
        if rows.num_rows == 0:
            return
        self._check_writable("writing entries")
        self._keyed()
        rows = rows.cast(self._schema(self.embedding_dim))
        if skip_existing:
            self._retrying(
                "writing entries", lambda: self.table.merge_insert("id").when_not_matched_insert_all().execute(rows)
            )
        else:
            self._retrying("adding entries", lambda: self.table.add(rows))

    def _retrying(self, what: str, operation: Callable):
        """``operation()`` (one Lance commit), retried while other writers' commits conflict with it; an
        input/output failure is a ``PermissionError`` / ``OSError`` naming the store (:func:`io_error`)."""
        with self._io_errors(what):
            return retry_contended(
                operation, what, f"the Lance store at {self.uri}", attempts=self.write_attempts, refresh=self.refresh
            )

    @contextlib.contextmanager
    def _io_errors(self, what: str):
        """Raise Lance's input/output failures inside as :func:`io_error` does (the raw error is not chained:
        its text is the reason given)."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 - lancedb raises IO failures as RuntimeError / OSError
            clear = io_error(error, f"the Lance store at {self.uri}", what)
            if clear is None:
                raise
            raise clear from None

    def _check_writable(self, what: str) -> None:
        """A ``PermissionError`` naming the store if it is local and read-only (a read-only mount, no write
        permission), before anything is encoded or changed: Lance itself writes nothing when it has nothing to
        do (a ``compact`` of a compacted table would return normally), and fails mid-way otherwise. A store on
        object storage is checked by its first write (:meth:`_io_errors`)."""
        if "://" in self.uri and not self.uri.startswith("file://"):
            return
        root = self.uri[len("file://") :] if self.uri.startswith("file://") else self.uri
        table = os.path.join(root, f"{STATES_TABLE}.lance")
        for folder in (root, table, os.path.join(table, "_versions"), os.path.join(table, "data")):
            if os.path.isdir(folder) and not os.access(folder, os.W_OK):
                try:
                    read_only_fs = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
                except OSError:
                    read_only_fs = False
                code = errno.EROFS if read_only_fs else errno.EACCES
                raise PermissionError(
                    code,
                    f"the Lance store at {self.uri} is read-only: {os.strerror(code)} ({folder}); {what} needs write "
                    "access (reads work: copy the store to a writable place to change it)",
                )

    def _keyed(self) -> None:
        """Make ``id`` the table's primary key (:data:`PRIMARY_KEY`) before this store first writes, if
        the table predates it (stores made before writes were made idempotent): two Lance commits, once;
        any number of processes may do it at once (each attempt re-reads what the others did)."""
        if getattr(self, "_has_primary_key", False):
            return

        def declared() -> bool:
            return (self.table.schema.field("id").metadata or {}).get(PRIMARY_KEY.encode()) == b"true"

        def declare():
            if self.table.schema.field(
                "id"
            ).nullable:  # a primary key is not nullable; no row holds a null id (writes check ids)
                self.table.alter_columns({"path": "id", "nullable": False})
            if not declared():
                try:
                    self.table.update_field_metadata({"path": "id", "metadata": {PRIMARY_KEY: "true"}})
                except Exception:  # noqa: BLE001 - Lance refuses to set the key again once another process has set it
                    self.refresh()
                    if not declared():
                        raise

        if not declared():
            self._retrying("declaring the id column the primary key", declare)
        self._has_primary_key = True

    # ------------------------------------------------------------------------------------ read
    def get(self, ids: Sequence[str] | str, device=None) -> list[ComposableMambaCache] | ComposableMambaCache:
        """The states of ``ids`` (one id: one state), every one verified (see the module docstring)."""
        single, ids = self._check_one_or_many(ids)
        device = device if device is not None else next(self.model.parameters()).device
        rows = self._rows(ids, ["id", "text", "metadata", "num_tokens", "vector", "state", "tensor_digest", "seal"])
        missing = [i for i in ids if i not in rows]
        if missing:
            raise KeyError(f"no entries {missing[:5]} in the store at {self.uri} (deleted, or never added)")
        out = [self._read_state(rows[i], device) for i in ids]
        return out[0] if single else out

    def _read_state(self, row: dict, device) -> ComposableMambaCache:
        from safetensors.torch import load

        self._check_row(row)
        where = f"entry {row['id']} of {self.uri}"
        blob = row["state"]
        meta = _blob_metadata(blob, where)
        if meta["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"{where}: the state was encoded by another model (fingerprint differs); delete and re-add it"
            )
        if meta["tensor_digest"] != row["tensor_digest"]:
            raise ValueError(f"{where}: the state's digest does not match its row (corrupted); delete and re-add it")
        try:
            tensors = load(bytes(blob))
        except Exception as error:  # noqa: BLE001
            raise ValueError(
                f"{where}: the state is truncated or corrupted ({error!r:.80}); delete and re-add it"
            ) from None
        if _digest(tensors) != meta["tensor_digest"]:
            raise ValueError(
                f"{where}: the state's tensor data does not match its digest (corrupted); delete and re-add it"
            )
        num_layers = len(self._A)
        expected = set(self._entry_tensor_names(num_layers)) | {"num_tokens"}
        if set(tensors) != expected:
            raise ValueError(
                f"{where}: the state holds tensors {sorted(set(tensors) ^ expected)[:4]} it should not (or lacks them)"
            )
        if tensors["num_tokens"].tolist() != [row["num_tokens"]]:
            raise ValueError(f"{where}: the state's num_tokens do not match its row")
        self._check_entry_tensors(where, tensors, row["num_tokens"], num_layers)
        return self._state(tensors, row, self._A, device)

    # ------------------------------------------------------------------------------------ retrieve
    def _has_index(self) -> bool:
        return any(getattr(index, "columns", None) == ["vector"] for index in self.table.list_indices())

    def _search(self, vector: torch.Tensor, excluded: list[str], exact: bool):
        search = self.table.search(vector.numpy(), vector_column_name="vector").metric("cosine")
        if excluded:
            search = search.where(f"id NOT IN {self._in(sorted(set(excluded)))}", prefilter=True)
        if exact:
            return search.bypass_vector_index()
        search = search.nprobes(self.nprobes)
        return search.refine_factor(self.refine_factor) if self.refine_factor else search

    def retrieve(
        self, query: str, k: int = 5, exclude: Iterable[str] = (), load_states: bool = True, exact: bool = False
    ) -> list[StoreEntry]:
        """The ``k`` entries most similar to ``query`` (cosine), best first, with their states. Through the
        ANN index once :meth:`compact` has built it (plus an exact scan of rows added since), else an
        exact scan; ``exact=True`` always scans."""
        k, excluded = self._check_query(query, k, exclude)
        if k == 0:
            return []
        vector = self._embed([query])[0]
        if vector.shape[0] != self.embedding_dim:
            raise ValueError(
                f"the retriever returned a {vector.shape[0]}-dim query vector; the store holds {self.embedding_dim}-dim ones"
            )
        columns = ["id", "text", "metadata", "num_tokens", "vector", "tensor_digest", "seal", "_distance"] + (
            ["state"] if load_states else []
        )
        # an entry stored more than once (see repair) is one result: ask for more rows until k distinct ids
        limit = k
        while True:
            rows = self._read(
                lambda: self._search(vector, excluded, exact).select(columns).limit(limit).to_arrow().to_pylist()  # noqa: B023 - _read calls it at once
            )
            rows.sort(key=lambda r: r["_distance"])
            distinct = list(self._one_copy_each(rows).values())
            if len(distinct) >= k or len(rows) < limit:
                break
            limit *= 2
        rows = distinct[:k]
        entries = [self._entry(row, score=1.0 - float(row["_distance"])) for row in rows]
        if load_states:
            device = next(self.model.parameters()).device
            for entry, row in zip(entries, rows):
                entry.state = self._read_state(row, device)
        return entries

    # ------------------------------------------------------------------------------------ delete / compact
    def delete(self, ids: Sequence[str] | str, missing_ok: bool = False) -> None:
        """Delete entries, every copy of each (see :meth:`repair`), in one Lance commit (their bytes go
        at the next :meth:`compact`). Ids not stored are a ``KeyError`` naming them, raised before
        anything changes; ``missing_ok=True`` deletes the others."""
        _, ids = self._check_one_or_many(ids)
        wanted = sorted(set(ids))
        self._check_writable("delete")

        def delete():  # the check and the commit, repeated together if another writer gets in first
            found = self._rows(wanted, ["id"])
            missing = [i for i in wanted if i not in found]
            if missing and not missing_ok:
                raise KeyError(
                    f"no entries {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} of {len(wanted)}) in the store at "
                    f"{self.uri}; nothing was deleted (delete(ids, missing_ok=True) deletes the others)"
                )
            if found:
                self.table.delete(f"id IN {self._in(sorted(found))}")

        self._retrying("delete", delete)

    def _fragment_counts(self) -> tuple[int, int, int]:
        dataset = self.table.to_lance()
        fragments = dataset.get_fragments()
        physical = sum(f.physical_rows for f in fragments)
        return len(fragments), physical, dataset.count_rows()

    def build_index(self, num_partitions: int | None = None, num_sub_vectors: int | None = None) -> None:
        """Build (or rebuild) the ANN index on the vectors now, whatever the table's size."""
        rows = len(self)
        if rows < 256:
            raise ValueError(
                f"an ANN index needs at least 256 entries to train on; the store holds {rows} (exact search is used)"
            )
        from lancedb.index import HnswSq, IvfPq

        num_partitions = num_partitions or max(1, min(4096, round(rows**0.5)))
        if self.index_type == "IVF_PQ":
            dim = self.embedding_dim
            num_sub_vectors = num_sub_vectors or next(
                d for d in (dim // 8, dim // 4, dim // 2, 1) if d and dim % d == 0
            )
            config: IvfPq | HnswSq = IvfPq(
                distance_type="cosine", num_partitions=num_partitions, num_sub_vectors=num_sub_vectors
            )
        else:
            config = HnswSq(distance_type="cosine", num_partitions=num_partitions)
        self._check_writable("building the index")
        with self._io_errors("building the index"):
            self.table.create_index("vector", config=config, replace=True)

    def compact(self, keep_versions_for: timedelta | float = 60.0) -> dict:
        """Rewrite fragments without deleted rows and merge small ones (Lance ``optimize``), update the
        ANN index (build it once the table holds ``index_threshold`` entries), and remove table versions
        older than ``keep_versions_for`` (seconds or a timedelta; readers reading an older version at
        that moment would fail: keep a margin on a busy store). Returns what it did."""
        if not isinstance(keep_versions_for, timedelta):
            if (
                isinstance(keep_versions_for, bool)
                or not isinstance(keep_versions_for, numbers.Real)
                or keep_versions_for < 0
            ):
                raise ValueError(f"keep_versions_for must be >= 0 seconds or a timedelta, got {keep_versions_for!r}")
            keep_versions_for = timedelta(seconds=float(keep_versions_for))
        self._check_writable("compact")
        fragments_before, physical_before, rows = self._retrying("compact", self._fragment_counts)
        built = False
        if rows >= self.index_threshold and not self._has_index():
            self._retrying("building the index", self.build_index)
            built = True
        # optimize is compaction, index update and cleanup, each its own commit: a retry redoes what is left
        self._retrying("compact", lambda: self.table.optimize(cleanup_older_than=keep_versions_for))
        _, physical, live = self._retrying("compact", self._fragment_counts)
        if physical > live:
            # Lance's compaction rewrites a fragment for its deletions only above 10% of its rows (and merges only
            # neighbouring small fragments): one deleted row in a store compacted before stays. Rewrite every
            # fragment that still holds deleted rows (one more commit, indices remapped), as compact promises
            self._retrying(
                "compact", lambda: self.table.to_lance().optimize.compact_files(materialize_deletions_threshold=0.0)
            )
            self._retrying("compact", lambda: self.table.optimize(cleanup_older_than=keep_versions_for))
        fragments_after, physical_after, _ = self._retrying("compact", self._fragment_counts)
        return {
            "removed_entries": physical_before - physical_after,
            "fragments_before": fragments_before,
            "fragments_after": fragments_after,
            "index_built": built,
            "indexed": self._has_index(),
        }

    optimize = compact

    def repair(self, batch_size: int = 256) -> dict:
        """Keep one copy of every entry the table holds more than once (a store written before writes
        were made idempotent, or by a writer outside this API): the first copy (in table order) whose
        seal and state verify. For each batch of such ids, one commit appends a fresh copy of each kept
        row, then one commit deletes the copies read before, by row id: killed between the two, the store
        holds more identical copies, which read as one and the next repair removes; two repairs at once
        never remove an entry's last copy (each deletes only rows it read before its own append, so the
        last append survives). Ids none of whose copies verify are left as they are and listed: delete
        them. Returns ``{"entries", "duplicated", "removed_copies", "unverifiable", "still_duplicated"}``
        (the last non-empty only if other processes kept moving rows, e.g. compacting, meanwhile)."""
        batch_size = check_count(batch_size, "batch_size", 1)
        self._check_writable("repair")
        self._keyed()
        counts = self._retrying(
            "repair",
            lambda: Counter(self.table.search().select(["id"]).limit(None).to_arrow().column("id").to_pylist()),
        )
        duplicated = sorted(entry_id for entry_id, n in counts.items() if n > 1)
        unverifiable: list[str] = []
        todo = duplicated
        for _ in range(
            3
        ):  # a compaction between a pass's read and its delete moves rows: their copies stay for the next pass
            for start in range(0, len(todo), batch_size):
                unverifiable += self._repair_batch(todo[start : start + batch_size])
            left = Counter(self._rows_of(duplicated, ["id"]).column("id").to_pylist())
            todo = [entry_id for entry_id in duplicated if left[entry_id] > 1 and entry_id not in unverifiable]
            if not todo:
                break
        return {
            "entries": len(counts),
            "duplicated": len(duplicated),
            "removed_copies": sum(counts[i] - left[i] for i in duplicated),
            "unverifiable": sorted(unverifiable),
            "still_duplicated": todo,
        }

    def _rows_of(self, ids: list[str], columns: list[str], row_ids: bool = False):
        """Every row (every copy) of ``ids``, as one Arrow table."""
        parts = []
        for start in range(0, len(ids), 1024):
            search = self.table.search().where(f"id IN {self._in(ids[start : start + 1024])}").select(columns)
            parts.append((search.with_row_id(True) if row_ids else search).limit(None).to_arrow())
        return self._pa.concat_tables(parts) if parts else self._pa.table({name: [] for name in columns})

    def _repair_batch(self, ids: list[str]) -> list[str]:
        """One repair step for ``ids`` (each stored more than once): returns those with no verified copy."""
        schema = self._schema(self.embedding_dim)
        copies: dict[str, list[dict]] = {}
        for row in sorted(self._rows_of(ids, schema.names, row_ids=True).to_pylist(), key=lambda r: r["_rowid"]):
            copies.setdefault(row["id"], []).append(row)
        kept, stale, unverifiable = [], [], []
        for entry_id in ids:
            good = next((row for row in copies.get(entry_id, ()) if self._verifies(row)), None)
            if good is None:
                unverifiable.append(entry_id)
            elif len(copies[entry_id]) > 1:
                kept.append({name: good[name] for name in schema.names})
                stale += [int(row["_rowid"]) for row in copies[entry_id]]
        if kept:
            fresh = self._pa.Table.from_pylist(kept, schema=schema)
            self._retrying("repair", lambda: self.table.add(fresh))
            self._retrying("repair", lambda: self.table.delete(f"_rowid IN ({', '.join(map(str, stale))})"))
        return unverifiable

    def _verifies(self, row: dict) -> bool:
        try:
            self._read_state(row, "cpu")
        except ValueError:
            return False
        return True

    # ------------------------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Entries and bytes: ``entries``, ``deleted_pending``, ``fragments``, ``bytes`` (all files of a
        local store; ``None`` on object storage), ``state_bytes_per_entry`` (tensor bytes of one entry's
        state), ``blob_bytes_per_entry`` (its state column), ``storage_dtype``, ``indexed``, ``version``
        (:func:`~hf_statecompose.store.lance_files.read_lance_stats` reads them without a model)."""
        counts = self._read(lambda: dataset_stats(self.table.to_lance(), self.uri))
        return stats_record(counts, self.header, self._has_index(), self.table.version)

    def __repr__(self):
        return f"LanceStateStore({self.uri!r}, entries={len(self)}, storage_dtype={self.header['storage_dtype']!r})"


register_backend("lance", LanceStateStore)  # (the package registers it by module path: imported on first use)


def read_lance_header(uri: str, storage_options: dict | None = None) -> dict | None:
    """The sealed header of the Lance store at ``uri`` (``None`` if it holds none), without a model."""
    lancedb, _ = import_lancedb()
    db = lancedb.connect(uri, storage_options=storage_options)
    listing = db.list_tables() if hasattr(db, "list_tables") else db.table_names()
    if HEADER_TABLE not in set(getattr(listing, "tables", listing)):
        return None
    rows = {
        r["name"]: r
        for r in db.open_table(HEADER_TABLE).search().select(["name", "json"]).limit(None).to_arrow().to_pylist()
    }
    if "header" not in rows:
        raise ValueError(f"{uri} ({HEADER_TABLE}): the store's header row is missing; restore it from a backup")
    return unseal_bytes(rows["header"]["json"].encode(), f"{uri} ({HEADER_TABLE})", "header")
