"""The docs' benchmark figures: ``benchmarks/plot_all.py`` redraws every one from the committed JSON, and the
benchmark and experiment pages show only figures that exist."""

import importlib.util
import itertools
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


def _covered(legend_box, points) -> bool:
    import numpy as np

    x, y = points[:, 0], points[:, 1]
    inside = (x > legend_box.x0) & (x < legend_box.x1) & (y > legend_box.y0) & (y < legend_box.y1)
    return bool(np.any(inside & np.isfinite(x) & np.isfinite(y)))


def test_no_legend_covers_a_line_or_a_bar():
    """Every figure from the committed JSON: no legend's box (in pixels) holds a point of a plotted line (its
    segments sampled every pixel or so, baselines included) or overlaps a bar, and every legend lies inside the
    figure (not cut off at its edge)."""
    import numpy as np

    plot = _load("_plot")
    plt = plot._pyplot()
    checked = 0
    for key in plot.FIGURES:
        json_path = plot.RESULTS / key
        if not json_path.exists():
            continue
        fig = plot.draw(json_path, key)
        try:
            renderer = fig.canvas.get_renderer()
            legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
            boxes = [legend.get_window_extent(renderer) for legend in legends]
            for box in boxes:
                assert fig.bbox.x0 - 1 <= box.x0 and box.x1 <= fig.bbox.x1 + 1, (key, "legend cut off", box)
                assert fig.bbox.y0 - 1 <= box.y0 and box.y1 <= fig.bbox.y1 + 1, (key, "legend cut off", box)
            for ax in fig.axes:
                clip = ax.get_window_extent(renderer)
                for line in ax.get_lines():
                    xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
                    # densify each segment (about one point per pixel), then keep what the axes show
                    dense = [xy[:1]]
                    for a, b in itertools.pairwise(xy):
                        steps = int(min(max(np.hypot(*(b - a)), 1), 5000)) if np.all(np.isfinite([a, b])) else 1
                        dense.append(a + (b - a) * np.linspace(0, 1, steps + 1)[1:, None])
                    points = np.concatenate(dense)
                    x, y = points[:, 0], points[:, 1]
                    points = points[(x >= clip.x0) & (x <= clip.x1) & (y >= clip.y0) & (y <= clip.y1)]
                    for box in boxes:
                        assert not _covered(box, points), f"{key}: a legend covers the line {line.get_label()!r}"
                for patch in ax.patches:
                    extent = patch.get_window_extent(renderer)
                    if extent.width < 1 or extent.height < 1:
                        continue
                    for box in boxes:
                        assert not extent.overlaps(box), f"{key}: a legend covers a bar"
            checked += 1
        finally:
            plt.close(fig)
    assert checked == len(plot.FIGURES)
