"""The test sessions behind `bash scripts/test.sh`: each run builds fresh virtual environments, so a
green run never rests on packages left over from an earlier one.

    python -m nox                          # the default sessions: tests-lowest, tests-newest, tests-transformers-5.24
    python -m nox -s tests-lowest          # one session
    python -m nox -- -k compose -x         # arguments after `--` go to pytest, in every session
    python -m nox -s tests-transformers-next   # by hand (and weekly in CI): the canary, not in the default run

The sessions:

* tests-lowest: every direct dependency at its declared lower bound (transformers 5.23.x); checks, whole suite.
* tests-newest: the newest that pyproject.toml allows (transformers 5.25.x); checks, whole suite.
* tests-transformers-5.24: as tests-newest, but transformers pinned to 5.24.x, the release between both ends; pytest
  on TARGETED_5_24 only (the files that touch what 5.24 does differently from 5.23 and 5.25), no checks: a few
  minutes, in the default run (and CI) beside the two above.
* tests-transformers-next (not in the default run): the canary. The newest releases of transformers and accelerate,
  past pyproject.toml's caps (NEXT_OVERRIDES: pinned in uv's --override file), and the newest torch this machine's
  pip gets; prints what changed in the transformers internals the package reads (scripts/transformers_internals.py,
  against the newest tested release), then pytest on the whole suite, no checks. Run weekly in CI, allowed to fail:
  it says early what the next transformers breaks, before the caps are raised.
* tests-torch-2.15 (by hand): tests-newest on torch 2.15.0.

tests-lowest installs the lowest version that pyproject.toml allows of every direct dependency (uv's
lowest-direct resolution: transformers 5.23.x, torch 2.13.0, triton 3.7.1) and checks that each one really is at its
declared lower bound; tests-newest installs the newest allowed (transformers 5.25.x, torch 2.14.1 and the triton
3.8 it pins). Both run the checks, then pytest on
the whole suite, offline on CPU, one pytest-xdist worker per core (at most 4, one thread each: PYTEST_WORKERS). The checks, each at the versions its session installed: `ruff check` and
`ruff format --check` (the whole repository), `mypy` (the package, `[tool.mypy]` in pyproject.toml),
`lint-imports` (the layers, `.importlinter`), and the release build: `python -m build` makes the sdist, then
the wheel from that sdist (so a file missing from the sdist fails here), with build isolation (a fresh
environment with the newest setuptools that `[build-system]` allows, from the index, as pip and PyPI
uploads build it; not the session's own setuptools), and `twine check --strict` reads both (metadata, the
README rendered as the long description). mypy keeps its incremental cache per session in
~/.cache/hf_statecompose/mypy/<session> (mypy re-checks whatever changed, so a cache never hides an error).

torch comes first, from the venv's own pip (TORCH below: 2.13.0 in tests-lowest, 2.14.1 in tests-newest, 2.15.0 in
tests-torch-2.15, run by hand): pip reads the machine's pip configuration (here the 2.13.0 CPU wheel in /opt/wheels
and a local index holding 2.14.1, a CUDA build that runs on the CPU, and its CUDA libraries and triton 3.8). uv then
installs everything else with torch pinned to the exact build that pip installed (e.g. 2.13.0+cpu), so uv never
resolves torch from an index (where torch==2.13.0 is the CUDA build with GBs of nvidia wheels). constraints.txt
(torch==2.13.0) is the README's pin for a CPU install on such a machine; the sessions do not use it. uv's wheel cache (~/.cache/uv)
is kept between runs; the environments are not.

Each session also fetches the source distribution of the transformers version it installed (cached in
~/.cache/hf_statecompose/transformers-src/<version>/) and exports HSC_TRANSFORMERS_TESTS, the sdist's
tests folder, for tests that reuse transformers' own test mixins; it is left unset, with a message, when
that folder lacks any of TRANSFORMERS_TEST_FILES (tests that need it then skip with a reason). The sdist
holds only the top-level test files: ModelTesterMixin runs from it; the generation mixin and transformers'
Mamba suites need the repository's tree at the release tag (not reachable from these machines).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent
# the extras a test run installs (`cuda` is CUDA-only source builds, never installed on CPU)
TESTED_EXTRAS = "dev"
# what the tests importing transformers' own test mixins need from its source tree: the sdist has
# test_modeling_common.py (ModelTesterMixin, which tests/test_transformers_common.py runs); the rest of the tree
# (generation/, models/) is not in the sdist, so the generation mixin and transformers' Mamba suites skip, naming it
TRANSFORMERS_TEST_FILES = ("test_modeling_common.py",)
FULL_TREE_FILES = ("generation/test_utils.py", "models/mamba/test_modeling_mamba.py")
SOURCE_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hf_statecompose" / "transformers-src"
MYPY_CACHE = SOURCE_CACHE.parent / "mypy"
# one intra-op thread per test process: the suite runs in one pytest-xdist worker per core (PYTEST_WORKERS)
TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}
# pytest-xdist: a worker per core, at most 4 (each imports torch and transformers and holds its tiny models: more
# workers buy little and cost memory); a test file stays on one worker (--dist loadfile), so module fixtures run
# once and a file's processes never race its own other tests. `-- -n 0` runs in one process (posargs come last)
PYTEST_WORKERS = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile"]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the direct requirements and their floors, shared with the install checks run by hand (they read PyPI)
CHECK_INSTALL = _load(ROOT / "scripts" / "check_install.py")

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "no"  # a fresh venv every run (the default, stated; `-r` would reuse)
nox.options.sessions = ["tests-lowest", "tests-newest", "tests-transformers-5.24"]

# The torch each session runs, installed by the venv's own pip (which reads this machine's pip configuration: the
# 2.13.0 CPU wheel and 2.14.1, a CUDA build that runs on the CPU, lie on its disk; uv looks at neither). The lowest
# session runs the lowest torch pyproject.toml allows, the newest the newest this machine's pip gets; 2.15 (PyPI's
# CUDA build, ~3 GB: this machine caps pip at 2.14.1, which the session lifts) is the session run by hand.
TORCH = {
    "tests-lowest": "2.13.0",
    "tests-newest": "2.14.1",
    "tests-torch-2.15": "2.15.0",
    "tests-transformers-5.24": "2.14.1",
    "tests-transformers-next": "2.14.1",
}

# tests-transformers-next: the newest release of each (the index's, `pip index versions`) goes into uv's --override
# file as `name==version`, which replaces every requirement on that name (pyproject.toml's caps, and those of packages
# that depend on it). Pinned, not `>=0`: a cap elsewhere that the newest release conflicts with (e.g. our `kernels`
# cap against a transformers that needs a newer kernels) then fails the install naming both, instead of the resolver
# quietly backtracking to an older, tested transformers and the canary testing nothing new
NEXT_OVERRIDES = ("transformers", "accelerate")
# the canary runs on a transformers outside compat.TESTED_TRANSFORMERS: the package warns at import (a UserWarning,
# which pyproject's filterwarnings leave a warning), and this one test, which asserts the installed release is in the
# tested range, is expected to fail there; it is deselected, not edited, so that the default sessions still assert it
NEXT_DESELECT = ("tests/test_compat.py::test_the_installed_transformers_is_in_the_tested_range",)
# set in the canary's test environment: tests that must behave differently on an untested transformers read it
NEXT_ENV = "HSC_TRANSFORMERS_NEXT"

# tests-transformers-5.24: transformers 5.24 is the release between the lowest (5.23) and the newest (5.25) tested:
# the whole suite runs at both ends; at 5.24 only the files that touch what differs from either end. 5.24 renamed the
# Mamba family's cache argument and output field `cache_params` to `cache` (and the hybrids' `past_key_values`),
# compat's CACHE_ARG / cache_kwargs / cache_is_renamed switch on it; 5.25 changed the linear-attention layers'
# counters (get_seq_length), crop and assisted generation, which 5.24 still has the old way. Files that do not exist
# (yet) are left out at run time.
TARGETED_5_24 = (  # the slow ones first: pytest-xdist hands the files out in this order
    "tests/test_compat.py",  # the switch itself: CACHE_ARG, pop_cache, cache_output, the deprecation wrappers
    "tests/test_transformers_525.py",  # the 5.25 counters / crop / assisted generation, checked to hold on 5.24 too
    # transformers' own ModelTesterMixin (the 5.24 sdist's) on this package's models: generate() over a cache of
    # linear-attention layers, whose get_seq_length 5.24 refuses and 5.25 counts (~45 s on one worker)
    "tests/test_transformers_common.py",
    "tests/test_delta_rule_models.py",  # hybrids continued via cache_kwargs(hybrid=True): past_key_values vs cache
    "tests/test_architecture_table.py",  # the `cache_params` FutureWarnings (5.24+) point at the user's line
    "tests/test_model_contract.py",  # this package's models step by step with `cache_params`, outputs under both names
    "tests/test_falcon_mamba.py",  # a transformers Mamba model continued with its cache under compat.CACHE_ARG
    "tests/test_exactness.py",  # the stock model's cache read back as `.cache_params` equals the enabled one's
    "tests/test_errors.py",  # a cache under either name plus past_states is refused, naming both names
    "tests/test_hybrid_rope_keys.py",  # a RoPE hybrid continued via cache_kwargs(hybrid=True), with positions
    "tests/test_hybrid_mixers_2.py",  # a stock hybrid mixer called with the release's cache argument name
)


@nox.session(name="tests-lowest", venv_params=["--seed"])
def tests_lowest(session: nox.Session) -> None:
    """Every direct dependency at its declared lower bound (transformers 5.23.x); the whole suite."""
    # each floor pinned (for this Python: some are split by python_version), the rest at uv's lowest-direct: that
    # resolution alone may lift a floor when it backtracks (it did on 3.12), and the check below would then fail
    floors = Path(session.virtualenv.location) / "floors.txt"
    floors.write_text(CHECK_INSTALL.floor_pins(_requirements(), skip=("torch",)))
    _install(session, "--resolution", "lowest-direct", "-c", str(floors))
    versions = _direct_versions(session)
    wrong = {
        name: (installed, lower)
        for name, (installed, lower) in versions.items()
        if lower is not None and Version(Version(installed).public) != Version(lower)
    }
    if wrong:
        lines = ", ".join(f"{name} {installed} (declared >={lower})" for name, (installed, lower) in wrong.items())
        session.error(
            f"the lowest resolution did not install the declared lower bounds: {lines}; raise each "
            "bound in pyproject.toml to the version that gets installed, so that it is the one tested"
        )
    _test(session)


@nox.session(name="tests-newest", venv_params=["--seed"])
def tests_newest(session: nox.Session) -> None:
    """The newest versions pyproject.toml allows (transformers 5.25.x, torch 2.14.1 and its triton 3.8); the suite."""
    _newest(session)


@nox.session(name="tests-torch-2.15", venv_params=["--seed"])
def tests_torch_2_15(session: nox.Session) -> None:
    """By hand (not in the default run: it downloads ~3 GB): tests-newest on torch 2.15.0 and its triton 3.9.
    ``python -m nox -s tests-torch-2.15 [-- pytest args]``."""
    _newest(session)


@nox.session(name="tests-transformers-5.24", venv_params=["--seed"])
def tests_transformers_5_24(session: nox.Session) -> None:
    """In the default run: tests-newest's install with transformers pinned to 5.24.x, the release between the two
    ends; pytest on TARGETED_5_24 only (no checks: the other sessions run them), to stay a few minutes."""
    pin = Path(session.virtualenv.location) / "transformers-pin.txt"
    pin.write_text("transformers==5.24.*\n")
    _install(session, "--upgrade", "-c", str(pin))
    _direct_versions(session)
    targeted = [path for path in TARGETED_5_24 if (ROOT / path).exists()]
    if not targeted:
        session.error("none of TARGETED_5_24 exists: name the test files that touch what 5.24 does differently")
    _test(session, checks=False, paths=targeted)


@nox.session(name="tests-transformers-next", venv_params=["--seed"])
def tests_transformers_next(session: nox.Session) -> None:
    """By hand and weekly in CI (not in the default run; allowed to fail): the newest transformers and accelerate,
    past pyproject.toml's caps (NEXT_OVERRIDES), on the newest torch this machine's pip gets; the internals report
    against the newest tested release, then the whole suite without the checks.
    ``python -m nox -s tests-transformers-next [-- pytest args]``. With HSC_CANARY_REPORT set, the internals report is
    also written to that file (CI shows it in the job summary)."""
    newest = {name: _newest_release(session, name) for name in NEXT_OVERRIDES}
    session.log("the newest releases: " + ", ".join(f"{name} {version}" for name, version in newest.items()))
    overrides = Path(session.virtualenv.location) / "overrides.txt"
    overrides.write_text("".join(f"{name}=={version}\n" for name, version in newest.items()))
    _install(session, "--upgrade", "--override", str(overrides))
    _direct_versions(session)
    # the report is information, not a verdict (exit 2: it could not fetch the baseline's wheel): the tests decide
    report = session.run("python", "scripts/transformers_internals.py", "installed", silent=True, success_codes=[0, 2])
    session.log(f"what changed in the transformers internals the package reads:\n{report}")
    if os.environ.get("HSC_CANARY_REPORT"):
        Path(os.environ["HSC_CANARY_REPORT"]).write_text(report or "")
    session.env[NEXT_ENV] = "1"
    _test(session, checks=False, deselect=NEXT_DESELECT)


def _newest_release(session: nox.Session, name: str) -> str:
    """The newest release of `name` on the index the venv's pip reads (its configuration, as for torch)."""
    out = session.run("python", "-m", "pip", "index", "versions", name, silent=True, success_codes=[0, 1])
    found = re.search(rf"^{re.escape(name)} \(([^)]+)\)", out or "", flags=re.MULTILINE | re.IGNORECASE)
    if found is None:
        session.error(
            f"`pip index versions {name}` named no release ({(out or '').strip()[-300:]}): is the index reachable?"
        )
    return found.group(1)


