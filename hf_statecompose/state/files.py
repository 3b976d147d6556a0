"""Crash-safe file writes shared by state files, the store and the benchmarks' JSON; a memory-mapped
safetensors reader for the store's hot read path."""

from __future__ import annotations

import json
import mmap
import os
import secrets
import struct
import threading

import torch


def atomic_write(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one, never half:
    a temporary file in the same folder, fsynced, renamed over ``path``, then the folder fsynced.

    The file gets the mode any new file gets (``0o666`` less the process's umask: ``0o644`` under the usual
    umask 022), as ``open(path, "wb")`` would give it: ``tempfile.mkstemp`` makes ``0o600`` files, which other
    users and tools could not read in a shared store."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    fd, tmp = _new_temporary(directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def _new_temporary(directory: str) -> tuple[int, str]:
    """``(fd, path)`` of a new, empty, hidden file in ``directory``, created with ``O_EXCL`` (never an existing
    file, nor a link's target) and mode ``0o666``, which the kernel narrows by the umask."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(directory, f".tmp-{secrets.token_hex(8)}")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:  # 2**64 names: only a hostile folder gets here twice
            continue
    raise FileExistsError(f"no free temporary file name in {directory}")


def fsync_dir(directory) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# safetensors' dtype names (https://github.com/huggingface/safetensors, "Format"): the ones torch has
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100_000_000  # as safetensors: a larger header is a corrupted (or hostile) file
_HEADERS: dict[str, tuple[tuple, tuple[dict, int]]] = {}  # path -> (file identity, (entries, data offset))
_HEADERS_KEPT = 256
_HEADERS_LOCK = threading.Lock()


class MappedSafetensors:
    """A safetensors file mapped privately into memory, its tensors views of the mapping: what
    ``safetensors.safe_open(path, framework="pt", device="cpu")`` gives for ``keys`` / ``get_tensor`` /
    ``metadata``, at a few microseconds a tensor instead of tens (the store reads ~70 tensors per state).

    The mapping is copy on write (``mmap.ACCESS_COPY``, as safetensors maps): writing into a returned
    tensor never changes the file; each tensor keeps the mapping alive, so closing (``with``) the reader
    leaves its tensors valid. The header is checked as safetensors checks it (a JSON object of known
    dtypes, shapes of non-negative ints, byte ranges that tile the data section exactly, each the size of
    its shape); anything else raises ``ValueError``. A tensor whose offset is not a multiple of its
    element size (never in a file safetensors wrote: it orders tensors by alignment) is copied.
    The parsed header of an unchanged file is reused by the next reader (per process, the last
    ``_HEADERS_KEPT`` files). Reference: ``safetensors.safe_open``, compared in tests/test_store_read.py.
    """

    def __init__(self, path):
        with open(path, "rb") as handle:
            st = os.fstat(handle.fileno())
            if st.st_size < 8:
                raise ValueError(f"{st.st_size} bytes: too short for a safetensors header")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        # the header of an unchanged file (same device, inode, size, mtime, ctime as when it was parsed) is
        # parsed once per process; the identity is the opened file's own (fstat), not the path's
        key, identity = (
            os.path.abspath(os.fspath(path)),
            (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns),
        )
        with _HEADERS_LOCK:
            known = _HEADERS.get(key)
        if known is not None and known[0] == identity:
            self._entries, self._base = known[1]
        else:
            self._entries, self._base = _parse_header(self._map, st.st_size)
            with _HEADERS_LOCK:
                _HEADERS[key] = (identity, (self._entries, self._base))
                while len(_HEADERS) > _HEADERS_KEPT:
                    del _HEADERS[next(iter(_HEADERS))]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def keys(self) -> list[str]:
        return [name for name in self._entries if name != "__metadata__"]

    def metadata(self) -> dict | None:
        metadata = self._entries.get("__metadata__")
        return None if metadata is None else dict(metadata)

    def nbytes(self, name: str) -> int:
        begin, end = self._info(name)["data_offsets"]
        return end - begin

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self._info(name)
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        offset = self._base + begin
        if end == begin:
            return torch.empty(info["shape"], dtype=dtype)
        if offset % dtype.itemsize:  # unaligned: a copy (frombuffer would make a misaligned tensor)
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=offset).clone()
            return raw.view(dtype).view(info["shape"])
        return torch.frombuffer(self._map, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=offset).view(
            info["shape"]
        )

    def _info(self, name: str) -> dict:
        info = self._entries.get(name) if name != "__metadata__" else None
        if info is None:
            raise KeyError(f"no tensor named {name!r} in the file")
        return info


def _parse_header(data, size: int) -> tuple[dict, int]:
    """(the header's entries, the data section's offset), checked; ``ValueError`` naming the problem."""
    (length,) = struct.unpack("<Q", data[:8])
    if length > _MAX_HEADER or 8 + length > size:
        raise ValueError(f"header length {length} does not fit a file of {size} bytes")
    try:
        entries = json.loads(bytes(data[8 : 8 + length]))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"the header is not JSON ({error})") from None
    if not isinstance(entries, dict):
        raise ValueError("the header is not a JSON object")
    metadata = entries.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise ValueError("the header's __metadata__ is not a map of strings")
    ranges = []
    for name, info in entries.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: no dtype of {', '.join(SAFETENSORS_DTYPES)}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative ints")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} are not two ints")
        numel = 1
        for d in shape:
            numel *= d
        if (
            not 0 <= offsets[0] <= offsets[1]
            or offsets[1] - offsets[0] != numel * SAFETENSORS_DTYPES[info["dtype"]].itemsize
        ):
            raise ValueError(f"tensor {name!r}: bytes {offsets} do not hold its shape {shape}")
        ranges.append(offsets)
    ranges.sort()
    end = 0
    for begin, stop in ranges:  # the tensors tile the data section: no gap, no overlap, nothing after
        if begin != end:
            raise ValueError(f"the tensors' byte ranges do not tile the data (a gap or overlap at {end})")
        end = stop
    if 8 + length + end != size:
        raise ValueError(f"the tensors end at byte {8 + length + end} of a {size}-byte file")
    return entries, 8 + length
