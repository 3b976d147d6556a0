"""The on-disk protocol of the folder store (:class:`~hf_statecompose.store.folder.FolderStateStore`, whose API
is in ``folder.py``): the files, the locks, the atomic writes, reading and writing shards, manifests and tombstones,
and the steps of compaction. The checks of an entry's tensors against the model, and the states made from them,
are the store's (:class:`~hf_statecompose.store.StateStore`): this module calls them.

Layout of a store directory::

    store.json                  created once: format, model fingerprint and summary, storage dtype,
                                retriever name and dimension, tokenizer record, free-form ``info``;
                                sealed with a digest of its own canonical content
    shards/<sid>.safetensors    the states of one ``add`` batch: per entry and layer ``<id>.ssm.<l>``,
                                ``<id>.conv.<l>``, ``<id>.delta_sum.<l>``, plus ``<id>.token_ids``
                                (a hybrid model's entries: per attention layer ``i`` also
                                ``<id>.attn.keys.<i>``, ``<id>.attn.values.<i>``, ``<id>.attn.positions.<i>``,
                                for the entry's own tokens); per shard ``A.<l>`` and ``embeddings`` [n, E]
    shards/<sid>.json           the shard's manifest: its shard id, the model fingerprint, the shard file's
                                size, entries (id, text, metadata, tokens, checksum), the checksums of the
                                embeddings and of ``A``, the shards it ``supersedes``; sealed with a digest
                                of its own canonical content. **Its existence commits the shard.**
    deleted/<tid>.json          one tombstone file per ``delete`` call: the ids it deletes, sealed (until
                                compaction rewrites their shards); ``deleted/<id>`` (empty, one per
                                id, written by older versions) is read too
    .lock                       ``flock``-ed: exclusively by writers, shared by readers

A store whose ``store.json``, ``shards``, ``deleted`` or ``.lock`` is a symbolic link is refused, and
compaction only ever removes regular files (``lstat``), so it never reaches files outside the store.

Ids (entries: 16 hex digits, shards: 32) are checked against one pattern on every input path (``get``,
``delete``, ``exclude``, ``entries`` and every manifest read from disk), so no id can name a file
outside the store.

Why it cannot lose data or serve a wrong one:

* every file is written to a temporary name in the same folder, fsynced, then renamed, and the folder
  fsynced: a reader sees the whole file or none;
* a shard's tensors are renamed into place before its manifest, so a committed shard is complete; a
  process killed mid-``add`` leaves at most an orphan ``.safetensors`` (ignored, removed by
  :meth:`StateStore.compact`);
* compaction never edits a committed file: it writes a new shard and a manifest that *supersedes* the
  old shard, then removes the old files. Readers ignore superseded manifests, so at every instant (a
  ``kill -9`` included) each entry id is in exactly one live manifest. Every entry of a superseded
  shard is listed by a manifest superseding it or deleted (true at every step): a store where that
  fails (a forged manifest) is refused by readers and by compaction, which then removes nothing;
* a ``delete`` of several ids is one atomic file: after a crash all of them are deleted or none;
* writers hold an exclusive ``flock``, readers a shared one: a reader sees the store before or after a
  commit, delete or compaction, never half of it;
* manifests, tombstone files and ``store.json`` carry a digest of their content and every manifest the
  model fingerprint: a flipped byte is refused, never read as other text or metadata, and a lost
  ``store.json`` does not let another model adopt the shards. The digests guard against accidents (bit
  flips, truncation, hand edits, files from another store or model), not against an attacker with write
  access, who can recompute them;
* every entry's tensors carry a SHA-256 checksum, the embeddings and ``A`` too. An entry is verified
  (checksum, shapes, finite values, ΣΔ >= 0) the first time this process reads it from a given shard
  file (same inode, size, mtime and ctime); later reads of the unchanged file skip the hash, and any
  change to the file makes the next read verify again.

Reads are lazy: :meth:`StateStore.get` memory-maps the shard (``state.files.MappedSafetensors``, the
reading of ``safetensors.safe_open`` at a few microseconds a tensor) and reads only
the requested entries' tensors. As with ``safetensors.torch.load_file``, the fp32 tensors it returns map
the file privately (copy on write: changing them never changes the store). The store never rewrites a
file in place (compaction writes new files and unlinks old ones, which leaves existing mappings valid);
a shard edited in place by another program while its states are in use is not supported. Each
returned state owns its ``A`` (a copy of the store's verified one).

A read-only store (read-only mount, no write permission) opens and reads (``.lock`` opened read-only,
nothing created); ``add``, ``delete`` and ``compact`` then raise one ``PermissionError``.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from ..state.cache import ComposableMambaCache
from ..state.files import MappedSafetensors, atomic_write, fsync_dir
from ..state.validation import expected_num_layers
from .folder_index import ShardIndex, _identity
from .format import (
    FORMAT_VERSION,
    all_finite,
    check_id,
    checksum,
    is_id,
    seal,
)


# ------------------------------------------------------------------------------------ file changes
# Every change the store makes to its folder goes through these two, so that the crash tests can stop
# a process before any one of them (and nothing else writes or removes files).
def _write(path: Path, data: bytes) -> None:
    atomic_write(path, data)


def _remove(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def _run_all(fn, jobs: list[tuple]) -> None:
    """``fn(*job)`` for every job, on threads when there are several: hashing and reductions release the
    GIL, so verifying k entries uses the cores. The first error is raised."""
    if len(jobs) <= 1:
        for job in jobs:
            fn(*job)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        for _ in pool.map(lambda job: fn(*job), jobs):
            pass


# per process: shard file path -> (its identity when verified, names verified: entry ids, "A", "embeddings")
_VERIFIED: dict[str, tuple[tuple, set]] = {}
_VERIFIED_LOCK = threading.Lock()


def _verified(path: Path, identity: tuple) -> set:
    with _VERIFIED_LOCK:
        known = _VERIFIED.get(str(path))
        if known is None or known[0] != identity:
            known = _VERIFIED[str(path)] = (identity, set())
        return known[1]


class ShardFolder(ShardIndex):
    """The folder store's files: a mixin of :class:`~hf_statecompose.store.folder.FolderStateStore`, which sets
    ``path`` and ``fingerprint`` and provides the checks of an entry against the model (``_entry_tensor_names``,
    ``_check_entry_tensors``) and the state made from checked tensors (``_state``), all from
    :class:`~hf_statecompose.store.StateStore`."""

    path: Path
    fingerprint: str
    header: dict
    model: torch.nn.Module
    _entry_tensor_names: Callable[[int], list[str]]
    _check_entry_tensors: Callable[..., None]
    _entry_tensors: Callable[..., dict[str, torch.Tensor]]
    _state: Callable[..., ComposableMambaCache]

    # ------------------------------------------------------------------------------------ opening
    def _open_folder(self, new_header: Callable[[], dict]) -> None:
        """Make the folders (if missing), write ``store.json`` from ``new_header()`` if there is
        none (refused where shard manifests exist without it), read it into ``header`` and start the index."""
        self._start_index()
        if (self.path / "store_header.lance").exists():
            raise ValueError(f"{self.path} holds a Lance store: open it with StateStore(..., backend='lance')")
        self._check_links()
        for folder in ("shards", "deleted"):  # (a store on a read-only filesystem has them: no mkdir)
            if not (self.path / folder).is_dir():
                try:
                    (self.path / folder).mkdir(parents=True, exist_ok=True)
                except OSError as error:
                    raise self._read_only(error) from None
        header_path = self.path / "store.json"
        with self._locked(shared=header_path.exists()):
            if not header_path.exists():
                committed = [p.name for p in (self.path / "shards").iterdir() if p.suffix == ".json"]
                if committed:
                    raise ValueError(
                        f"{header_path} is missing but {self.path / 'shards'} holds {len(committed)} shard manifests: "
                        "restore store.json from a backup (a store is never re-adopted without it: another model, "
                        "tokenizer or retriever would read its states wrongly)"
                    )
                _write(header_path, seal(new_header()))
            self.header = self._read_header()
        self._embeddings: dict[str, torch.Tensor] = {}  # shard id -> verified [n, E]
        self._A: dict[str, list[torch.Tensor]] = {}  # A checksum -> verified A tensors (normally one for all shards)
        self._flat: tuple[list[str], torch.Tensor] | None = None  # live ids and their embeddings, for retrieve

    # ------------------------------------------------------------------------------------ write
    def _shard(
        self,
        sid: str,
        plan: list[tuple[str, bool]],
        state: ComposableMambaCache,
        texts: list[str],
        metadata: list[dict],
        token_lists: list[list[int]],
        embeddings: torch.Tensor,
    ) -> tuple[bytes, dict] | None:
        """(shard file bytes, manifest) of the rows ``plan`` writes (``None``: none)."""
        from safetensors.torch import save

        rows = [row for row, (_, new) in enumerate(plan) if new]
        if not rows:
            return None
        tensors: dict[str, torch.Tensor] = {"embeddings": embeddings[rows].contiguous()}
        shared = {
            f"A.{layer}": state.A[layer].detach().to("cpu", torch.float32).contiguous()
            for layer in range(state.num_layers)
        }
        tensors.update(shared)
        records = []
        for row in rows:
            entry_id, tokens = plan[row][0], token_lists[row]
            entry_tensors = self._entry_tensors(state, row, tokens)
            tensors.update({f"{entry_id}.{name}": t for name, t in entry_tensors.items()})
            records.append(
                {
                    "id": entry_id,
                    "text": texts[row],
                    "metadata": metadata[row],
                    "num_tokens": len(tokens),
                    "checksum": checksum(entry_tensors),
                }
            )
        payload = save(tensors, metadata={"hf_statecompose_store": "shard"})
        manifest = {
            "format_version": FORMAT_VERSION,
            "kind": "shard",
            "shard": sid,
            "fingerprint": self.fingerprint,
            "shard_size": len(payload),
            "supersedes": [],
            "entries": records,
            "embeddings_checksum": checksum({"embeddings": tensors["embeddings"]}),
            "shared_checksum": checksum(shared),
        }
        return payload, manifest

    def _commit_shard(self, sid: str, payload: bytes, manifest: dict) -> None:
        """Write a built shard: its tensors first, then its manifest, whose existence commits it (under the
        writers' lock: compaction removes uncommitted tensors, never run it between the two writes)."""
        shard_dir = self.path / "shards"
        _write(shard_dir / f"{sid}.safetensors", payload)  # tensors first ...
        _write(shard_dir / f"{sid}.json", seal(manifest))  # ... then the commit

    def _check_embedding_dim(self, dim: int) -> None:
        header = self._read_header()
        if header.get("embedding_dim") is None:
            header["embedding_dim"] = dim
            _write(self.path / "store.json", seal(header))
        elif header["embedding_dim"] != dim:
            raise ValueError(
                f"the retriever returned {dim}-dim vectors; the store holds {header['embedding_dim']}-dim ones"
            )
        self.header = header

    def _write_tombstone(self, ids: list[str]) -> None:
        """One sealed tombstone file ``deleted/<32 hex>.json`` listing ``ids``, written atomically: a delete of
        all of them or (a crash included) none."""
        record = {
            "format_version": FORMAT_VERSION,
            "kind": "tombstones",
            "fingerprint": self.fingerprint,
            "ids": ids,
        }
        _write(self.path / "deleted" / f"{uuid.uuid4().hex}.json", seal(record))

    # ------------------------------------------------------------------------------------ read
    def _shard_path(self, sid: str) -> Path:
        return self.path / "shards" / f"{check_id(sid, 'shard')}.safetensors"

    def _open_shard(self, sid: str):
        """(handle, identity) of a committed shard, its size checked against the manifest; the handle maps the
        file (:class:`~hf_statecompose.state.files.MappedSafetensors`, what ``safetensors.safe_open`` gives, faster
        per tensor)."""
        path = self._shard_path(sid)
        try:
            identity = _identity(path)
        except FileNotFoundError:
            raise ValueError(
                f"{path} is missing although its manifest exists: the store was damaged (files removed by hand?)"
            ) from None
        expected = self._manifests[sid]["shard_size"]
        if identity[2] != expected:
            raise ValueError(
                f"{path} is truncated or corrupted ({identity[2]} bytes, its manifest says {expected}); delete its entries and re-add them"
            )
        try:
            return MappedSafetensors(path), identity
        except Exception as error:
            raise ValueError(
                f"{path} is truncated or corrupted ({error}); delete its entries and re-add them"
            ) from None

    def _shard_embeddings(self, sid: str) -> torch.Tensor:
        if sid not in self._embeddings:
            handle, _ = self._open_shard(sid)
            with handle:
                embeddings = self._tensor(handle, sid, "embeddings")
            manifest = self._manifests[sid]
            if checksum({"embeddings": embeddings}) != manifest["embeddings_checksum"]:
                raise ValueError(f"shard {sid} of {self.path}: embeddings do not match their checksum (corrupted file)")
            if (
                tuple(embeddings.shape) != (len(manifest["entries"]), self.header.get("embedding_dim"))
                or embeddings.dtype != torch.float32
            ):
                raise ValueError(
                    f"shard {sid} of {self.path}: embeddings of shape {tuple(embeddings.shape)} do not fit its entries"
                )
            self._embeddings[sid] = embeddings
        return self._embeddings[sid]

    def _tensor(self, handle, sid: str, name: str) -> torch.Tensor:
        try:
            return handle.get_tensor(name)
        except Exception as error:
            raise ValueError(
                f"shard {sid} of {self.path}: tensor {name} missing or unreadable ({error}); the file is corrupted"
            ) from None

    def _get(self, ids: list[str], device) -> list[ComposableMambaCache]:
        by_shard: dict[str, list[str]] = {}
        for entry_id in ids:
            by_shard.setdefault(self._entries[entry_id][0], []).append(entry_id)
        for force in (False, True):  # a second pass, verifying everything, if a file changed while read
            reads, jobs = {}, []
            for sid, shard_ids in by_shard.items():
                handle, identity = self._open_shard(sid)
                path = self._shard_path(sid)
                verified = _verified(path, identity)
                if force:
                    verified.clear()
                manifest = self._manifests[sid]
                with handle:  # the tensors map the file: they stay valid once the handle is closed
                    A = self._shard_A(handle, sid, manifest["shared_checksum"])
                    tensors = {
                        entry_id: self._read_entry_tensors(handle, sid, entry_id, len(A)) for entry_id in shard_ids
                    }
                records = {entry_id: manifest["entries"][self._entries[entry_id][1]] for entry_id in shard_ids}
                jobs += [(sid, records[i], tensors[i], len(A)) for i in shard_ids if i not in verified]
                reads[sid] = (path, identity, verified, A, tensors, records)
            _run_all(self._verify_entry, jobs)
            if all(_identity(path) == identity for path, identity, *_ in reads.values()):
                break
        else:
            raise ValueError(
                f"shards of {self.path} keep changing while they are read (is another program writing them?)"
            )
        states = {}
        for _, _, verified, A, tensors, records in reads.values():
            verified.update(tensors)
            for entry_id, entry_tensors in tensors.items():
                states[entry_id] = self._state(entry_tensors, records[entry_id], A, device)
        return [states[i] for i in ids]

    def _shard_A(self, handle, sid: str, expected: str) -> list[torch.Tensor]:
        # A is the model's (the same in every shard): keep one verified copy per checksum, read no more
        if expected not in self._A:
            num_layers = expected_num_layers(self.model.config)
            A = [self._tensor(handle, sid, f"A.{layer}") for layer in range(num_layers)]
            if checksum({f"A.{layer}": a for layer, a in enumerate(A)}) != expected:
                raise ValueError(
                    f"shard {sid} of {self.path}: its A tensors do not match their checksum (corrupted file)"
                )
            if not all(all_finite(a) for a in A):
                raise ValueError(f"shard {sid} of {self.path}: its A tensors hold NaN/inf")
            self._A[expected] = A
        return self._A[expected]

    def _read_entry_tensors(self, handle, sid: str, entry_id: str, num_layers: int) -> dict[str, torch.Tensor]:
        names = self._entry_tensor_names(num_layers)
        return {name: self._tensor(handle, sid, f"{entry_id}.{name}") for name in names}

    def _verify_entry(self, sid: str, record: dict, tensors: dict, num_layers: int) -> None:
        where = f"entry {record['id']} (shard {sid}) of {self.path}"
        if checksum(tensors) != record["checksum"]:
            raise ValueError(f"{where}: data does not match its checksum (corrupted); delete and re-add it")
        self._check_entry_tensors(where, tensors, record["num_tokens"], num_layers)

    # ------------------------------------------------------------------------------------ compaction steps
    # (FolderStateStore.compact runs them in this order, under the writers' lock; each is safe to kill at any point)
    def _remove_superseded(self, superseded: set[str]) -> int:
        """Step 1: what a killed compaction left, the files of superseded shards. Each shard's manifest goes
        first: that uncommits it, so a kill between the two removals leaves at most orphan tensors (removed by
        step 3), never a manifest without its tensors. Returns how many shards lost a file."""
        removed = 0
        shard_dir = self.path / "shards"
        for sid in sorted(superseded):
            gone = _remove(shard_dir / f"{sid}.json")
            gone = _remove(shard_dir / f"{sid}.safetensors") or gone
            removed += gone
        return removed

    def _drop_shard(self, sid: str) -> None:
        """Step 2, after the shard's kept entries are committed elsewhere (:meth:`_rewrite_shard`), or none is
        kept: remove its manifest (uncommitting it) then its tensors."""
        shard_dir = self.path / "shards"
        _remove(shard_dir / f"{sid}.json")
        _remove(shard_dir / f"{sid}.safetensors")

    def _rewrite_shard(self, sid: str, manifest: dict, keep: list[dict]) -> str:
        """Write a new shard with the ``keep`` entries of ``sid`` (verified first: corruption is never
        re-checksummed into validity) and commit its manifest, which supersedes ``sid``."""
        from safetensors.torch import save

        kept = {r["id"] for r in keep}
        rows = [row for row, r in enumerate(manifest["entries"]) if r["id"] in kept]
        embeddings = self._shard_embeddings(sid)[rows].contiguous()
        handle, _ = self._open_shard(sid)
        with handle:
            # this file's own A bytes, verified (not a cached copy from another shard)
            A = [self._tensor(handle, sid, f"A.{layer}") for layer in range(expected_num_layers(self.model.config))]
            if checksum({f"A.{layer}": a for layer, a in enumerate(A)}) != manifest["shared_checksum"]:
                raise ValueError(
                    f"shard {sid} of {self.path}: its A tensors do not match their checksum (corrupted file); compaction stopped"
                )
            tensors: dict[str, torch.Tensor] = {"embeddings": embeddings}
            tensors.update({f"A.{layer}": a for layer, a in enumerate(A)})
            num_layers = len(A)
            for record in keep:
                entry = self._read_entry_tensors(handle, sid, record["id"], num_layers)
                self._verify_entry(sid, record, entry, num_layers)
                tensors.update({f"{record['id']}.{name}": t for name, t in entry.items()})
        payload = save(tensors, metadata={"hf_statecompose_store": "shard"})
        new_sid = uuid.uuid4().hex
        new_manifest = {
            "format_version": FORMAT_VERSION,
            "kind": "shard",
            "shard": new_sid,
            "fingerprint": self.fingerprint,
            "shard_size": len(payload),
            "supersedes": sorted({sid, *manifest["supersedes"]}),
            "entries": keep,
            "embeddings_checksum": checksum({"embeddings": embeddings}),
            "shared_checksum": manifest["shared_checksum"],
        }
        shard_dir = self.path / "shards"
        _write(shard_dir / f"{new_sid}.safetensors", payload)
        _write(shard_dir / f"{new_sid}.json", seal(new_manifest))
        return new_sid

    def _remove_orphans(self) -> int:
        """Step 3: tensors without a manifest, temporary files of killed writes (regular files only: links are
        never followed, nor removed). Returns how many files went."""
        orphans = 0
        shard_dir = self.path / "shards"
        committed = {
            name[:-5] for name in os.listdir(shard_dir) if name.endswith(".json") and is_id(name[:-5], "shard")
        }
        for folder in (shard_dir, self.path / "deleted", self.path):
            for name in _own_files(folder):
                orphan = name.startswith(".tmp-") or (
                    folder == shard_dir
                    and name.endswith(".safetensors")
                    and is_id(name[: -len(".safetensors")], "shard")
                    and name[: -len(".safetensors")] not in committed
                )
                if orphan and _remove(folder / name):
                    orphans += 1
        return orphans

    def _remove_spent_tombstones(self) -> None:
        """Step 4: tombstones of entries no manifest lists any more (per-id files, and tombstone files of which
        no id is listed), after re-reading every manifest."""
        self._manifests.clear()
        self._embeddings.clear()
        self.refresh()
        listed = {r["id"] for m in self._manifests.values() for r in m["entries"]}
        for name in _own_files(self.path / "deleted"):
            if (is_id(name, "entry") and name not in listed) or (
                name in self._tombstones and not any(i in listed for i in self._tombstones[name])
            ):
                _remove(self.path / "deleted" / name)
        self.refresh()


def _own_files(folder: Path) -> list[str]:
    """Names of the regular files in ``folder`` (``lstat``: a link is never followed), sorted."""
    with os.scandir(folder) as listing:
        return sorted(item.name for item in listing if item.is_file(follow_symlinks=False))