def _newest(session: nox.Session) -> None:
    """The newest allowed versions of everything but torch (the session's, TORCH), then the checks and the suite."""
    _install(session, "--upgrade")
    _direct_versions(session)
    _test(session)


def _install(session: nox.Session, *resolution: str) -> None:
    # pip, not uv, installs torch: it reads the machine's pip configuration (the local wheels); a torch above this
    # machine's pip cap (/etc/xdg/pip: torch<=2.14.1) comes from PyPI with the cap replaced by an empty constraint
    wanted = TORCH[session.name]
    lift = {"PIP_CONSTRAINT": os.devnull} if Version(wanted) > Version("2.14.1") else {}
    session.run("python", "-m", "pip", "install", "-q", f"torch=={wanted}", silent=True, env=lift)
    torch = _versions(session, ["torch"])["torch"]
    # in the venv folder, not session.create_tmp(): that points TMPDIR into the venv, where Ray refuses
    # its temp dir ("temp_dir must not be child directory of virtualenv root") and its workers die
    pin = Path(session.virtualenv.location) / "torch-pin.txt"
    pin.write_text(f"torch=={torch}\n")
    session.install(*resolution, "-c", str(pin), "-e", f".[{TESTED_EXTRAS}]")


def _test(
    session: nox.Session, checks: bool = True, paths: list[str] | None = None, deselect: tuple[str, ...] = ()
) -> None:
    """The checks (unless not `checks`), then pytest on `paths` (default: the whole suite) less `deselect`."""
    session.env.update(TEST_ENV)
    transformers = _versions(session, ["transformers"])["transformers"]
    tests = _transformers_tests(session, transformers)
    if tests is not None:
        session.env["HSC_TRANSFORMERS_TESTS"] = str(tests)
    if checks:
        _checks(session)
    session.run("python", "-c", "import transformers; print('transformers', transformers.__version__)")
    unselect = [arg for test in deselect for arg in ("--deselect", test)]
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        *PYTEST_WORKERS,
        *(["tests"] if paths is None else paths),
        *unselect,
        *session.posargs,
    )


