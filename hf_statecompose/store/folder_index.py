"""The index of a folder store (:class:`~hf_statecompose.store.folder.FolderStateStore`), read without torch or a
model: ``store.json``, the shard manifests, the tombstones, the locks, and the store's :meth:`ShardIndex.folder_stats`.
:class:`~hf_statecompose.store.folder_disk.ShardFolder` (the on-disk protocol: shards, writes, compaction) extends it;
:func:`read_folder_stats` opens a store read-only with it alone (``hf-statecompose stats``: no model, no torch).
The layout and the guarantees are described in :mod:`hf_statecompose.store.folder_disk`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
from pathlib import Path

from .format import CHECKSUM_PATTERN, FORMAT_VERSION, STORAGE_DTYPE_NAMES, is_id, unseal


def _identity(path: Path) -> tuple:
    """What changes whenever a file's content may have changed (a rewrite in place bumps mtime/ctime)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class ShardIndex:
    """The index of a folder store at ``path``: its header, the manifests of its live shards, its tombstones
    (:meth:`refresh`), under the store's ``flock`` (:meth:`_locked`). ``fingerprint`` is the model's, which every
    manifest and tombstone must carry (a read-only index takes the header's)."""

    path: Path
    fingerprint: str
    header: dict

    def _start_index(self) -> None:
        """The empty index (filled by :meth:`refresh`) and the lock's state."""
        self._thread_lock = threading.RLock()
        self._lock_mode: str | None = None
        self._lock_depth = 0
        self._manifests: dict[str, dict] = {}  # shard id -> manifest (manifests never change: cached by id)
        self._embeddings: dict = {}  # shard id -> verified [n, E] tensor (the full store's, see ShardFolder)
        self._flat: tuple | None = None  # live ids and their embeddings, for retrieve (the full store's)
        self._entries: dict[str, tuple[str, int]] = {}  # live entry id -> (shard id, row)
        self._live_shards: list[str] = []  # manifests not superseded by another
        self._tombstones: dict[str, list[str]] = {}  # tombstone file name -> the ids it deletes (files never change)
        self._deleted: set[str] = set()  # ids tombstoned (live in a manifest or not)

    def _read_header(self) -> dict:
        header_path = self.path / "store.json"
        try:
            raw = json.loads(header_path.read_bytes())
        except (OSError, ValueError):
            raw = None
        if isinstance(raw, dict) and raw.get("format_version") == 1:
            raise ValueError(
                f"{header_path}: a store of format 1 (an older hf_statecompose, no integrity seals); rebuild it from its passages"
            )
        header = unseal(header_path, "header (store.json)")
        if header.get("format_version") != FORMAT_VERSION or header.get("kind") != "hf_statecompose.store":
            raise ValueError(f"{header_path}: unsupported store format version {header.get('format_version')!r}")
        if header.get("storage_dtype") not in STORAGE_DTYPE_NAMES or not isinstance(header.get("tokenizer"), dict):
            raise ValueError(f"{header_path}: malformed store header; restore it from a backup")
        return header

    # ------------------------------------------------------------------------------------ locking
    def _check_links(self) -> None:
        """Refuse a store whose own files are symbolic links: compaction removes files by name in these
        folders, and must never reach files outside the store."""
        for name in ("store.json", "shards", "deleted", ".lock"):
            if os.path.islink(self.path / name):
                raise ValueError(
                    f"{self.path / name} is a symbolic link: a store's files and folders must be its own "
                    "(replace the link by the folder or file it points to)"
                )

    def _read_only(self, error: OSError) -> PermissionError:
        return PermissionError(
            f"the store at {self.path} is read-only: {error.strerror or error} "
            "(reads work; add, delete and compact need write access: copy the store to a writable place)"
        )

    @contextlib.contextmanager
    def _locked(self, shared: bool = False):
        """``flock`` on ``.lock``: exclusive for writers, shared for readers; re-entrant in this object.
        On a read-only store ``.lock`` is opened read-only (``flock`` works on it) and writers are refused."""
        with self._thread_lock:
            if self._lock_depth:
                if self._lock_mode == "shared" and not shared:
                    raise RuntimeError("internal error: exclusive store lock requested under a shared one")
                self._lock_depth += 1
                try:
                    yield
                finally:
                    self._lock_depth -= 1
                return
            self._check_links()
            lock_path = self.path / ".lock"
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
                if not shared and not os.access(self.path / "shards", os.W_OK):
                    os.close(fd)
                    raise PermissionError(errno.EACCES, "no write permission", str(self.path / "shards"))
            except OSError as error:
                if not isinstance(error, PermissionError) and error.errno != errno.EROFS:
                    raise
                if not shared:
                    raise self._read_only(error) from None
                try:
                    fd = os.open(lock_path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                except FileNotFoundError:
                    if error.errno != errno.EROFS:
                        raise PermissionError(
                            f"cannot create {lock_path} to lock the store for reading: {error.strerror or error}"
                        ) from None
                    fd = None  # a read-only filesystem without .lock: no writer can exist, nothing to lock against
            try:
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
                self._lock_mode, self._lock_depth = ("shared" if shared else "exclusive"), 1
                try:
                    yield
                finally:
                    self._lock_mode, self._lock_depth = None, 0
                    if fd is not None:
                        fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                if fd is not None:
                    os.close(fd)

    # ------------------------------------------------------------------------------------ index
    def _read_manifest(self, sid: str) -> dict | None:
        path = self.path / "shards" / f"{sid}.json"
        manifest = unseal(path, f"shard manifest {sid}", missing_ok=True)
        if manifest is None:
            return None

        def bad(why):
            return ValueError(
                f"{path}: {why}; the shard cannot be trusted (restore the file, or move {sid}.json and {sid}.safetensors out of the store to drop its entries)"
            )

        if manifest.get("format_version") != FORMAT_VERSION or manifest.get("kind") != "shard":
            raise bad("not a shard manifest of this store format")
        if manifest.get("shard") != sid:
            raise bad(
                f"it describes shard {str(manifest.get('shard'))[:40]!r}, not the file's own (copied or renamed by hand)"
            )
        if manifest.get("fingerprint") != self.fingerprint:
            raise bad("it was written for another model (fingerprint differs)")
        supersedes, entries = manifest.get("supersedes"), manifest.get("entries")
        if not isinstance(supersedes, list) or not all(is_id(s, "shard") for s in supersedes):
            raise bad("malformed 'supersedes'")
        if not isinstance(entries, list) or not entries:
            raise bad("no entries")
        for record in entries:
            if not (
                isinstance(record, dict)
                and is_id(record.get("id"), "entry")
                and isinstance(record.get("text"), str)
                and isinstance(record.get("metadata"), dict)
                and isinstance(record.get("num_tokens"), int)
                and record["num_tokens"] >= 1
                and isinstance(record.get("checksum"), str)
                and CHECKSUM_PATTERN.fullmatch(record["checksum"])
            ):
                raise bad(f"malformed entry record {str(record)[:80]!r}")
        if len({r["id"] for r in entries}) != len(entries):
            raise bad("an entry id is listed twice")
        for key in ("embeddings_checksum", "shared_checksum"):
            if not isinstance(manifest.get(key), str) or not CHECKSUM_PATTERN.fullmatch(manifest[key]):
                raise bad(f"malformed {key}")
        if not isinstance(manifest.get("shard_size"), int):
            raise bad("malformed shard_size")
        return manifest

    def _load_manifests(self) -> set[str]:
        """Read the manifests on disk into ``_manifests``; returns the superseded shard ids. A damaged
        manifest is an error unless a readable one supersedes it (left by a compaction killed midway)."""
        shard_dir = self.path / "shards"
        listing = {name[:-5] for name in os.listdir(shard_dir) if name.endswith(".json") and is_id(name[:-5], "shard")}
        for sid in list(self._manifests):
            if sid not in listing:
                del self._manifests[sid]
                self._embeddings.pop(sid, None)
        damaged: dict[str, ValueError] = {}
        for sid in sorted(listing - set(self._manifests)):
            try:
                manifest = self._read_manifest(sid)
            except ValueError as error:
                damaged[sid] = error
                continue
            if manifest is not None:
                self._manifests[sid] = manifest
        superseded = {s for m in self._manifests.values() for s in m["supersedes"]}
        for sid, problem in sorted(damaged.items()):
            if sid not in superseded:
                raise problem
        return superseded

    def _load_tombstones(self) -> set[str]:
        """The ids tombstoned in ``deleted/``: one sealed ``<32 hex>.json`` per ``delete`` call (its ids),
        or an empty ``<id>`` per id (written by earlier versions)."""
        deleted, names = set(), set()
        with os.scandir(self.path / "deleted") as listing:
            for item in listing:
                if is_id(item.name, "entry"):
                    deleted.add(item.name)
                elif item.name.endswith(".json") and is_id(item.name[:-5], "shard"):
                    names.add(item.name)
        for name in list(self._tombstones):
            if name not in names:
                del self._tombstones[name]
        for name in sorted(names - set(self._tombstones)):
            path = self.path / "deleted" / name
            record = unseal(path, "tombstone", missing_ok=True)
            if record is None:  # removed by a compaction meanwhile (another process)
                continue
            ids = record.get("ids")
            if (
                record.get("format_version") != FORMAT_VERSION
                or record.get("kind") != "tombstones"
                or record.get("fingerprint") != self.fingerprint
                or not isinstance(ids, list)
                or not ids
                or not all(is_id(i, "entry") for i in ids)
            ):
                raise ValueError(
                    f"{path}: not a tombstone of this store (damaged, or copied from another store); restore it from a backup "
                    "(removing it would bring its deleted entries back)"
                )
            self._tombstones[name] = ids
        for ids in self._tombstones.values():
            deleted.update(ids)
        return deleted

    def _check_superseded(self, superseded: set[str], deleted: set[str]) -> None:
        """Every entry of a superseded shard is listed by a manifest superseding it, or deleted: true at
        every instant of a compaction (kills included), so a manifest claiming otherwise is forged or
        hand-edited, and reading past it (or compacting, which removes superseded shards) would lose
        entries."""
        for sid in sorted(superseded & set(self._manifests)):
            kept = {r["id"] for m in self._manifests.values() if sid in m["supersedes"] for r in m["entries"]}
            lost = [r["id"] for r in self._manifests[sid]["entries"] if r["id"] not in kept and r["id"] not in deleted]
            if lost:
                by = sorted(other for other, m in self._manifests.items() if sid in m["supersedes"])
                raise ValueError(
                    f"{self.path}: shard {sid[:12]}… is superseded by {', '.join(b[:12] + '…' for b in by)}, which lack its entries "
                    f"{lost[:2]} (not deleted either): a forged or hand-edited manifest; nothing was removed. Restore the "
                    "store from a backup, or move the superseding manifests out of shards/"
                )

    def refresh(self) -> None:
        """Re-read the shard manifests and tombstones (other processes may have added, deleted or compacted)."""
        with self._locked(shared=True):
            superseded = self._load_manifests()
            deleted = self._load_tombstones()
            if superseded:
                self._check_superseded(superseded, deleted)
            entries: dict[str, tuple[str, int]] = {}
            owner: dict[str, str] = {}
            for sid in sorted(self._manifests):
                if sid in superseded:
                    continue
                for row, record in enumerate(self._manifests[sid]["entries"]):
                    entry_id = record["id"]
                    if entry_id in owner:
                        raise ValueError(
                            f"entry {entry_id} is listed by two live shard manifests of {self.path} ({owner[entry_id]}, {sid}): "
                            "the store was modified by hand; move one of the two shards (.json and .safetensors) out of the store"
                        )
                    owner[entry_id] = sid
                    if entry_id not in deleted:
                        entries[entry_id] = (sid, row)
            self._live_shards = [sid for sid in sorted(self._manifests) if sid not in superseded]
            self._deleted = deleted
        if entries != self._entries:
            self._entries, self._flat = entries, None

    # ------------------------------------------------------------------------------------ stats
    def _shard_header_bytes(self, sid: str) -> dict:
        """The JSON header of shard ``sid``'s safetensors file (names, dtypes, offsets), read without torch; the
        file's size checked against its manifest."""
        path = self.path / "shards" / f"{sid}.safetensors"
        try:
            size = _identity(path)[2]
        except FileNotFoundError:
            raise ValueError(
                f"{path} is missing although its manifest exists: the store was damaged (files removed by hand?)"
            ) from None
        expected = self._manifests[sid]["shard_size"]
        if size != expected:
            raise ValueError(
                f"{path} is truncated or corrupted ({size} bytes, its manifest says {expected}); delete its entries and re-add them"
            )
        try:
            with open(path, "rb") as file:
                length = int.from_bytes(file.read(8), "little")
                if length <= 0 or 8 + length > size:
                    raise ValueError(f"header length {length}")
                header = json.loads(file.read(length))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (OSError, ValueError) as error:
            raise ValueError(
                f"{path} is truncated or corrupted ({error}); delete its entries and re-add them"
            ) from None
        return header

    def folder_stats(self) -> dict:
        """Entries and bytes: ``entries``, ``shards``, ``deleted_pending`` (tombstoned, not yet compacted),
        ``bytes`` (all files), ``state_bytes_per_entry`` (tensor bytes of one entry's state),
        ``storage_dtype``, ``orphan_files``, ``superseded_shards``, ``retriever``."""
        with self._locked(shared=True):
            self.refresh()
            shard_dir = self.path / "shards"
            total = sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
            names = os.listdir(shard_dir)
            committed = {name[:-5] for name in names if name.endswith(".json") and is_id(name[:-5], "shard")}
            orphans = [
                name
                for name in names
                if name.endswith(".safetensors") and name[: -len(".safetensors")] not in committed
            ]
            all_ids = {r["id"] for sid in self._live_shards for r in self._manifests[sid]["entries"]}
            per_entry = None
            if self._entries:
                entry_id, (sid, _) = next(iter(self._entries.items()))
                tensors = self._shard_header_bytes(sid)
                try:
                    per_entry = sum(
                        int(info["data_offsets"][1]) - int(info["data_offsets"][0])
                        for name, info in tensors.items()
                        if name.startswith(entry_id + ".") and not name.endswith("token_ids")
                    )
                except (KeyError, TypeError, ValueError, IndexError) as error:
                    raise ValueError(
                        f"{shard_dir / (sid + '.safetensors')} is corrupted (its header: {error!r:.80}); delete its entries and re-add them"
                    ) from None
            return {
                "entries": len(self._entries),
                "shards": len(self._live_shards),
                "deleted_pending": len(all_ids) - len(self._entries),
                "bytes": total,
                "state_bytes_per_entry": per_entry,
                "storage_dtype": self.header["storage_dtype"],
                "orphan_files": len(orphans),
                "superseded_shards": len(committed) - len(self._live_shards),
                "retriever": self.header["retriever"],
            }


def read_folder_stats(path) -> dict:
    """:meth:`FolderStateStore.stats <hf_statecompose.store.folder.FolderStateStore.stats>` of the folder store at
    ``path``, read-only and without its model (nor torch): the manifests and tombstones are verified (seals, the
    header's model fingerprint), the tensors are not read. A ``ValueError`` if ``path`` holds no folder store."""
    index = ShardIndex()
    index.path = Path(path)
    if not (index.path / "store.json").is_file():
        raise ValueError(f"no folder store at {path} (no store.json)")
    index._start_index()
    index._check_links()
    with index._locked(shared=True):
        index.header = index._read_header()
    fingerprint = index.header.get("fingerprint")
    if not isinstance(fingerprint, str):
        raise ValueError(f"{index.path / 'store.json'}: malformed store header; restore it from a backup")
    index.fingerprint = fingerprint
    return index.folder_stats()
