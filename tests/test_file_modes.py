"""Files honour the umask: state files, folder and Lance stores and benchmark JSON get the mode any new file gets
(``0o666`` / ``0o777`` less the umask), as ``open(path, "w")`` and ``mkdir`` would give them; the atomic writes
(a temporary file renamed over the target) included, which ``tempfile.mkstemp`` would make ``0o600``."""

import os
import stat
from contextlib import contextmanager

import pytest
import torch

import hf_statecompose as hsc
from hf_statecompose.benchmarking import write_result

from helpers import tiny_model
from store_helpers import TEXTS, BagOfWords, CharTokenizer

UMASKS = [0o022, 0o077, 0o002]


@contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(root) -> dict[str, int]:
    """Every file and folder under ``root`` (``root`` included): its permission bits."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def check_tree(root, mask):
    found = modes(root)
    assert len(found) > 1, "nothing was written"
    wrong = {}
    for name, bits in found.items():
        full = os.path.join(root, name)
        kind = os.lstat(full).st_mode
        if stat.S_ISLNK(kind):
            continue
        want = (0o777 if stat.S_ISDIR(kind) else 0o666) & ~mask
        if bits != want:
            wrong[name] = (oct(bits), oct(want))
    assert not wrong, wrong


@pytest.mark.parametrize("mask", UMASKS)
def test_state_files_and_benchmark_json_get_the_umask_mode(tmp_path, mask):
    model = tiny_model("mamba2")
    state = hsc.ComposableMambaCache.encode(model, torch.tensor([[3, 4, 5, 6]]))
    with umask(mask):
        state.save(tmp_path / "s.safetensors")
        write_result({"rows": []}, tmp_path / "bench.json")
        (tmp_path / "plain.txt").write_text("a file made the ordinary way")
    plain = stat.S_IMODE(os.stat(tmp_path / "plain.txt").st_mode)
    assert plain == 0o666 & ~mask
    for name in ("s.safetensors", "bench.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == plain, name
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]  # no temporary file left


@pytest.mark.parametrize("mask", UMASKS)
def test_a_folder_store_gets_the_umask_mode_everywhere(tmp_path, mask):
    model = tiny_model("mamba2")
    with umask(mask):
        store = hsc.StateStore(tmp_path / "store", model, CharTokenizer(), retriever=BagOfWords())
        store.add(TEXTS[:3], show_progress=False)
        store.delete([store.ids()[0]])
        store.compact()
    check_tree(tmp_path / "store", mask)


def test_a_lance_store_gets_the_umask_mode_everywhere(tmp_path):
    pytest.importorskip("lancedb")
    model = tiny_model("mamba2")
    mask = 0o022
    with umask(mask):
        store = hsc.StateStore(tmp_path / "s.lance", model, CharTokenizer(), retriever=BagOfWords(), backend="lance")
        store.add(TEXTS[:3], show_progress=False)
    check_tree(tmp_path / "s.lance", mask)


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    """A write that fails after its temporary file was made removes the temporary and keeps the old file."""
    from hf_statecompose.state import files

    target = tmp_path / "x.json"
    files.atomic_write(target, b"old")
    with monkeypatch.context() as patch:
        patch.setattr(files.os, "replace", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
        with pytest.raises(OSError, match="disk gone"):
            files.atomic_write(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(os.listdir(tmp_path)) == ["x.json"]