def _checks(session: nox.Session) -> None:
    """Lint, format, types, layers, and the sdist + wheel as they would be uploaded."""
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", "--cache-dir", str(MYPY_CACHE / session.name))
    # the layers contract (.importlinter): each module imports only the layers below it
    session.run("lint-imports")
    dist = Path(session.virtualenv.location) / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist), ".", silent=True)
    built = sorted(str(path) for path in dist.iterdir())
    session.run("twine", "check", "--strict", *built)


def _requirements() -> list[Requirement]:
    """The direct dependencies a test run installs on this Python (scripts/check_install.py: the core ones and
    those of TESTED_EXTRAS, followed through self-references; markers evaluated here, so numpy's floor on 3.13 is
    3.13's)."""
    return CHECK_INSTALL.direct_requirements(TESTED_EXTRAS)


def _direct_versions(session: nox.Session) -> dict[str, tuple[str, str | None]]:
    """Print and return {name: (installed version, declared lower bound or None)}."""
    requirements = _requirements()
    installed = _versions(session, [r.name for r in requirements])
    result = {}
    for requirement in requirements:
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        result[requirement.name] = (installed[requirement.name], lower[0] if lower else None)
    session.log("direct dependencies: " + ", ".join(f"{name} {v}" for name, (v, _) in result.items()))
    return result


