"""``FolderStateStore``: the default :class:`~hf_statecompose.store.StateStore` backend (``backend="folder"``), a
folder of safetensors shards on a local filesystem. This module is its API (add, get, retrieve, delete, compact,
entries, stats); the files, locks, atomic writes and compaction steps it runs are the on-disk protocol in
:mod:`hf_statecompose.store.folder_disk`, whose docstring describes the layout and why the store cannot lose data.

``add`` skips texts already stored with the same metadata (their ids are returned, nothing is encoded);
new entries get ids derived from their content (:func:`~hf_statecompose.store.format.content_id`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from ..state.cache import ComposableMambaCache
from ..state.fingerprint import architecture_of
from ..state.validation import check_finite
from .base import StateStore, progress_bar, register_backend
from .folder_disk import _VERIFIED, ShardFolder
from .format import (
    FORMAT_VERSION,
    STORAGE_DTYPES,
    StoreEntry,
    canonical,
    check_opened_header,
    content_id,
    is_id,
)

__all__ = ["_VERIFIED", "FolderStateStore"]  # _VERIFIED: benchmarks/store_read.py clears it


class FolderStateStore(ShardFolder, StateStore):
    """A directory of safetensors shards of context states plus an index; see the module docstrings (this
    module's, and :mod:`hf_statecompose.store.folder_disk`'s for the files). Made by ``StateStore(path, model,
    tokenizer, ...)`` (arguments: :class:`~hf_statecompose.store.StateStore`)."""

    backend = "folder"

    def __init__(
        self,
        path,
        model,
        tokenizer,
        retriever: Callable | None = None,
        storage_dtype: str | None = None,
        info: dict | None = None,
        backend: str | None = None,
    ):
        self.path = Path(path)
        self._check_local_path(str(self.path))
        tokenizer_info, info = self._bind(model, tokenizer, retriever, storage_dtype, info)
        storage = storage_dtype or "fp32"

        def new_header() -> dict:
            return {
                "format_version": FORMAT_VERSION,
                "kind": "hf_statecompose.store",
                "fingerprint": self.fingerprint,
                "architecture": architecture_of(model),
                "model_type": model.config.model_type,
                "num_hidden_layers": model.config.num_hidden_layers,
                "hidden_size": model.config.hidden_size,
                "storage_dtype": storage,
                "retriever": self.retriever_name,
                "embedding_dim": None,
                "tokenizer": tokenizer_info,
                "info": info,
            }

        self._open_folder(new_header)
        check_opened_header(
            self.header, self.path, self.fingerprint, self.retriever_name, tokenizer_info, storage_dtype
        )
        self.storage_dtype = STORAGE_DTYPES[self.header["storage_dtype"]]
        self._by_content: dict[bytes, str] | None = None  # canonical [text, metadata] -> live entry id, for add
        self._content_of: dict[str, bytes] = {}  # live entry id -> its key in _by_content

    # ------------------------------------------------------------------------------------ index
    def __len__(self) -> int:
        self.refresh()
        return len(self._entries)

    def ids(self) -> list[str]:
        self.refresh()
        return list(self._entries)

    def __contains__(self, entry_id) -> bool:
        if not is_id(entry_id, "entry"):
            return False
        self.refresh()
        return entry_id in self._entries

    def entries(self, ids: Sequence[str] | None = None) -> list[StoreEntry]:
        """Text and metadata of entries (no state read)."""
        ids = None if ids is None else self._check_ids(ids, "ids")
        self.refresh()
        ids = list(self._entries) if ids is None else ids
        return [self._entry(i) for i in ids]

    def _entry(self, entry_id: str) -> StoreEntry:
        if entry_id not in self._entries:
            raise KeyError(f"no entry {entry_id!r} in the store at {self.path} (deleted, or never added)")
        sid, row = self._entries[entry_id]
        record = self._manifests[sid]["entries"][row]
        return StoreEntry(
            entry_id, record["text"], json.loads(json.dumps(record["metadata"])), int(record["num_tokens"])
        )

    # ------------------------------------------------------------------------------------ add
    def add(
        self,
        texts: Iterable[str],
        metadata: Sequence[dict] | None = None,
        batch_size: int = 16,
        show_progress: bool = True,
    ) -> list[str]:
        """Encode ``texts`` in batches of ``batch_size`` (one forward each, no logits) and store them.

        Each batch is committed as one shard before the next is encoded, so an interruption keeps every
        finished batch. Returns the entries' ids, in order. A text already stored with the same metadata
        (rerunning a script, resuming an interrupted ``add``) is not encoded again: its id is returned;
        repeats within one call are one entry. New entries' ids come from their content
        (:func:`~hf_statecompose.store.format.content_id`; a random id where that one is taken, e.g. by
        a deleted entry not yet compacted).
        """
        texts, metadata, batch_size = self._check_add(texts, metadata, batch_size)
        keys = [canonical([text, meta]) for text, meta in zip(texts, metadata)]
        with self._locked(shared=True):
            self.refresh()
            stored = self._content_index()
            first: dict[bytes, int] = {}
            for n, key in enumerate(keys):
                if key not in stored:
                    first.setdefault(key, n)
        todo = list(first.values())
        found = {key: stored[key] for key in keys if key in stored}
        progress = progress_bar(len(todo), show_progress)
        try:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                found.update(
                    zip(
                        (keys[n] for n in chunk),
                        self._add_batch([texts[n] for n in chunk], [metadata[n] for n in chunk]),
                    )
                )
                progress.update(len(chunk))
        finally:
            progress.close()
        return [found[key] for key in keys]

    def _content_index(self) -> dict[bytes, str]:
        """Canonical JSON of [text, metadata] -> id, over the live entries (kept up to date as they change)."""
        if self._by_content is None or any(i not in self._entries for i in self._content_of):
            self._by_content, self._content_of = {}, {}
        for entry_id, (sid, row) in self._entries.items():
            if entry_id not in self._content_of:
                record = self._manifests[sid]["entries"][row]
                key = self._content_of[entry_id] = canonical([record["text"], record["metadata"]])
                self._by_content.setdefault(key, entry_id)
        return self._by_content

    def _add_batch(self, texts: list[str], metadata: list[dict]) -> list[str]:
        input_ids, mask, token_lists = self._tokenize(texts)
        state = ComposableMambaCache.encode(self.model, input_ids, attention_mask=mask)
        return self._write_shard(state, texts, metadata, token_lists, self._embed(texts))

    def _write_shard(
        self,
        state: ComposableMambaCache,
        texts: list[str],
        metadata: list[dict],
        token_lists: list[list[int]],
        embeddings: torch.Tensor,
    ) -> list[str]:
        """Commit the rows of ``state`` (one per text) as one new shard; returns their ids. The shard is
        built outside the writers' lock (hashing and serialising take time), then checked again under
        it: rows another process stored meanwhile (same text and metadata) are not written again."""
        check_finite(state, "the encoded batch")
        sid = uuid.uuid4().hex
        keys = [canonical([text, meta]) for text, meta in zip(texts, metadata)]
        with self._locked(shared=True):
            self.refresh()
            plan = self._plan(keys, texts, metadata)
        built = self._shard(sid, plan, state, texts, metadata, token_lists, embeddings)
        with self._locked():  # (compaction removes uncommitted tensors: never run it between our two writes)
            self.refresh()
            again = self._plan(keys, texts, metadata, previous=plan)
            if again != plan:  # another process committed some of these texts meanwhile
                plan, built = again, self._shard(sid, again, state, texts, metadata, token_lists, embeddings)
            if built is not None:
                payload, manifest = built
                self._check_embedding_dim(int(embeddings.shape[1]))
                self._commit_shard(sid, payload, manifest)
        return [entry_id for entry_id, _ in plan]

    def _plan(
        self, keys: list[bytes], texts: list[str], metadata: list[dict], previous: list | None = None
    ) -> list[tuple[str, bool]]:
        """(id, whether to write it) per row: the id of an equal stored entry, else a new id (the content
        id, or ``previous``'s, unless taken by a live or deleted entry); repeats are removed by ``add``."""
        stored = self._content_index()
        plan, taken = [], set()
        for n, key in enumerate(keys):
            if key in stored:
                plan.append((stored[key], False))
                continue
            entry_id = previous[n][0] if previous and previous[n][1] else content_id(texts[n], metadata[n])
            while entry_id in self._entries or entry_id in self._deleted or entry_id in taken:
                entry_id = uuid.uuid4().hex[:16]  # taken: by a deleted entry not yet compacted (or a hash collision)
            taken.add(entry_id)
            plan.append((entry_id, True))
        return plan

    # ------------------------------------------------------------------------------------ read
    def get(self, ids: Sequence[str] | str, device=None) -> list[ComposableMambaCache] | ComposableMambaCache:
        """The states of ``ids`` (one id: one state), read lazily; each entry is checked against its
        checksum the first time this process reads it from its (unchanged) shard file."""
        single, ids = self._check_one_or_many(ids)
        device = device if device is not None else next(self.model.parameters()).device
        with self._locked(shared=True):
            self.refresh()
            missing = [i for i in ids if i not in self._entries]
            if missing:
                raise KeyError(f"no entries {missing[:5]} in the store at {self.path} (deleted, or never added)")
            out = self._get(ids, device)
        return out[0] if single else out

    # ------------------------------------------------------------------------------------ retrieve
    def retrieve(
        self, query: str, k: int = 5, exclude: Iterable[str] = (), load_states: bool = True
    ) -> list[StoreEntry]:
        """The ``k`` entries most similar to ``query`` (cosine), best first, with their states."""
        k, exclude_ids = self._check_query(query, k, exclude)
        excluded = set(exclude_ids)
        query_vector = self._embed([query])[0] if k > 0 else None
        with self._locked(shared=True):
            self.refresh()
            ids, matrix = self._flat_index()
            count = len(ids) - sum(1 for i in excluded if i in self._entries)
            if query_vector is None or count == 0:  # k == 0 or nothing left
                return []
            if matrix.shape[1] != query_vector.shape[0]:
                raise ValueError(
                    f"the retriever returned a {query_vector.shape[0]}-dim query vector; the store holds {matrix.shape[1]}-dim ones"
                )
            scores = matrix @ query_vector
            if excluded:
                scores[[n for n, entry_id in enumerate(ids) if entry_id in excluded]] = float("-inf")
            top = torch.topk(scores, min(k, count))
            picked = [ids[i] for i in top.indices.tolist()]
            entries = [self._entry(i) for i in picked]
            for entry, score in zip(entries, top.values.tolist()):
                entry.score = float(score)
            if load_states:
                device = next(self.model.parameters()).device
                for entry, state in zip(entries, self._get(picked, device)):
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
            matrix = (
                torch.cat([self._shard_embeddings(sid)[rows] for sid, (_, rows) in groups.items()])
                if groups
                else torch.zeros(0, 0)
            )
            self._flat = ([i for ids, _ in groups.values() for i in ids], matrix)
        return self._flat

    # ------------------------------------------------------------------------------------ delete / compact
    def delete(self, ids: Sequence[str] | str, missing_ok: bool = False) -> None:
        """Delete entries, all or (a crash included) none: one sealed tombstone file
        ``deleted/<32 hex>.json`` lists them, written atomically; their bytes go at the next
        :meth:`compact`. Ids not in the store are a ``KeyError`` naming them, raised before anything
        changes; ``missing_ok=True`` ignores them (a retried delete is then a no-op)."""
        _, ids = self._check_one_or_many(ids)
        with self._locked():
            self.refresh()
            missing = [i for i in ids if i not in self._entries]
            if missing and not missing_ok:
                raise KeyError(
                    f"no entries {missing[:5]} in the store at {self.path} (deleted, or never added); "
                    "pass missing_ok=True to ignore them"
                )
            todo = sorted({i for i in ids if i in self._entries})
            if todo:
                self._write_tombstone(todo)
                self.refresh()

    def compact(self) -> dict:
        """Rewrite shards holding deleted entries without them, finish an interrupted compaction, drop
        orphan files; returns what it did. Safe to kill at any point (see the module docstring)."""
        removed_entries = rewritten = 0
        with self._locked():
            self._manifests.clear()  # re-read and re-verify every manifest from disk
            self._embeddings.clear()
            self.refresh()  # refuses a damaged store before anything is changed
            superseded = {s for m in self._manifests.values() for s in m["supersedes"]}
            # 1. what a killed compaction left: superseded manifests (first: that uncommits them) and shards
            superseded_removed = self._remove_superseded(superseded)
            # 2. rewrite each live shard that holds deleted entries
            for sid in list(self._live_shards):
                manifest = self._manifests[sid]
                keep = [r for r in manifest["entries"] if r["id"] in self._entries]
                dropped = len(manifest["entries"]) - len(keep)
                if not dropped:
                    continue
                if keep:
                    self._rewrite_shard(sid, manifest, keep)  # commits a manifest that supersedes sid
                self._drop_shard(sid)
                removed_entries += dropped
                rewritten += 1
            # 3. orphans: tensors without a manifest, temporary files of killed writes
            orphans = self._remove_orphans()
            # 4. tombstones of entries no manifest lists any more
            self._remove_spent_tombstones()
        return {
            "removed_entries": removed_entries,
            "rewritten_shards": rewritten,
            "orphan_files_removed": orphans,
            "superseded_shards_removed": superseded_removed,
        }

    # ------------------------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Entries and bytes: ``entries``, ``shards``, ``deleted_pending`` (tombstoned, not yet compacted),
        ``bytes`` (all files), ``state_bytes_per_entry`` (tensor bytes of one entry's state),
        ``storage_dtype``, ``orphan_files``, ``superseded_shards``, ``retriever``; read from the store's files
        (:meth:`~hf_statecompose.store.folder_index.ShardIndex.folder_stats`, which
        :func:`~hf_statecompose.store.folder_index.read_folder_stats` runs without a model)."""
        return self.folder_stats()

    def __repr__(self):
        return (
            f"FolderStateStore({str(self.path)!r}, entries={len(self)}, storage_dtype={self.header['storage_dtype']!r})"
        )


register_backend("folder", FolderStateStore)
