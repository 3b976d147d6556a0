"""The development tools agree with each other: the version (pyproject, ``hf_statecompose.__version__``, the
changelog), the pre-commit config (parses; ruff at the release the dev extra pins as its lower bound), the
checks the test command runs (noxfile.py), and the lazy public names typed for type checkers."""

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

import hf_statecompose

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _dev_requirements() -> dict[str, Requirement]:
    requirements = (Requirement(text) for text in PYPROJECT["project"]["optional-dependencies"]["dev"])
    return {r.name: r for r in requirements}


def _lower_bound(requirement: Requirement) -> str:
    (lower,) = [s.version for s in requirement.specifier if s.operator == ">="]
    return lower


def test_version_agrees_everywhere():
    version = PYPROJECT["project"]["version"]
    assert hf_statecompose.__version__ == version
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    released = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, flags=re.MULTILINE)
    assert released and released[0] == version, (
        f"CHANGELOG.md's newest release is {released[:1]}, pyproject says {version}"
    )


def test_pre_commit_config_parses_and_pins_the_tested_ruff():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text(encoding="utf-8"))
    repos = {repo["repo"]: repo for repo in config["repos"]}
    ruff = repos["https://github.com/astral-sh/ruff-pre-commit"]
    assert ruff["rev"] == "v" + _lower_bound(_dev_requirements()["ruff"])
    assert [hook["id"] for hook in ruff["hooks"]] == ["ruff-check", "ruff-format"]
    local = {hook["id"]: hook for hook in repos["local"]["hooks"]}
    assert local["mypy"]["entry"] == "mypy" and local["import-linter"]["entry"] == "lint-imports"
    assert all(hook["language"] == "system" and hook["pass_filenames"] is False for hook in local.values())
    hooks = {hook["id"] for hook in repos["https://github.com/pre-commit/pre-commit-hooks"]["hooks"]}
    assert {"trailing-whitespace", "end-of-file-fixer"} <= hooks


def _session_commands() -> list[tuple[str, ...]]:
    """The leading string arguments of every ``session.run(...)`` in noxfile.py."""
    commands = []
    for node in ast.walk(ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "run":
            words = []
            for arg in node.args:
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    break
                words.append(arg.value)
            commands.append(tuple(words))
    return commands


def test_the_test_command_runs_the_checks_it_installs():
    """Each tool the noxfile runs before pytest is a declared dev dependency (so both sessions test its range)."""
    commands = _session_commands()
    for tool, command in (
        ("ruff", ("ruff", "check")),
        ("ruff", ("ruff", "format", "--check")),
        ("mypy", ("mypy",)),
        ("build", ("python", "-m", "build")),
        ("twine", ("twine", "check", "--strict")),
    ):
        assert tool in _dev_requirements(), f"{tool} is not in the dev extra"
        assert any(c[: len(command)] == command for c in commands), f"noxfile.py does not run {' '.join(command)}"
    assert "hf_statecompose" in PYPROJECT["tool"]["mypy"]["files"]


def test_lazy_public_names_are_typed():
    """``hf_statecompose`` imports its public names on first use (``_EXPORTS``); the ``TYPE_CHECKING`` imports
    tell type checkers what they are. Both must name the same objects from the same subpackages."""
    tree = ast.parse((ROOT / "hf_statecompose" / "__init__.py").read_text(encoding="utf-8"))
    typed = {}
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imported in node.body:
                assert isinstance(imported, ast.ImportFrom) and imported.level == 1
                typed.update({alias.name: imported.module for alias in imported.names})
    exports = hf_statecompose._EXPORTS
    assert sorted(typed) == sorted(exports)
    for name, module in typed.items():  # `encode` is imported from the module that defines it, not its package
        assert module == exports[name] or module.startswith(exports[name] + "."), (name, module, exports[name])


# ------------------------------------------------------------------------------------ the CI matrix for the world
WORKFLOW = ROOT / ".github" / "workflows" / "tests.yml"


def _check_workflow(path: Path) -> subprocess.CompletedProcess:
    # check-jsonschema vendors SchemaStore's GitHub-workflow schema: no network
    command = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(path)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_the_github_workflow_is_valid_against_the_workflow_schema(tmp_path):
    done = _check_workflow(WORKFLOW)
    assert done.returncode == 0, done.stdout + done.stderr
    # the check can fail: the same workflow whose job has no runner
    text = WORKFLOW.read_text(encoding="utf-8")
    assert "    runs-on: ubuntu-latest\n" in text
    (tmp_path / "broken.yml").write_text(text.replace("    runs-on: ubuntu-latest\n", ""), encoding="utf-8")
    assert _check_workflow(tmp_path / "broken.yml").returncode != 0


def test_the_github_workflow_runs_the_default_sessions_on_every_declared_python():
    from packaging.specifiers import SpecifierSet

    # noxfile.py's default sessions, read from its source (nox is not installed inside the sessions it makes)
    (default,) = [
        node.value
        for node in ast.walk(ast.parse((ROOT / "noxfile.py").read_text(encoding="utf-8")))
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions"
    ]
    workflow = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    matrix = workflow["jobs"]["nox"]["strategy"]["matrix"]
    declared = {
        c.rsplit(":: ", 1)[1]
        for c in PYPROJECT["project"]["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    }
    assert set(matrix["python"]) == declared == {"3.11", "3.12", "3.13"}
    requires = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert all(f"{v}.0" in requires for v in declared) and "3.14.0" in requires  # no upper cap
    assert sorted(matrix["session"]) == sorted(ast.literal_eval(default))
    assert sorted(matrix["session"]) == ["tests-lowest", "tests-newest", "tests-transformers-5.24"]
    assert workflow["jobs"]["nox"]["if"] == "github.event_name != 'schedule'"  # the weekly run is the canary's only


def test_the_github_workflow_runs_the_transformers_canary_weekly_allowed_to_fail():
    workflow = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    assert workflow[True]["schedule"][0]["cron"]  # YAML 1.1 reads the key `on` as True
    canary = workflow["jobs"]["transformers-next"]
    assert canary["continue-on-error"] is True
    assert "schedule" in canary["if"] and "workflow_dispatch" in canary["if"]
    steps = {step.get("name"): step for step in canary["steps"]}
    assert steps["tests-transformers-next"]["run"].startswith("python -m nox -s tests-transformers-next")
    assert steps["summary"]["if"] == "always()" and "GITHUB_STEP_SUMMARY" in steps["summary"]["run"]
    assert "HSC_CANARY_REPORT" in steps["tests-transformers-next"]["env"]
    # not in the default run: the canary installs past pyproject.toml's caps
    noxfile = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    assert '@nox.session(name="tests-transformers-next"' in noxfile
