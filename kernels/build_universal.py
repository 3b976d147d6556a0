"""Write ``<out>/build/torch-universal/`` from ``torch-ext/hf_statecompose_kernels``: the layout that
``kernels.get_local_kernel(<out>)`` loads on any backend (Triton compiles at run time: one variant serves all).

    python kernels/build_universal.py            # writes kernels/build/ (ignored by git)
    python kernels/build_universal.py /tmp/k     # writes /tmp/k/build/

Then ``hf_statecompose.use_kernel("kernels")`` (or ``HSC_KERNEL=kernels``) runs the Triton backend through the
``kernels`` package. To publish on the Hub use ``kernel-builder build-and-upload`` (``build.toml``, ``flake.nix``),
which writes the same sources into its own variants. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = "hf_statecompose_kernels"
SOURCE = HERE / "torch-ext" / NAME


def build(out: Path) -> Path:
    """Copy the kernel package into ``out/build/torch-universal/<NAME>/`` with its ``metadata.json``; returns
    the variant folder. The id (a Python module name, unique per source) carries a hash of the sources."""
    files = sorted(p for p in SOURCE.rglob("*.py") if "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(SOURCE).as_posix().encode() + b"\0" + path.read_bytes())
    variant = Path(out) / "build" / "torch-universal"
    if variant.exists():
        shutil.rmtree(variant)
    for path in files:
        target = variant / NAME / path.relative_to(SOURCE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    metadata = {
        "name": "hf-statecompose-kernels",
        "id": f"_{NAME}_universal_{digest.hexdigest()[:7]}",
        "version": 1,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": "cuda", "archs": []},
    }
    (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return variant


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
