"""The docs' benchmark figures: ``benchmarks/plot_all.py`` redraws every one from the committed JSON, and the
benchmark and experiment pages show only figures that exist."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _load(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_plot_all_draws_every_figure_from_the_committed_json(tmp_path):
    plot = _load("_plot")
    written = _load("plot_all").main(["--out", str(tmp_path)])
    expected = {png for png, _ in plot.FIGURES.values()}
    assert {path.name for path in written} == expected
    for png in expected:
        data = (tmp_path / png).read_bytes()
        assert data.startswith(b"\x89PNG") and 5_000 < len(data) < 100_000, (png, len(data))
    # the committed copies are what plot_all draws (same names), each small
    for png in expected:
        assert (DOCS / "img" / png).is_file(), f"docs/img/{png} missing: run python benchmarks/plot_all.py"
        assert (DOCS / "img" / png).stat().st_size < 100_000


def test_plot_refuses_an_unknown_result_clearly(tmp_path):
    plot = _load("_plot")
    (tmp_path / "nope.json").write_text("{}")
    with pytest.raises(KeyError, match=r"no figure for .*nope\.json"):
        plot.plot(tmp_path / "nope.json", tmp_path / "nope.png")
    with pytest.raises(KeyError, match=r"no docs figure for nope\.json"):
        plot.plot_docs(tmp_path / "nope.json", "nope.json")


def test_docs_show_only_figures_that_exist_and_every_figure_is_shown():
    pages = [DOCS / "benchmarks.md", *sorted((DOCS / "experiments").glob("*.md"))]
    assert pages[0].is_file() and len(pages) > 1
    shown = set()
    for page in pages:
        for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+\.png)\)", page.read_text()):
            path = (page.parent / target).resolve()
            assert path.is_file(), f"{page.relative_to(ROOT)} shows {target}, which does not exist"
            shown.add(path.name)
    drawn = {png for png, _ in _load("_plot").FIGURES.values()}
    assert drawn <= shown, f"figures drawn but shown on no page: {sorted(drawn - shown)}"