def _versions(session: nox.Session, names: list[str]) -> dict[str, str]:
    code = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    out = session.run("python", "-c", code, *names, silent=True)
    return json.loads(out.strip().splitlines()[-1])


def _transformers_tests(session: nox.Session, version: str) -> Path | None:
    """transformers' sdist for `version`, downloaded once and extracted under SOURCE_CACHE; its tests
    folder when that holds TRANSFORMERS_TEST_FILES, else None (and a message naming what is missing)."""
    folder = SOURCE_CACHE / version
    source = folder / f"transformers-{version}"
    if not source.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        session.run(
            "python",
            "-m",
            "pip",
            "download",
            "-q",
            "--no-binary",
            ":all:",
            "--no-deps",
            "-d",
            str(folder),
            f"transformers=={version}",
            silent=True,
        )
        # extract beside, then rename: an interrupted run leaves no half tree that looks complete
        scratch = Path(tempfile.mkdtemp(dir=folder))
        with tarfile.open(folder / f"transformers-{version}.tar.gz") as archive:
            archive.extractall(scratch, filter="data")
        (scratch / source.name).rename(source)
        shutil.rmtree(scratch)
    tests = source / "tests"
    partial = [name for name in FULL_TREE_FILES if not (tests / name).is_file()]
    if partial:
        session.log(
            f"transformers {version}'s sdist lacks {', '.join('tests/' + m for m in partial)}: "
            "transformers' model mixin runs, its generation mixin and Mamba suites skip"
        )
    missing = [name for name in TRANSFORMERS_TEST_FILES if not (tests / name).is_file()]
    if missing:
        session.warn(
            f"transformers {version}'s sdist ({tests}) lacks {', '.join('tests/' + m for m in missing)}: "
            "HSC_TRANSFORMERS_TESTS stays unset and the tests that need it skip"
        )
        return None
    return tests
