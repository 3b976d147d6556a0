"""``StateStore``: a database of context states on disk, retrieved by embedding similarity.

Layout of a store directory::

    store.json                  created once: format, model fingerprint and summary, storage dtype,
                                retriever name and dimension, free-form ``info`` (e.g. the model's path)
    shards/<sid>.safetensors    the states of one ``add`` batch: per entry and layer ``<id>.ssm.<l>``,
                                ``<id>.conv.<l>``, ``<id>.delta_sum.<l>``, plus ``<id>.token_ids``; per
                                shard ``A.<l>`` and ``embeddings`` [n, E]
    shards/<sid>.json           the shard's manifest: entries (id, text, metadata, tokens, checksum) and
                                the embeddings' checksum. **Its existence commits the shard.**
    deleted/<id>                a tombstone per deleted entry (until compaction rewrites its shard)
    .lock                       ``flock``-ed by writers

Why it cannot lose data:

* every file is written to a temporary name in the same folder, fsynced, then renamed, and the folder
  fsynced: a reader sees the whole file or none;
* a shard's tensors are renamed into place before its manifest, so a committed shard is complete; a
  process killed mid-``add`` leaves at most an orphan ``.safetensors`` (ignored, removed by
  :meth:`StateStore.compact`), and every batch committed before it stays intact;
* shard and entry ids are random, so concurrent writers never pick the same file; the commit, deletes
  and compaction run under an exclusive ``flock`` on ``.lock``;
* every entry's tensors carry a blake2b checksum, checked when the entry is read; the embeddings too.

Reads are lazy: :meth:`StateStore.get` memory-maps the shard (``safetensors.safe_open``) and reads only
the requested entries' tensors.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..state.cache import ComposableMambaCache
from ..state.fingerprint import architecture_of, model_fingerprint
from ..state.files import atomic_write, fsync_dir
from ..state.serialization import _digest

FORMAT_VERSION = 1
STORAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class StoreEntry:
    """One stored context. ``state`` is filled by :meth:`StateStore.retrieve` (and ``score``)."""

    id: str
    text: str
    metadata: dict = field(default_factory=dict)
    num_tokens: int = 0
    score: float | None = None
    state: ComposableMambaCache | None = None


# ------------------------------------------------------------------------------------ atomic files
def _read_json(path: Path, what: str, missing_ok: bool = False) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if missing_ok:
            return None
        raise ValueError(f"{path}: the store's {what} is missing (files removed by hand?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: the store's {what} is unreadable or corrupted ({error})") from None


class StateStore:
    """A directory of safetensors shards of context states plus an index; see the module docstring.

    Args:
        path: the store's directory (created if missing).
        model: the Mamba / Mamba-2 model that encodes (and later consumes) the states. A store records
            the model's fingerprint and refuses a different model.
        tokenizer: the model's tokenizer (a callable returning ``input_ids``, as transformers' are).
        retriever: a callable ``list[str] -> [n, E]`` vectors (tensor or array). ``None``: the default
            all-MiniLM-L6-v2 (:func:`hf_statecompose.retrieval.default_retriever`, offline). The store
            records its ``name`` (attribute, else the class name) and dimension, and refuses another.
        storage_dtype: ``"fp32"`` or ``"bf16"`` for the SSM states and conv windows (decays are always
            fp32). Fixed when the store is created; ``None`` keeps the store's (``"fp32"`` when new).
        info: JSON-able facts to record at creation (the CLI records where the model came from).
    """

    def __init__(self, path, model, tokenizer, retriever: Callable | None = None, storage_dtype: str | None = None, info: dict | None = None):
        from ..generation.integration import enable

        self.path = Path(path)
        self.model = enable(model)
        self.tokenizer = tokenizer
        if retriever is None:
            from ..retrieval import default_retriever

            retriever = default_retriever()
        if not callable(retriever):
            raise TypeError(f"retriever must be a callable list[str] -> [n, E] vectors, got {type(retriever).__name__}")
        self.retriever = retriever
        self.retriever_name = str(getattr(retriever, "name", type(retriever).__name__))
        if storage_dtype is not None and storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {storage_dtype!r}")
        self.fingerprint = model_fingerprint(model)
        (self.path / "shards").mkdir(parents=True, exist_ok=True)
        (self.path / "deleted").mkdir(exist_ok=True)
        header_path = self.path / "store.json"
        with self._locked():
            if not header_path.exists():
                header = {
                    "format_version": FORMAT_VERSION,
                    "fingerprint": self.fingerprint,
                    "architecture": architecture_of(model),
                    "model_type": model.config.model_type,
                    "num_hidden_layers": model.config.num_hidden_layers,
                    "hidden_size": model.config.hidden_size,
                    "storage_dtype": storage_dtype or "fp32",
                    "retriever": self.retriever_name,
                    "embedding_dim": None,
                    "info": dict(info or {}),
                }
                atomic_write(header_path, json.dumps(header, indent=1).encode())
        self.header = _read_json(header_path, "header (store.json)")
        if self.header.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{header_path}: unsupported store format version {self.header.get('format_version')!r}")
        if self.header["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"the store at {self.path} was built with another model ({self.header['model_type']}, "
                f"{self.header['num_hidden_layers']} layers, hidden {self.header['hidden_size']}, fingerprint "
                f"{self.header['fingerprint'][:12]}…) than the one given (fingerprint {self.fingerprint[:12]}…): its states "
                "would be silently wrong for this model. Open it with the model that built it, or build a new store."
            )
        if storage_dtype is not None and storage_dtype != self.header["storage_dtype"]:
            raise ValueError(f"the store at {self.path} stores {self.header['storage_dtype']} states; got storage_dtype={storage_dtype!r}")
        if self.header["retriever"] != self.retriever_name:
            raise ValueError(
                f"the store at {self.path} was indexed with the retriever {self.header['retriever']!r}, not "
                f"{self.retriever_name!r}: their embeddings are not comparable. Pass the same retriever."
            )
        self.storage_dtype = STORAGE_DTYPES[self.header["storage_dtype"]]
        self._manifests: dict[str, dict] = {}  # shard id -> manifest
        self._embeddings: dict[str, torch.Tensor] = {}  # shard id -> [n, E]
        self._entries: dict[str, tuple[str, int]] = {}  # entry id -> (shard id, row)
        self._flat: tuple[list[str], torch.Tensor] | None = None  # live ids and their embeddings, for retrieve

    # ------------------------------------------------------------------------------------ locking
    @contextlib.contextmanager
    def _locked(self):
        with open(self.path / ".lock", "a+") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    # ------------------------------------------------------------------------------------ index
    def refresh(self) -> None:
        """Re-read the shard manifests (other processes may have added, deleted or compacted)."""
        shard_dir = self.path / "shards"
        present = {p.stem for p in shard_dir.glob("*.json")}
        for sid in list(self._manifests):
            if sid not in present:
                del self._manifests[sid]
                self._embeddings.pop(sid, None)
        for sid in sorted(present - set(self._manifests)):
            manifest = _read_json(shard_dir / f"{sid}.json", f"shard manifest {sid}", missing_ok=True)
            if manifest is None:  # compacted away since the listing; its replacement is listed
                continue
            if manifest.get("format_version") != FORMAT_VERSION or "entries" not in manifest:
                raise ValueError(f"{shard_dir / sid}.json is not a shard manifest of this store format")
            self._manifests[sid] = manifest
        deleted = {p.name for p in (self.path / "deleted").iterdir()}
        entries = {}
        for sid in sorted(self._manifests):
            for row, entry in enumerate(self._manifests[sid]["entries"]):
                if entry["id"] not in deleted:
                    entries[entry["id"]] = (sid, row)
        if entries != self._entries:
            self._entries, self._flat = entries, None

    def __len__(self) -> int:
        self.refresh()
        return len(self._entries)

    def ids(self) -> list[str]:
        self.refresh()
        return list(self._entries)

    def __contains__(self, entry_id) -> bool:
        self.refresh()
        return entry_id in self._entries

    def entries(self, ids: Sequence[str] | None = None) -> list[StoreEntry]:
        """Text and metadata of entries (no state read)."""
        self.refresh()
        ids = list(self._entries) if ids is None else list(ids)
        return [self._entry(i) for i in ids]

    def _entry(self, entry_id: str) -> StoreEntry:
        if entry_id not in self._entries:
            raise KeyError(f"no entry {entry_id!r} in the store at {self.path} (deleted, or never added)")
        sid, row = self._entries[entry_id]
        record = self._manifests[sid]["entries"][row]
        return StoreEntry(entry_id, record["text"], dict(record.get("metadata") or {}), int(record["num_tokens"]))

    # ------------------------------------------------------------------------------------ add
    def _embed(self, texts: list[str]) -> torch.Tensor:
        vectors = self.retriever(list(texts))
        vectors = torch.as_tensor(vectors).detach().to("cpu", torch.float32)
        if vectors.dim() != 2 or vectors.shape[0] != len(texts):
            raise ValueError(f"the retriever returned shape {tuple(vectors.shape)} for {len(texts)} texts; expected [n, E]")
        if not torch.isfinite(vectors).all():
            raise ValueError("the retriever returned NaN/inf embeddings")
        return torch.nn.functional.normalize(vectors, dim=-1).contiguous()

    def add(self, texts: Iterable[str], metadata: Sequence[dict] | None = None, batch_size: int = 16, show_progress: bool = True) -> list[str]:
        """Encode ``texts`` in batches of ``batch_size`` (one forward each, no logits) and store them.

        Each batch is committed as one shard before the next is encoded, so an interruption keeps every
        finished batch. Returns the new entries' ids, in order.
        """
        texts = list(texts)
        if isinstance(metadata, dict):
            raise TypeError("metadata must be a list with one dict per text")
        metadata = [dict(m or {}) for m in metadata] if metadata is not None else [{} for _ in texts]
        if len(metadata) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(metadata)} metadata dicts")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"text {i} is empty or not a string; every entry needs some text to encode")
        for m in metadata:
            json.dumps(m)  # raises TypeError for metadata that cannot be recorded
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        ids: list[str] = []
        progress = _progress(len(texts), show_progress)
        try:
            for start in range(0, len(texts), batch_size):
                chunk, chunk_meta = texts[start : start + batch_size], metadata[start : start + batch_size]
                ids += self._add_batch(chunk, chunk_meta)
                progress.update(len(chunk))
        finally:
            progress.close()
        return ids

    def _tokenize(self, texts: list[str]):
        ids = [list(self.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
        for t, row in zip(texts, ids):
            if not row:
                raise ValueError(f"the tokenizer produced no tokens for {t[:40]!r}")
        width = max(len(r) for r in ids)
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
        return input_ids, mask, ids

    def _add_batch(self, texts: list[str], metadata: list[dict]) -> list[str]:
        input_ids, mask, token_lists = self._tokenize(texts)
        state = ComposableMambaCache.encode(self.model, input_ids, attention_mask=mask)
        embeddings = self._embed(texts)
        sid = uuid.uuid4().hex
        tensors: dict[str, torch.Tensor] = {"embeddings": embeddings}
        for layer in range(state.num_layers):
            tensors[f"A.{layer}"] = state.A[layer].detach().to("cpu", torch.float32).contiguous()
        records = []
        for row, (text, meta, tokens) in enumerate(zip(texts, metadata, token_lists)):
            entry_id = uuid.uuid4().hex[:16]
            entry_tensors = self._entry_tensors(state, row, tokens)
            tensors.update({f"{entry_id}.{name}": t for name, t in entry_tensors.items()})
            records.append({"id": entry_id, "text": text, "metadata": meta, "num_tokens": len(tokens), "checksum": _digest(entry_tensors)})
        shared = {name: t for name, t in tensors.items() if name.startswith("A.")}
        manifest = {"format_version": FORMAT_VERSION, "entries": records, "embeddings_checksum": _digest({"embeddings": embeddings}),
                    "shared_checksum": _digest(shared)}
        from safetensors.torch import save

        payload = save(tensors, metadata={"hf_statecompose_store": "shard"})
        shard_dir = self.path / "shards"
        with self._locked():  # (compaction removes uncommitted tensors: never run it between our two writes)
            atomic_write(shard_dir / f"{sid}.safetensors", payload)  # tensors first ...
            if self.header.get("embedding_dim") is None:
                self._record_embedding_dim(int(embeddings.shape[1]))
            elif self.header["embedding_dim"] != embeddings.shape[1]:
                raise ValueError(f"the retriever returned {embeddings.shape[1]}-dim vectors; the store holds {self.header['embedding_dim']}-dim ones")
            atomic_write(shard_dir / f"{sid}.json", json.dumps(manifest).encode())  # ... then the commit
        return [r["id"] for r in records]

    def _record_embedding_dim(self, dim: int) -> None:
        header = _read_json(self.path / "store.json", "header (store.json)")
        if header.get("embedding_dim") not in (None, dim):
            raise ValueError(f"the retriever returned {dim}-dim vectors; the store holds {header['embedding_dim']}-dim ones")
        header["embedding_dim"] = dim
        atomic_write(self.path / "store.json", json.dumps(header, indent=1).encode())
        self.header = header

    def _entry_tensors(self, state: ComposableMambaCache, row: int, tokens: list[int]) -> dict[str, torch.Tensor]:
        out = {}
        for layer in range(state.num_layers):
            out[f"ssm.{layer}"] = state.ssm_states[layer][row : row + 1].detach().to("cpu", self.storage_dtype).contiguous()
            out[f"conv.{layer}"] = state.conv_states[layer][row : row + 1].detach().to("cpu", self.storage_dtype).contiguous()
            out[f"delta_sum.{layer}"] = state.delta_sums[layer][row : row + 1].detach().to("cpu", torch.float32).contiguous()
        out["token_ids"] = torch.tensor([tokens], dtype=torch.long)
        return out

    # ------------------------------------------------------------------------------------ read
    def _open_shard(self, sid: str):
        from safetensors import safe_open

        path = self.path / "shards" / f"{sid}.safetensors"
        try:
            return safe_open(path, framework="pt", device="cpu")
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} is missing although its manifest exists: the store was damaged (files removed by hand?)") from None
        except Exception as error:
            raise ValueError(f"{path} is truncated or corrupted ({error}); delete its entries and re-add them") from None

    def _shard_embeddings(self, sid: str) -> torch.Tensor:
        if sid not in self._embeddings:
            with self._open_shard(sid) as handle:
                embeddings = handle.get_tensor("embeddings")
            if _digest({"embeddings": embeddings}) != self._manifests[sid]["embeddings_checksum"]:
                raise ValueError(f"shard {sid} of {self.path}: embeddings do not match their checksum (corrupted file)")
            self._embeddings[sid] = embeddings
        return self._embeddings[sid]

    def get(self, ids: Sequence[str] | str, device=None) -> list[ComposableMambaCache] | ComposableMambaCache:
        """The states of ``ids`` (one id: one state), read lazily and checked against their checksums."""
        single = isinstance(ids, str)
        ids = [ids] if single else list(ids)
        device = device if device is not None else next(self.model.parameters()).device
        for attempt in range(3):
            self.refresh()
            missing = [i for i in ids if i not in self._entries]
            if missing:
                raise KeyError(f"no entries {missing[:5]} in the store at {self.path} (deleted, or never added)")
            try:
                out = self._get(ids, device)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
                self._manifests.clear()  # another process compacted meanwhile: re-read the index
                self._embeddings.clear()
        return out[0] if single else out

    def _get(self, ids: list[str], device) -> list[ComposableMambaCache]:
        by_shard: dict[str, list[str]] = {}
        for entry_id in ids:
            by_shard.setdefault(self._entries[entry_id][0], []).append(entry_id)
        states = {}
        for sid, shard_ids in by_shard.items():
            with self._open_shard(sid) as handle:
                A = [handle.get_tensor(f"A.{layer}") for layer in range(self.model.config.num_hidden_layers)]
                if _digest({f"A.{layer}": a for layer, a in enumerate(A)}) != self._manifests[sid]["shared_checksum"]:
                    raise ValueError(f"shard {sid} of {self.path}: its A tensors do not match their checksum (corrupted file)")
                for entry_id in shard_ids:
                    states[entry_id] = self._read_entry(handle, sid, entry_id, A, device)
        return [states[i] for i in ids]

    def _read_entry(self, handle, sid: str, entry_id: str, A, device) -> ComposableMambaCache:
        num_layers = len(A)
        names = [f"{kind}.{layer}" for layer in range(num_layers) for kind in ("ssm", "conv", "delta_sum")] + ["token_ids"]
        try:
            tensors = {name: handle.get_tensor(f"{entry_id}.{name}") for name in names}
        except Exception as error:
            raise ValueError(f"entry {entry_id} of shard {sid}: tensors missing or unreadable ({error})") from None
        record = self._manifests[sid]["entries"][self._entries[entry_id][1]]
        if _digest(tensors) != record["checksum"]:
            raise ValueError(f"entry {entry_id} (shard {sid}) of {self.path}: data does not match its checksum (corrupted); delete and re-add it")
        state = ComposableMambaCache.empty_for(self.model)
        model_dtype = state.model_dtype
        for layer in range(num_layers):
            state.set_layer(
                layer,
                ssm_state=tensors[f"ssm.{layer}"].to(device, torch.float32),
                conv_state=tensors[f"conv.{layer}"].to(device, model_dtype),
                delta_sum=tensors[f"delta_sum.{layer}"].to(device),
                A=A[layer].to(device),
            )
        state.num_tokens = torch.tensor([record["num_tokens"]], device=device)
        state.token_ids = tensors["token_ids"].to(device)
        return state

    # ------------------------------------------------------------------------------------ retrieve
    def retrieve(self, query: str, k: int = 5, exclude: Iterable[str] = (), load_states: bool = True) -> list[StoreEntry]:
        """The ``k`` entries most similar to ``query`` (cosine), best first, with their states."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be a non-empty string")
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        excluded = set(exclude)
        for attempt in range(3):
            self.refresh()
            try:
                ids, matrix = self._flat_index()
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
                self._manifests.clear()  # compacted meanwhile by another process
                self._embeddings.clear()
                self._flat = None
        count = len(ids) - sum(1 for i in excluded if i in self._entries)
        if k == 0 or count == 0:
            return []
        scores = matrix @ self._embed([query])[0]
        if excluded:
            scores[[n for n, entry_id in enumerate(ids) if entry_id in excluded]] = float("-inf")
        top = torch.topk(scores, min(k, count))
        picked = [ids[i] for i in top.indices.tolist()]
        entries = [self._entry(i) for i in picked]
        for entry, score in zip(entries, top.values.tolist()):
            entry.score = float(score)
        if load_states:
            for entry, state in zip(entries, self.get(picked)):
                entry.state = state
        return entries

    def _flat_index(self) -> tuple[list[str], torch.Tensor]:
        """Live entry ids and their embeddings as one matrix, rebuilt only when the entries change."""
        if self._flat is None:
            groups: dict[str, tuple[list[str], list[int]]] = {}  # shard -> (entry ids, rows)
            for entry_id, (sid, row) in self._entries.items():
                ids, rows = groups.setdefault(sid, ([], []))
                ids.append(entry_id)
                rows.append(row)
            matrix = torch.cat([self._shard_embeddings(sid)[rows] for sid, (_, rows) in groups.items()]) if groups else torch.zeros(0, 0)
            self._flat = ([i for ids, _ in groups.values() for i in ids], matrix)
        return self._flat

    # ------------------------------------------------------------------------------------ delete / compact
    def delete(self, ids: Sequence[str] | str) -> None:
        """Delete entries (a tombstone now; their bytes go at the next :meth:`compact`)."""
        ids = [ids] if isinstance(ids, str) else list(ids)
        self.refresh()
        missing = [i for i in ids if i not in self._entries]
        if missing:
            raise KeyError(f"no entries {missing[:5]} in the store at {self.path}")
        with self._locked():
            for entry_id in ids:
                atomic_write(self.path / "deleted" / entry_id, b"")
        self.refresh()

    def compact(self) -> dict:
        """Rewrite shards holding deleted entries without them, drop orphan files; returns what it did."""
        from safetensors import safe_open
        from safetensors.torch import save

        removed_entries = rewritten = orphans = 0
        with self._locked():
            self._manifests.clear()
            self._embeddings.clear()
            self.refresh()
            shard_dir = self.path / "shards"
            deleted = {p.name for p in (self.path / "deleted").iterdir()}
            for sid, manifest in sorted(self._manifests.items()):
                gone = [r for r in manifest["entries"] if r["id"] in deleted]
                if not gone:
                    continue
                keep = [r for r in manifest["entries"] if r["id"] not in deleted]
                if keep:
                    rows = [i for i, r in enumerate(manifest["entries"]) if r["id"] not in deleted]
                    with safe_open(shard_dir / f"{sid}.safetensors", framework="pt", device="cpu") as handle:
                        tensors = {name: handle.get_tensor(name) for name in handle.keys() if not name.split(".")[0] in {r["id"] for r in gone}}
                    tensors["embeddings"] = tensors["embeddings"][rows].contiguous()
                    new_sid = uuid.uuid4().hex
                    atomic_write(shard_dir / f"{new_sid}.safetensors", save(tensors, metadata={"hf_statecompose_store": "shard"}))
                    new_manifest = {"format_version": FORMAT_VERSION, "entries": keep, "embeddings_checksum": _digest({"embeddings": tensors["embeddings"]}),
                                    "shared_checksum": manifest["shared_checksum"]}
                    atomic_write(shard_dir / f"{new_sid}.json", json.dumps(new_manifest).encode())
                # the old manifest goes first (uncommits the shard), then its tensors
                os.unlink(shard_dir / f"{sid}.json")
                os.unlink(shard_dir / f"{sid}.safetensors")
                fsync_dir(shard_dir)
                removed_entries += len(gone)
                rewritten += 1
            committed = {p.stem for p in shard_dir.glob("*.json")}
            for path in list(shard_dir.glob("*.safetensors")) + list(shard_dir.glob(".tmp-*")):
                if path.stem not in committed or path.name.startswith(".tmp-"):
                    path.unlink()
                    orphans += 1
            live = {r["id"] for sid in committed for r in _read_json(shard_dir / f"{sid}.json", "shard manifest")["entries"]}
            for tomb in (self.path / "deleted").iterdir():
                if tomb.name not in live:
                    tomb.unlink()
            self._manifests.clear()
            self._embeddings.clear()
            self.refresh()
        return {"removed_entries": removed_entries, "rewritten_shards": rewritten, "orphan_files_removed": orphans}

    # ------------------------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Entries and bytes: ``entries``, ``shards``, ``deleted_pending`` (tombstoned, not yet compacted),
        ``bytes`` (all files), ``state_bytes_per_entry`` (tensor bytes of one entry's state),
        ``storage_dtype``, ``orphan_files``."""
        self.refresh()
        shard_dir = self.path / "shards"
        total = sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
        committed = set(self._manifests)
        orphans = [p for p in shard_dir.glob("*.safetensors") if p.stem not in committed]
        all_ids = {r["id"] for m in self._manifests.values() for r in m["entries"]}
        per_entry = None
        if self._entries:
            sid = next(iter(self._entries.values()))[0]
            entry_id = next(i for i, (s, _) in self._entries.items() if s == sid)
            with self._open_shard(sid) as handle:
                per_entry = sum(_nbytes(handle, name) for name in handle.keys() if name.startswith(entry_id + ".") and not name.endswith("token_ids"))
        return {
            "entries": len(self._entries),
            "shards": len(self._manifests),
            "deleted_pending": len(all_ids) - len(self._entries),
            "bytes": total,
            "state_bytes_per_entry": per_entry,
            "storage_dtype": self.header["storage_dtype"],
            "orphan_files": len(orphans),
            "retriever": self.header["retriever"],
        }

    def __repr__(self):
        return f"StateStore({str(self.path)!r}, entries={len(self)}, storage_dtype={self.header['storage_dtype']!r})"


def _nbytes(handle, name: str) -> int:
    tensor_slice = handle.get_slice(name)
    count = 1
    for size in tensor_slice.get_shape():
        count *= size
    return count * {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "F64": 8}[tensor_slice.get_dtype()]


def _progress(total: int, enabled: bool):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; stay silent without it
        enabled = False
    if enabled:
        return tqdm(total=total, desc="encoding contexts", unit="ctx")

    class _Silent:
        def update(self, n):
            pass

        def close(self):
            pass

    return _Silent()
