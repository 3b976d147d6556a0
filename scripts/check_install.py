"""Install checks that need PyPI (run by hand: they read the live index, so they are not part of the offline suite).

    python scripts/check_install.py lowest [--python 3.11,3.12,3.13]
        For each Python, uv resolves pyproject.toml's tested extras (`[dev]`, which names every other extra) with the
        lowest direct versions the ranges allow, wheels only for the direct dependencies (a floor without a wheel for
        that Python would be built from source by the lowest session there), for Linux x86_64, with every direct
        dependency pinned to its declared floor *for that Python* (the floors of numpy, pyarrow and matplotlib are
        split by python_version), as tests-lowest installs them in the GitHub matrix; checks that it resolves and
        that each direct dependency is at its floor.

    python scripts/check_install.py cuda [--torch 2.13.0,2.14.1,2.15.0] [--bounds newest,lowest]
        For each supported torch, pip resolves ``torch==<version>`` (PyPI's Linux wheel: the CUDA build, with its
        nvidia-* libraries and its triton pin) together with ``hf_statecompose[cuda]`` (mamba-ssm, causal-conv1d) as
        the install docs tell a GPU user to install them (``--no-build-isolation``), with ``--dry-run --report``:
        nothing is downloaded but metadata. ``newest`` takes the newest mamba-ssm / causal-conv1d the ranges allow,
        ``lowest`` pins their declared floors. Checked: the resolution succeeds with torch held at exactly that
        version (so a user who has that torch keeps it: pip keeps an installed version that satisfies every
        requirement), the triton it brings satisfies `[dev]`'s triton range, and the [cuda] packages resolve
        within their ranges. mamba-ssm and causal-conv1d are source distributions whose setup.py imports torch:
        run this with a Python that has some torch and setuptools>=77 installed (the dev environment does; their
        CUDA builds are skipped for the metadata step: MAMBA_SKIP_CUDA_BUILD / CAUSAL_CONV1D_SKIP_CUDA_BUILD).

Both ignore the machine's pip configuration (PIP_CONFIG_FILE=os.devnull: no local wheels, no caps) and read
https://pypi.org/simple, as a user's machine would. Each prints a table; --json PATH writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
INDEX = "https://pypi.org/simple"
PYTHONS = ("3.11", "3.12", "3.13")
TORCHES = ("2.13.0", "2.14.1", "2.15.0")
# the extra the test sessions install (noxfile.py's TESTED_EXTRAS); it names every other extra but [cuda]
TESTED_EXTRAS = "dev"
CUDA_PACKAGES = ("mamba-ssm", "causal-conv1d")


def _name(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def environment_for(python: str | None = None) -> dict[str, str]:
    """Marker environment of this interpreter, or of Linux x86_64 CPython `python` ("3.13")."""
    environment = dict(default_environment())
    if python is not None:
        environment.update(
            python_version=python,
            python_full_version=f"{python}.0",
            sys_platform="linux",
            platform_system="Linux",
            platform_machine="x86_64",
            os_name="posix",
            implementation_name="cpython",
            platform_python_implementation="CPython",
        )
    return environment


def direct_requirements(extra: str = TESTED_EXTRAS, environment: dict[str, str] | None = None) -> list[Requirement]:
    """The package's core requirements and those of `extra`, followed through self-references such as
    hf_statecompose[retrieval,recipes], whose markers hold in `environment` (default: this interpreter's)."""
    project = _project()
    own = _name(project["name"])
    texts, seen, todo = list(project["dependencies"]), set(), [extra]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in project["optional-dependencies"][name]:
            requirement = Requirement(text)
            if _name(requirement.name) == own:
                todo.extend(sorted(requirement.extras))
            else:
                texts.append(text)
    environment = environment or environment_for()
    requirements = [Requirement(text) for text in texts]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def lower_bound(requirement: Requirement) -> str | None:
    lower = [s.version for s in requirement.specifier if s.operator == ">="]
    return lower[0] if lower else None


def off_floor(resolved: dict[str, str], requirements: list[Requirement]) -> list[str]:
    """Problems of a lowest resolution: a direct dependency missing, or not at its declared floor."""
    problems = []
    for requirement in requirements:
        version = resolved.get(_name(requirement.name))
        floor = lower_bound(requirement)
        if version is None:
            problems.append(f"{requirement.name} is not in the resolution")
        elif floor is not None and Version(Version(version).public) != Version(floor):
            problems.append(f"{requirement.name} resolved to {version}, its declared floor is {floor}")
    return problems


def _pins(text: str) -> dict[str, str]:
    """{name: version} of `name==version` lines (uv's compiled output)."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            pins[_name(name.split("[")[0].strip())] = version.split(";")[0].strip()
    return pins


def floor_pins(requirements: list[Requirement], skip: tuple[str, ...] = ()) -> str:
    """Constraint lines ``name==floor`` for every requirement with a declared floor (names in `skip` left out).
    tests-lowest installs with these: uv's lowest-direct resolution alone may move a floor up when the
    resolver backtracks (on Python 3.12 it chose datasets 5.2 / pyarrow 24 though the floors resolve)."""
    lines = []
    for requirement in requirements:
        floor = lower_bound(requirement)
        if floor is not None and _name(requirement.name) not in skip:
            lines.append(f"{_name(requirement.name)}=={floor}\n")
    return "".join(lines)


def check_lowest(python: str) -> dict:
    requirements = direct_requirements(environment=environment_for(python))
    wheels_only = ",".join(sorted({_name(r.name) for r in requirements}))
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "lowest.txt"
        floors = Path(scratch) / "floors.txt"
        floors.write_text(floor_pins(requirements))
        command = [
            "uv", "pip", "compile", str(ROOT / "pyproject.toml"), "--extra", TESTED_EXTRAS,
            "--resolution", "lowest-direct", "-c", str(floors), "--python-version", python,
            "--python-platform", "x86_64-manylinux_2_28", "--only-binary", wheels_only,
            "--index-url", INDEX, "--no-config", "--no-header", "--quiet", "-o", str(out),
        ]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        resolved = _pins(out.read_text()) if done.returncode == 0 else {}
    problems = off_floor(resolved, requirements) if done.returncode == 0 else [done.stderr.strip()[-2000:]]
    floors = {r.name: lower_bound(r) for r in requirements}
    return {"python": python, "ok": not problems, "problems": problems, "floors": floors, "seconds": round(seconds, 1)}


def check_cuda_report(report: dict, torch: str, cuda: dict[str, SpecifierSet], triton: SpecifierSet) -> list[str]:
    """Problems of a pip `--report` for ``torch==<torch>`` + ``hf_statecompose[cuda]``."""
    installs = {_name(item["metadata"]["name"]): item for item in report.get("install", [])}
    problems = []
    item = installs.get("torch")
    if item is None:
        return ["torch is not in the resolution"]
    version = Version(item["metadata"]["version"])
    if version != Version(torch) or version.local is not None:
        problems.append(f"torch resolved to {version}, not {torch} (PyPI's build)")
    if not item["download_info"]["url"].endswith(".whl"):
        problems.append("torch would be built from source")
    if not any(name.startswith("nvidia-") for name in installs):
        problems.append("no nvidia-* libraries: not torch's CUDA build")
    for name, specifier in cuda.items():
        got = installs.get(name)
        if got is None:
            problems.append(f"{name} is not in the resolution")
        elif got["metadata"]["version"] not in specifier:
            problems.append(f"{name} {got['metadata']['version']} is outside [cuda]'s {specifier}")
    got = installs.get("triton")
    if got is None:
        problems.append("triton is not in the resolution")
    elif not triton.contains(got["metadata"]["version"], prereleases=True):
        problems.append(f"triton {got['metadata']['version']} (torch {torch}'s) is outside [dev]'s {triton}")
    return problems


def _cuda_requirements() -> list[Requirement]:
    return [Requirement(text) for text in _project()["optional-dependencies"]["cuda"]]


def _cuda_specifiers() -> tuple[dict[str, SpecifierSet], SpecifierSet]:
    cuda = {_name(r.name): r.specifier for r in _cuda_requirements()}
    (triton,) = [r.specifier for r in direct_requirements(environment=environment_for("3.11")) if r.name == "triton"]
    return cuda, triton


def check_cuda(torch: str, bounds: str) -> dict:
    cuda, triton = _cuda_specifiers()
    pins = floor_pins(_cuda_requirements()).split()
    env = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_INDEX_URL")}
    env.update(PIP_CONFIG_FILE=os.devnull, MAMBA_SKIP_CUDA_BUILD="TRUE", CAUSAL_CONV1D_SKIP_CUDA_BUILD="TRUE")
    with tempfile.TemporaryDirectory() as scratch:
        report_path = Path(scratch) / "report.json"
        command = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
            "--no-build-isolation", "--index-url", INDEX, "--report", str(report_path),
            f"torch=={torch}", f"{ROOT}[cuda]", *(pins if bounds == "lowest" else []),
        ]  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        report = json.loads(report_path.read_text()) if done.returncode == 0 else {}
    if done.returncode != 0:
        problems = [f"pip could not resolve: {done.stderr.strip()[-2000:]}"]
    else:
        problems = check_cuda_report(report, torch, cuda, triton)
    versions = {_name(i["metadata"]["name"]): i["metadata"]["version"] for i in report.get("install", [])}
    keep = ("torch", "triton", *CUDA_PACKAGES)
    return {
        "torch": torch,
        "bounds": bounds,
        "ok": not problems,
        "problems": problems,
        "resolved": {name: versions.get(name) for name in keep},
        "nvidia_packages": sum(name.startswith("nvidia-") for name in versions),
        "seconds": round(seconds, 1),
    }


def _needs(tool: str) -> None:
    if tool == "uv" and shutil.which("uv") is None:
        sys.exit("check_install.py lowest needs uv on PATH (pip install uv)")
    if tool == "torch":
        try:
            import setuptools
            import torch  # noqa: F401
        except ImportError as error:
            sys.exit(
                f"check_install.py cuda needs torch (any build) and setuptools>=77 in this Python ({error}): the "
                "metadata of mamba-ssm / causal-conv1d comes from their setup.py, which imports torch; run it with "
                "the dev environment's python"
            )
        if Version(setuptools.__version__) < Version("77"):
            sys.exit(f"check_install.py cuda needs setuptools>=77 in this Python (it has {setuptools.__version__})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="check", required=True)
    lowest = sub.add_parser("lowest", help="each Python's lowest resolution, wheels only, at the declared floors")
    lowest.add_argument("--python", default=",".join(PYTHONS), help="comma-separated (default: %(default)s)")
    cuda = sub.add_parser("cuda", help="[cuda] on each supported torch's CUDA wheels, torch kept")
    cuda.add_argument("--torch", default=",".join(TORCHES), help="comma-separated (default: %(default)s)")
    cuda.add_argument("--bounds", default="newest,lowest", help="newest and/or lowest [cuda] versions")
    for command in (lowest, cuda):
        command.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.check == "lowest":
        _needs("uv")
        results = [check_lowest(python) for python in args.python.split(",")]
        print(f"{'python':8} {'ok':4} {'s':>6}  floors that differ from 3.11's / problems")
        base = results[0]["floors"]
        for r in results:
            differ = {n: v for n, v in r["floors"].items() if base.get(n) != v}
            print(f"{r['python']:8} {r['ok']!s:4} {r['seconds']:6.1f}  {differ or ''} {'; '.join(r['problems'])}")
    else:
        _needs("torch")
        results = [check_cuda(t, b) for t in args.torch.split(",") for b in args.bounds.split(",")]
        print(
            f"{'torch':8} {'bounds':7} {'ok':5} {'triton':8} {'mamba-ssm':12} {'causal-conv1d':14} {'nvidia':6} {'s':>6}"
        )
        for r in results:
            v = r["resolved"]
            print(
                f"{r['torch']:8} {r['bounds']:7} {r['ok']!s:5} {v['triton'] or '-':8} {v['mamba-ssm'] or '-':12} "
                f"{v['causal-conv1d'] or '-':14} {r['nvidia_packages']:6} {r['seconds']:6.1f}"
            )
            for problem in r["problems"]:
                print("   ", problem)
    if args.json:
        args.json.write_text(json.dumps({"check": args.check, "results": results}, indent=2) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
