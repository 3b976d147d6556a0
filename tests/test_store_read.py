"""The store's memory-mapped safetensors reader (``state.files.MappedSafetensors``, its fast read path)
against its reference, ``safetensors.safe_open``: the same tensors (values, dtypes, shapes) on fresh random
files, the same refusals of broken headers, copy on write, and a re-parse when the file changes."""

from __future__ import annotations

import copy
import json
import os
import struct

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from hf_statecompose.state.files import SAFETENSORS_DTYPES, MappedSafetensors

from helpers import pickle_round_trip, torch_save_round_trip


def random_tensors(generator: torch.Generator, count: int) -> dict[str, torch.Tensor]:
    dtypes = list(SAFETENSORS_DTYPES.values())
    out = {}
    for i in range(count):
        dtype = dtypes[int(torch.randint(len(dtypes), (1,), generator=generator))]
        rank = int(torch.randint(0, 4, (1,), generator=generator))
        shape = torch.randint(0, 6, (rank,), generator=generator).tolist()
        if dtype.is_floating_point:
            tensor = torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
        elif dtype == torch.bool:
            tensor = torch.randint(0, 2, shape, generator=generator).bool()
        else:
            tensor = torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=generator).to(dtype)
        out[f"t{i}.{dtype}".replace("torch.", "")] = tensor
    return out


@pytest.mark.parametrize("seed", range(6))
def test_mapped_reader_equals_safe_open(tmp_path, seed):
    generator = torch.Generator().manual_seed(seed)
    tensors = random_tensors(generator, 40)
    path = tmp_path / "f.safetensors"
    save_file(tensors, path, metadata={"kind": "test", "seed": str(seed)})
    with safe_open(path, framework="pt", device="cpu") as reference, MappedSafetensors(path) as mapped:
        assert sorted(mapped.keys()) == sorted(reference.keys()) == sorted(tensors)
        assert mapped.metadata() == reference.metadata()
        for name in tensors:
            ours, theirs = mapped.get_tensor(name), reference.get_tensor(name)
            assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
            assert torch.equal(ours, theirs), name
            assert mapped.nbytes(name) == theirs.numel() * theirs.element_size()


def test_mapped_tensors_are_copy_on_write_and_outlive_the_reader(tmp_path):
    path = tmp_path / "f.safetensors"
    save_file({"x": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, path)
    before = path.read_bytes()
    with MappedSafetensors(path) as mapped:
        x = mapped.get_tensor("x")
    del mapped
    x.add_(1)  # writes the private mapping, never the file
    assert path.read_bytes() == before
    assert torch.equal(x, torch.arange(1, 7, dtype=torch.float32).reshape(2, 3))
    # the tensor survives deepcopy, pickle and torch.save as any other (loaded back through the suite's restricted
    # unpickler, never a bare pickle.loads / torch.load)
    for clone in (copy.deepcopy(x), pickle_round_trip(x), torch_save_round_trip(x)):
        assert torch.equal(clone, x)
    with MappedSafetensors(path) as again:
        assert torch.equal(again.get_tensor("x"), torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_a_changed_file_is_parsed_again(tmp_path):
    path = tmp_path / "f.safetensors"
    save_file({"x": torch.zeros(3)}, path)
    assert torch.equal(MappedSafetensors(path).get_tensor("x"), torch.zeros(3))
    save_file({"y": torch.ones(2, 2, dtype=torch.float64)}, tmp_path / "g.safetensors")
    os.replace(tmp_path / "g.safetensors", path)  # another file at the same path (another inode)
    mapped = MappedSafetensors(path)
    assert mapped.keys() == ["y"] and torch.equal(mapped.get_tensor("y"), torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(KeyError, match="'x'"):
        mapped.get_tensor("x")


def raw_file(header: dict | bytes, data: bytes, length: int | None = None) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def test_an_unaligned_tensor_is_copied_with_its_values(tmp_path):
    # safetensors orders tensors by alignment when it writes; a hand-made file may not
    values = torch.tensor([1.5, -2.25], dtype=torch.float32)
    header = {
        "a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)  # an aligned data section: "b" starts at an odd byte of it
    path = tmp_path / "odd.safetensors"
    path.write_bytes(raw_file(text, b"\x07" + values.numpy().tobytes()))
    with safe_open(path, framework="pt") as reference:
        expected = reference.get_tensor("b")
    got = MappedSafetensors(path).get_tensor("b")
    assert torch.equal(got, expected) and torch.equal(got, values)


F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
BROKEN = {
    "too short": b"\x01\x00",
    "header longer than the file": raw_file({"x": F32_2}, b"\0" * 8, length=10_000),
    "not JSON": raw_file(b"{not json", b""),
    "not an object": raw_file(b"[1, 2]", b""),
    "unknown dtype": raw_file({"x": dict(F32_2, dtype="Q7")}, b"\0" * 8),
    "negative shape": raw_file({"x": dict(F32_2, shape=[-2])}, b"\0" * 8),
    "shape and bytes disagree": raw_file({"x": dict(F32_2, shape=[3])}, b"\0" * 8),
    "bytes past the end": raw_file({"x": dict(F32_2, data_offsets=[0, 8])}, b"\0" * 4),
    "a gap": raw_file({"x": dict(F32_2, data_offsets=[4, 12])}, b"\0" * 12),
    "trailing bytes": raw_file({"x": F32_2}, b"\0" * 12),
    "metadata not strings": raw_file({"__metadata__": {"a": 1}, "x": F32_2}, b"\0" * 8),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_files_are_refused_as_safetensors_refuses_them(tmp_path, case):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(BROKEN[case])
    with pytest.raises((SafetensorError, OSError, ValueError)):  # safetensors' own error, or a too-short file's
        with safe_open(path, framework="pt") as reference:
            for name in reference.keys():
                reference.get_tensor(name)
    with pytest.raises(ValueError):
        MappedSafetensors(path)
