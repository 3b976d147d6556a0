"""The README is one screen: its quickstart and feature snippets run as written, and its links to files of the
repository exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# what each optional extra of pyproject.toml brings (the modules its packages import as): a snippet said to run
# after an install of some extras runs with the other extras' modules hidden, as on a machine without them:
# ``import`` raises ModuleNotFoundError and ``importlib.util.find_spec`` (how transformers and lancedb probe for
# optional packages) returns None. (``sys.modules[name] = None`` is not enough: lancedb then finds the name there.)
# A module that two extras bring (accelerate: train and eval) stays importable if either is installed; one that the
# installed transformers requires itself (kernels, from 5.25) is on every machine, extra or not.


def _transformers_requires(name: str) -> bool:
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    return any(
        Requirement(text).name == name and Requirement(text).marker is None for text in requires("transformers") or ()
    )


EXTRA_MODULES = {
    "scale": ("lancedb", "lance", "ray"),
    "train": ("peft", "accelerate"),
    "eval": ("lm_eval", "datasets", "accelerate"),
    "recipes": ("gensim", "matplotlib", "mlxtend"),
    "docs": ("mkdocs", "mkdocstrings", "material"),
    "hub-kernels": () if _transformers_requires("kernels") else ("kernels",),
    "cuda": ("mamba_ssm", "causal_conv1d"),
}
HIDE = """
import importlib.util, sys

class _Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

_find_spec = importlib.util.find_spec

def _find_spec_hidden(name, package=None):
    if name.split(".")[0] in {blocked!r}:
        return None
    return _find_spec(name, package)

sys.meta_path.insert(0, _Hidden())
importlib.util.find_spec = _find_spec_hidden
"""
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _named_install(text: str) -> tuple[str, ...]:
    """The extras of the one ``pip install ... -e ".[...]"`` that ``text`` names."""
    installs = re.findall(r'pip install -c constraints\.txt -e "\.\[([a-z,-]+)\]"', text)
    assert len(installs) == 1, f"name exactly one install: {installs}"
    return tuple(installs[0].split(","))


def _run_with_only(extras: tuple[str, ...], code: str, cwd) -> subprocess.CompletedProcess:
    visible = {name for extra in extras for name in EXTRA_MODULES.get(extra, ())}
    blocked = sorted(
        {name for extra, names in EXTRA_MODULES.items() if extra not in extras for name in names} - visible
    )
    prelude = HIDE.format(blocked=tuple(blocked))
    return subprocess.run(
        [sys.executable, "-c", prelude + code], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )


def test_every_extra_is_known_to_the_snippet_checks():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) - {"retrieval", "dev"} == set(EXTRA_MODULES)


def test_the_blocked_extras_are_really_missing_in_a_snippet(tmp_path):
    """The check below could fail: a snippet that needs a blocked extra fails as on a machine without it."""
    done = _run_with_only(("retrieval",), "import lancedb", tmp_path)
    assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, done.stderr[-2000:]


def _quickstart() -> str:
    section = README.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the quickstart must be exactly one python block"
    return blocks[0]


def test_quickstart_is_short_and_runs_as_written_after_the_install_it_names(tmp_path):
    section = README.split("\n## Quickstart\n", 1)[1].split("```python", 1)[0]
    extras = _named_install(section)
    assert extras == ("retrieval",)  # what scripts/demo.sh installs
    assert 'pip install -qq -c constraints.txt -e ".[retrieval]"' in (ROOT / "scripts" / "demo.sh").read_text()
    code = _quickstart()
    assert len(code.strip().splitlines()) <= 30
    done = _run_with_only(extras, code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.splitlines()
    # what the comments promise: the answers come from the composed / retrieved states
    assert printed[0] == "' tea.'", printed
    assert printed[1].startswith("' Iron.' ['Tari'"), printed


def test_readme_is_short():
    assert len(README.splitlines()) <= 250, "the README is the one-screen overview: move details to docs/"


def test_feature_snippets_run_as_written_after_the_install_they_name(tmp_path):
    section = README.split("\n## Features\n", 1)[1].split("\n## ", 1)[0]
    extras = _named_install(section.split("```", 1)[0])
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) >= 5, "one snippet per feature"
    done = _run_with_only(extras, "\n".join(blocks), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "['Tari']" in done.stdout.splitlines(), done.stdout


def test_the_lm_eval_line_runs_as_written_with_the_eval_extra_only(tmp_path):
    """The Features section's shell ``lm-eval`` line (its text says it needs ``eval``) runs with only what
    ``[eval]`` installs (it brings ``retrieval``): lm-eval's HF model module imports accelerate, which lm-eval itself
    declares only under its ``hf`` extra, so ``[eval]`` names it. Offline, on the bundled demo model and passages;
    as written (the line has no ``--limit``), through the console script's entry point."""
    import shlex

    section = README.split("\n## Features\n", 1)[1].split("\n## ", 1)[0]
    assert "the shell's `lm-eval` line needs `eval` too" in section
    (line,) = [text for text in section.splitlines() if text.startswith("hf-statecompose lm-eval run ")]
    argv = shlex.split(line)[1:]
    code = f"import sys\nfrom hf_statecompose.cli import main\nsys.exit(main({argv!r}))\n"
    done = _run_with_only(("eval", "retrieval"), code, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "statecompose_recall_mc" in done.stdout and "acc" in done.stdout, done.stdout[-3000:]


def test_local_links_exist():
    for document in [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]:
        text = document.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (document.parent / target).exists(), f"{document.name} links to a missing {target}"


def test_the_two_commands_make_then_reuse_one_project_venv(tmp_path):
    """``scripts/demo.sh`` and ``scripts/test.sh`` install into the project's virtual environment (made once, then
    reused, and named), never into the ``python`` on PATH."""
    for script in ("demo.sh", "test.sh"):
        assert "\nsource scripts/project_venv.sh\n" in (ROOT / "scripts" / script).read_text()
    venv = tmp_path / "venv"
    show = 'source scripts/project_venv.sh && python -c "import sys; print(sys.prefix)"'
    runs = [
        subprocess.run(
            ["bash", "-c", show], cwd=ROOT, env={**ENV, "HSC_VENV": str(venv)}, capture_output=True, text=True
        )
        for _ in range(2)
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[-1] == str(venv)
    assert runs[0].stdout.startswith(f"making the project's virtual environment: {venv}")
    assert runs[1].stdout.startswith(f"using the project's virtual environment: {venv}")
