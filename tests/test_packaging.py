"""The wheel holds every file of the package (Triton kernels and embedded data included) whatever the
checkout, and the sdist carries the tests and their helpers. Built with setuptools' PEP 517 backend
directly (no network, no build isolation)."""

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tracked(prefix: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-s", prefix], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    rows = [line.split(maxsplit=3) for line in out.splitlines()]
    return [(mode, path) for mode, _, _, path in rows]


def _build(kind: str, out: Path) -> Path:
    code = f"from setuptools import build_meta; print(build_meta.build_{kind}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def test_no_symlinks_in_the_repository():
    assert [path for mode, path in _tracked(".") if mode == "120000"] == []


def test_wheel_contains_every_package_file(tmp_path):
    if not (ROOT / ".git").exists():
        import pytest

        pytest.skip("not a git checkout")
    wheel = _build("wheel", tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [path for _, path in _tracked("hf_statecompose") if path not in names]
    assert missing == []
    assert "hf_statecompose/py.typed" in names
    # the CPU kernels' C sources (package data, compiled at run time)
    for source in ("statecompose_math.h", "compose_ssm.c", "causal_conv1d.c", "selective_scan.c", "ssd_scan.c"):
        assert f"hf_statecompose/ops/csrc/{source}" in names, source


def test_the_wheel_carries_the_kernels_folder_as_hf_statecompose_kernels(tmp_path):
    """kernels/torch-ext/hf_statecompose_kernels/* is hf_statecompose/_kernels/* in the wheel, byte for byte (every
    file, nothing else), and nothing of the wheel is a top-level kernels/ (the PyPI package's name)."""
    wheel = zipfile.ZipFile(_build("wheel", tmp_path))
    source = ROOT / "kernels" / "torch-ext" / "hf_statecompose_kernels"
    tracked = sorted(path for _, path in _tracked("kernels/torch-ext/hf_statecompose_kernels"))
    assert "kernels/torch-ext/hf_statecompose_kernels/__init__.py" in tracked
    shipped = sorted(name for name in wheel.namelist() if name.startswith("hf_statecompose/_kernels/"))
    assert shipped == [
        f"hf_statecompose/_kernels/{Path(path).relative_to(source.relative_to(ROOT))}" for path in tracked
    ]
    for path in tracked:
        name = f"hf_statecompose/_kernels/{Path(path).relative_to(source.relative_to(ROOT))}"
        assert wheel.read(name) == (ROOT / path).read_bytes(), name
    assert [name for name in wheel.namelist() if name.split("/")[0] == "kernels"] == []


def test_the_packages_list_names_every_package():
    """pyproject lists the packages by hand (a package outside its parent's folder cannot be discovered): the
    list is every folder with an __init__.py under hf_statecompose/, plus hf_statecompose._kernels."""
    import tomllib

    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(str(ROOT), include=["hf_statecompose*"]))
    assert set(config["packages"]) == found | {"hf_statecompose._kernels"}, "add the new package to pyproject.toml"
    assert config["package-dir"] == {"hf_statecompose._kernels": "kernels/torch-ext/hf_statecompose_kernels"}


def test_sdist_contains_tests_and_license(tmp_path):
    sdist = _build("sdist", tmp_path)
    names = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    for path in (
        "LICENSE",
        "tests/helpers.py",
        "tests/conftest.py",
        "tests/store_helpers.py",
        ".importlinter",
        "kernels/build.toml",
        "kernels/README.md",
        "kernels/build_universal.py",
        "kernels/torch-ext/hf_statecompose_kernels/__init__.py",
        "custom_generate/generate.py",
        "custom_generate/requirements.txt",
        "custom_generate/README.md",
    ):
        assert path in names, path
    assert os.path.basename(sdist).startswith("hf_statecompose-")


def test_installing_the_package_keeps_the_users_torch(tmp_path):
    """pip keeps whatever supported torch is installed (2.13 in tests-lowest, 2.14.1 in tests-newest): the declared
    range admits it, so installing the package replaces nothing. (With the old ``torch<2.14`` a user's 2.14 or 2.15
    was silently uninstalled for 2.13.)"""
    import json

    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    wheel = _build("wheel", tmp_path)
    # the package's own requirements decide, not a machine-wide pip constraint (this project's machines cap pip at
    # torch<=2.14.1 in /etc/xdg/pip, which would "replace" a 2.15 by itself): an empty constraint file replaces it
    env = dict(os.environ, PIP_CONSTRAINT=os.devnull)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", "-", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    installs = {
        item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"] for item in report["install"]
    }
    assert "hf-statecompose" in installs, installs  # the report lists what would be installed: the package itself
    assert "torch" not in installs, f"installing the package would replace torch {torch.__version__}: {installs}"
    # and the declared range is what admits it
    (declared,) = [r for r in map(Requirement, _metadata_requires(wheel)) if r.name == "torch"]
    assert Version(Version(torch.__version__).public) in declared.specifier


def _metadata_requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        text = archive.read(name).decode()
    return [
        line.split(": ", 1)[1]
        for line in text.splitlines()
        if line.startswith("Requires-Dist: ") and "extra ==" not in line
    ]
