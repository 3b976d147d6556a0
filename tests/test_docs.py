"""The documentation site: every ```python block of docs/ runs as written, the site builds with --strict, and
every relative link of docs/ and README.md points at a file that exists.

A page is a script: its python blocks run in order in one fresh process (later blocks use earlier names), in
an empty temporary folder, offline. ```bash blocks are not run."""

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# a fenced python block, also indented (inside a list item): group 2 is its code, still indented
PYTHON_BLOCK = re.compile(r"^([ \t]*)```python\n(.*?)^\1```", flags=re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")

# what a page's text promises its code prints (lines of stdout, in order, each a prefix of a printed line)
PROMISED_OUTPUT = {
    "getting-started/quickstart.md": ["' tea.'", "' Iron.' ['Tari'"],
    "getting-started/concepts.md": ["ComposableMambaCache(architecture='mamba2', layers=6, batch=1, tokens=[5]"],
    "guides/composition.md": ["('soup', 'weighted', 'caso', 'picaso_s', 'picaso_r', 'concat', 'piconcat_r')"],
    "guides/stores.md": ["Tari river Iron. {'source': 'b'}", "' Iron.' ['Tari'", "2"],
    "guides/scale-out.md": ["['Tari']"],
    "guides/hybrids.md": ["' tea.' ' tea.'"],
    "guides/coffee.md": ["384", "(1, 512, 1)", "512 3385"],
    "reference/state-files.md": ["1 mamba2 torch.float32 6"],
    "reference/bad-input.md": ["TypeError: input_ids must be a tensor", "ValueError: input_ids must have shape"],
}

# pages whose code needs an optional extra: skipped (with the reason) where it is not installed
PAGE_NEEDS = {
    "guides/scale-out.md": "lancedb",  # [scale]
    "guides/fine-tuning.md": "peft",  # [train]
    "guides/lm-eval.md": "lm_eval",  # [eval]
}


def _pages_with_code() -> list[str]:
    return sorted(
        str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if PYTHON_BLOCK.search(p.read_text(encoding="utf-8"))
    )


def _env() -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("page", _pages_with_code())
def test_page_code_runs_as_written(page, tmp_path):
    needs = PAGE_NEEDS.get(page)
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{page} needs {needs} (an optional extra)")
    blocks = PYTHON_BLOCK.findall((DOCS / page).read_text(encoding="utf-8"))
    code = "\n\n".join(textwrap.dedent(block) for _, block in blocks)
    # (generate.md runs custom_generate/: transformers copies it into HF_MODULES_CACHE)
    env = {**_env(), "HF_STATECOMPOSE_CACHE": str(tmp_path / "cache"), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{page}:\n{done.stderr[-3000:]}"
    printed = done.stdout.splitlines()
    for promised in PROMISED_OUTPUT.get(page, []):
        assert any(line.startswith(promised) for line in printed), f"{page} does not print {promised!r}: {printed}"
        printed = printed[next(i for i, line in enumerate(printed) if line.startswith(promised)) + 1 :]


def test_promised_outputs_name_pages_with_code():
    assert set(PROMISED_OUTPUT) | set(PAGE_NEEDS) <= set(_pages_with_code())


def test_relative_links_exist():
    documents = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    for document in documents:
        for target in LINK.findall(document.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (document.parent / target).exists(), f"{document.relative_to(ROOT)} links to a missing {target}"


def test_docs_links_stay_inside_the_site():
    """A page linking outside docs/ builds a dead link on the site: name repository files in `code` instead."""
    for page in sorted(DOCS.rglob("*.md")):
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(DOCS.resolve()), (
                f"docs/{page.relative_to(DOCS)} links outside docs/: {target}"
            )


def test_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in sorted(DOCS.rglob("*.md")):
        assert f" {page.relative_to(DOCS).as_posix()}\n" in nav, (
            f"docs/{page.relative_to(DOCS)} is not in mkdocs.yml's nav"
        )


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (the [docs] extra)")
def test_site_builds_strict(tmp_path):
    env = {**_env(), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").exists()


def test_api_reference_covers_the_public_api():
    """Every name of hf_statecompose.__all__ has its entry on the API page (`::: module.Name`; METHODS in text)."""
    import hf_statecompose

    page = (DOCS / "reference" / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: [\w.]+\.(\w+)$", page, flags=re.MULTILINE))
    missing = [name for name in hf_statecompose.__all__ if name not in documented and f"`hsc.{name}`" not in page]
    assert not missing, f"docs/reference/api.md lacks {missing}"


# a repository path named in code style in the docs, the READMEs or a docstring (`benchmarks/ttft.py`)
REPO_PATH = re.compile(r"`((?:hf_statecompose|tests|benchmarks|recipes|scripts|kernels|docs|model_cards)/[\w./-]+)`")
# `python -m hf_statecompose.x.y`
MODULE_RUN = re.compile(r"python -m (hf_statecompose(?:\.\w+)+)")


def test_paths_and_modules_named_in_the_text_exist():
    """Cross-references do not go stale: every repository path written in code style, and every module run with
    ``python -m``, in the tracked markdown and Python files, exists (a path may be relative to its file)."""
    tracked = subprocess.run(["git", "ls-files", "*.md", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    stale = []
    for name in tracked.stdout.split():
        if name.startswith(("adapters/", "checkpoints/")):  # the trained artefacts' cards (generated, frozen)
            continue
        path = ROOT / name
        if not path.exists() or name == "tests/test_docs.py":  # (its patterns' examples)
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in REPO_PATH.finditer(text):
            target = match.group(1).rstrip(".")
            if target == "kernels/__init__.py" or target.startswith(
                "tests/models/"
            ):  # must not exist; transformers' tree
                continue
            if not (ROOT / target).exists() and not (path.parent / target).exists():
                stale.append(f"{name}: `{target}`")
        for match in MODULE_RUN.finditer(text):
            module = ROOT / match.group(1).replace(".", "/")
            if not (module.with_suffix(".py").exists() or (module / "__main__.py").exists()):
                stale.append(f"{name}: python -m {match.group(1)}")
    assert stale == [], "stale references:\n" + "\n".join(stale)
