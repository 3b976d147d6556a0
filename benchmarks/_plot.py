"""Plots of the benchmark and experiment results, drawn from their JSON only (nothing is rerun).

``plot(json_path, out_png)`` picks the drawing by the JSON's path under ``benchmarks/results/`` (``FIGURES``
maps each known result to its PNG name and drawing function); every script that writes one of these JSON files
draws its figure into ``docs/img/`` with ``--plot``, and ``benchmarks/plot_all.py`` redraws every PNG under ``docs/img/``. Figures show
ratios against the baseline of the same run where the benchmark has one (absolute times on the shared 2-core
machine are noisy). matplotlib (the ``recipes`` extra) with the Agg backend, 100 dpi: each PNG is small.

Readable on the docs pages (which show a figure at the text width, about 750 px): fonts of 10-12 pt (``STYLE``) and
every legend outside the plotting area (``_legends_outside``: one legend under the figure where its panels share
their entries, else one right of its panel), so that no legend covers data; ``constrained`` layout makes room for
them. ``draw`` returns the laid-out figure (tests/test_benchmark_plots.py checks that no legend covers a line or a
bar of any figure).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
DPI = 100
# readable at the docs' text width: a 10-inch figure is shown about 750 px wide, so 12 pt is about 12 px there
STYLE = {
    "font.size": 12,
    "axes.titlesize": 12,
    "axes.labelsize": 12,
    "xtick.labelsize": 11,
    "ytick.labelsize": 11,
    "legend.fontsize": 11,
    "figure.titlesize": 13,
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _legends_outside(fig) -> None:
    """Move every axes' legend out of its plotting area: panels that share their legend entries get one legend
    under the figure, any other legend goes right of its panel. Uses the ``constrained`` layout, which makes room
    for both."""
    fig.set_layout_engine("constrained")
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None]
    if not legends:
        return
    entries = [ax.get_legend_handles_labels() for ax, _ in legends]
    for _, legend in legends:
        legend.remove()
    shared = len(legends) > 1 and all(labels == entries[0][1] for _, labels in entries)
    if shared:
        handles, labels = entries[0]
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), frameon=False)
        return
    for (ax, _), (handles, labels) in zip(legends, entries):
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)


def _bars(ax, labels, values, xlabel, baseline=1.0, log=False):
    """Horizontal bars, one per label, with a dashed line at the baseline (1.0 for ratios)."""
    ys = range(len(labels))
    ax.barh(list(ys), values, color="tab:blue")
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    if baseline is not None:
        ax.axvline(baseline, color="black", linestyle="--", linewidth=0.8)
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)


def _compose_floor(d, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, arch in zip(axes, ("mamba", "mamba2")):
        rows = [r for r in d["rows"] if r["arch"] == arch]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["over_floor_sum"] for r in rows], 0.4, label="/ plain torch sum")
        ax.bar([i + 0.2 for i in x], [r["over_floor_bandwidth"] for r in rows], 0.4, label="/ bytes÷bandwidth")
        ax.set_xticks(list(x), [r["method"] for r in rows])
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set(ylabel="time / floor (same run)", title=f"compose n = {d['n']} states, {arch} 130M shapes")
        ax.legend()
    return fig


def _compose_vs_concat(d, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, arch in zip(axes, ("mamba", "mamba2")):
        for method in sorted({r["method"] for r in d["rows"]} - {"concat"}):
            rows = sorted((r for r in d["rows"] if r["arch"] == arch and r["method"] == method), key=lambda r: r["n"])
            ax.plot(
                [r["n"] for r in rows], [r["ttft_speedup_vs_concat"] for r in rows], "-o", markersize=3, label=method
            )
        ax.set(xlabel="contexts n", ylabel="TTFT speed-up\nvs concat prefill", title=arch, yscale="log")
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.legend()
    return fig


def _kernels(d, plt):
    fig, ax = plt.subplots(figsize=(7, 3.2))
    rows = d["encode"]
    labels = [f"{r['arch']}\n{r['tokens']}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["encode_over_floor"] for r in rows], 0.4, label="our encode")
    ax.bar([i + 0.2 for i in x], [r["transformers_over_floor"] for r in rows], 0.4, label="transformers' prefill")
    ax.set_xticks(list(x), labels)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set(ylabel="time / dense-projection floor", title=f"encode, 130M shapes ({d.get('clock', 'wall')} clock)")
    ax.legend()
    return fig


def _store_read(d, plt):
    fig, axes = plt.subplots(1, len(d["rows"]), figsize=(5 * len(d["rows"]), 2.8), squeeze=False)
    for ax, row in zip(axes[0], d["rows"]):
        ratios = row["ratio_to_load_file"]
        _bars(ax, list(ratios), list(ratios.values()), "time / safetensors load_file")
        ax.set_title(f"k = {row['k']}, {row['entries_per_shard']} entries per shard")
    return fig


def _scale_store(d, plt):
    fig, axes = plt.subplots(1, 2, figsize=(11, 3))
    speed = d["encode"]["speed_vs_folder_add_loop"]
    _bars(axes[0], list(speed), list(speed.values()), "speed / folder store.add loop")
    axes[0].set_title(f"encode {d['encode']['passages']} passages")
    med = d["retrieval"]["median_seconds"]
    base = med["lance exact, top 10"]
    _bars(axes[1], list(med), [v / base for v in med.values()], "time / Lance exact top 10")
    axes[1].set_title(f"retrieve from {d['retrieval']['entries']:,} entries")
    return fig


def _rows_ratio(title, xlabel, log=False):
    def draw(d, plt):
        fig, ax = plt.subplots(figsize=(8, 0.4 * len(d["rows"]) + 1.2))
        _bars(ax, [r["what"] for r in d["rows"]], [r["ratio"] for r in d["rows"]], xlabel, log=log)
        fig.suptitle(title)  # (over the figure: a long title does not fit over the bars beside long labels)
        return fig

    return draw


def _state_checks(d, plt):
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(d["rows"]) + 1.2))
    _bars(ax, [r["case"].strip() for r in d["rows"]], [r["ms"] for r in d["rows"]], "ms (median)", baseline=None)
    ax.set_title("in-memory state checks")
    return fig


def _ttft(d, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    runs = [("", d["results"], "-o")]
    if "before_issue_21" in d:
        runs.append((" (before)", d["before_issue_21"]["results"], "--s"))
    for suffix, results, style in runs:
        for i, result in enumerate(results):
            rows = result["rows"]
            label = result["size"] + suffix
            axes[0].plot(
                [r["k"] for r in rows], [r["speedup"] for r in rows], style, color=f"C{i}", markersize=3, label=label
            )
            axes[1].plot(
                [r["k"] for r in rows],
                [r["ttft_over_k1"] for r in rows],
                style,
                color=f"C{i}",
                markersize=3,
                label=label,
            )
    axes[0].set(xlabel="stored contexts k (256 tokens each)", ylabel="speed-up vs\ntransformers' prefill", yscale="log")
    axes[1].set(xlabel="stored contexts k", ylabel="TTFT(k) / TTFT(1)")
    for ax in axes:
        ax.legend()
    fig.suptitle("time to first token through a folder store, Mamba-2 shapes")
    return fig


def _hybrid_ttft(d, plt):
    rows = d["result"]["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    axes[0].plot([r["k"] for r in rows], [r["speedup"] for r in rows], "-o", markersize=3)
    axes[0].set(xlabel="hybrid states k (256 tokens each)", ylabel="speed-up vs\ntransformers' prefill")
    axes[1].plot([r["k"] for r in rows], [r["ttft_over_k1"] for r in rows], "-o", markersize=3)
    axes[1].set(xlabel="hybrid states k", ylabel="TTFT(k) / TTFT(1)")
    fig.suptitle(f"time to first token, {d['result']['size']} ({d['composition']}, attention {d['attention']})")
    return fig


def _hybrid_state_size(d, plt):
    fig, ax = plt.subplots(figsize=(7, 3.4))
    tokens = [0, 2048, 4096, 8192, 16384]
    for row in d["rows"]:
        if row["dtype"] != "bfloat16":
            continue
        ax.plot(
            tokens,
            [(row["fixed_bytes"] + t * row["bytes_per_token"]) / 2**20 for t in tokens],
            "-o",
            markersize=3,
            label=row["model"],
        )
    ax.set(
        xlabel="context tokens", ylabel="state size (MiB, bf16)", title="one context's state, on paper from the configs"
    )
    ax.legend()
    return fig


def _training_scan(d, plt):
    fig, ax = plt.subplots(figsize=(7, 2.4))
    labels = ["Mamba-1 training scan (vs autograd reference)"] + [
        f"{arch} training step (vs transformers)" for arch in d["step"]
    ]
    values = [d["scan"]["speedup"]] + [v["speedup"] for v in d["step"].values()]
    _bars(ax, labels, values, "speed-up (same run)", log=True)
    return fig


def _serpent_speed(d, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    rows = d["rows"]
    lengths = sorted({r["length"] for r in rows})
    by = {(r["model"], r["length"]): r for r in rows}
    for other in sorted({r["model"] for r in rows} - {"serpent"}):
        fwd = [by["serpent", L]["forward_seconds"] / by[other, L]["forward_seconds"] for L in lengths]
        dec = [by["serpent", L]["decode_step_seconds"] / by[other, L]["decode_step_seconds"] for L in lengths]
        axes[0].plot(lengths, fwd, "-o", markersize=3, label=f"÷ {other}")
        axes[1].plot(lengths, dec, "-o", markersize=3, label=f"÷ {other}")
    axes[0].set(xlabel="sequence length L", ylabel="forward time ratio", xscale="log")
    axes[1].set(xlabel="sequence length L", ylabel="decode step time ratio", xscale="log")
    fig.suptitle("SeRpEnt's time / the other model's time")
    for ax in axes:
        ax.set_xticks(lengths, [str(L) for L in lengths], minor=False)
        ax.set_xticks([], minor=True)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.legend()
    return fig


def _serpent_composition(d, plt):
    fig, axes = plt.subplots(1, len(d["results"]), figsize=(10, 3.2), squeeze=False)
    methods = ["soup", "caso", "picaso_r", "piconcat_r"]
    for ax, (model, per_n) in zip(axes[0], d["results"].items()):
        ns = [n for n in sorted(per_n, key=int) if int(n) > 1]
        for i, n in enumerate(ns):
            ax.bar(
                [j + 0.8 * i / len(ns) for j in range(len(methods))],
                [per_n[n][m]["kl_share"] for m in methods],
                0.8 / len(ns),
                label=f"n = {n}",
            )
        ax.set_xticks([j + 0.2 for j in range(len(methods))], methods)
        ax.set(ylabel="KL(concat‖method) / KL(concat‖none)", title=model)
        ax.legend()
    return fig


def _coffee_parallel(d, plt):
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for weights in sorted({r["weights"] for r in d["rows"]}):
        rows = sorted((r for r in d["rows"] if r["weights"] == weights), key=lambda r: r["L"])
        ax.plot(
            [r["L"] for r in rows], [r["forward_ratio"] for r in rows], "-o", markersize=3, label=f"{weights}: forward"
        )
        ax.plot(
            [r["L"] for r in rows],
            [r["fwd_bwd_ratio"] for r in rows],
            "--s",
            markersize=3,
            label=f"{weights}: forward + backward",
        )
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set(
        xlabel="L", ylabel="parallel / sequential time", xscale="log", title="COFFEE mixer: Newton (DEER) vs loop, CPU"
    )
    ax.legend()
    return fig


def _linear_recurrence(d, plt):
    fig, ax = plt.subplots(figsize=(7, 2.4))
    labels = [f"{r['what']}, L = {r['L']}" for r in d["rows"]]
    _bars(ax, labels, [r["ratio_vs_reference"] for r in d["rows"]], "time / reference loop", log=True)
    return fig


def _store_dtype(d, plt):
    fig, ax = plt.subplots(figsize=(7, 2.8))
    labels, values = [], []
    for row in d["rows"]:
        for method in row["loss"]["fp32"]:
            labels.append(f"{row['model']} · {row['dataset']} · {method}")
            values.append(row["loss"]["bf16"][method] / row["loss"]["fp32"][method])
    _bars(ax, labels, values, "loss with bf16 states / loss with fp32 states")
    ax.set_xlim(0.99, 1.01)
    ax.set_xticks([0.99, 0.995, 1.0, 1.005, 1.01])
    return fig


def _adversarial(d, plt):
    fig, ax = plt.subplots(figsize=(7, 2.8))
    groups = [g for g in d["table"] if g != "total"]
    left = [0] * len(groups)
    for outcome in ("clear", "handled", "unclear", "silent", "hang", "lost"):
        values = [d["table"][g][outcome] for g in groups]
        ax.barh(groups, values, left=left, label=outcome)
        left = [a + b for a, b in zip(left, values)]
    ax.invert_yaxis()
    ax.set(xlabel="cases", ylabel="group", title=f"adversarial trial: {d['table']['total']['cases']} cases")
    ax.legend()
    return fig


def _hybrid_keys_dtype(d, plt):
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(d["rows"]) + 1.2))
    labels = [f"{r['model']} keys {r['keys_dtype'].replace('torch.', '')}" for r in d["rows"]]
    _bars(
        ax,
        labels,
        [max(r["max_abs_dlogit"], 1e-9) for r in d["rows"]],
        "max |Δ logit| vs fp32 keys (1e-9 = exact)",
        baseline=None,
        log=True,
    )
    return fig


def _coffee_composition(d, plt):
    fig, ax = plt.subplots(figsize=(8, 3.4))
    noises = sorted({r["noise"] for r in d["rows"] if r["noise"] > 0})
    series = {}
    for r in d["rows"]:
        if r["noise"] > 0 and r["method"] != "model on the concatenation (truth)":
            series.setdefault(f"{r['method']} ({r['order']})", {})[r["noise"]] = r["accuracy"]
    for label, by_noise in series.items():
        ax.plot(noises, [by_noise.get(m) for m in noises], "-o", markersize=3, label=label)
    ax.set(
        xlabel="extra noise tokens m", ylabel="target recall", xscale="log", title="COFFEE IH model under composition"
    )
    ax.legend()
    return fig


def _picaso_eval(d, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    ks = d["k"]
    for method, values in d["loss"].items():
        axes[0].plot(ks, values, "--" if method == "baseline" else "-o", markersize=3, label=method)
    for method, values in d["seconds"].items():
        axes[1].plot(ks[1:], [v * 1e3 for v in values[1:]], "-o", markersize=3, label=method)
    title = f"{d['model']} · {d['dataset']} ({d['samples']} samples)"
    axes[0].set(xlabel="retrieved contexts k", ylabel="continuation loss (nats/token)", title=title)
    axes[1].set(xlabel="retrieved contexts k", ylabel="time to the state (ms)", yscale="log", title=title)
    for ax in axes:
        ax.legend()
    return fig


def _finetune(d, plt):
    datasets = list(next(iter(d["variants"].values())))
    # (one panel: room for its legend on the right)
    fig, axes = plt.subplots(
        1, len(datasets), figsize=(5.5 * len(datasets) + 3.5 * (len(datasets) == 1), 3.8), squeeze=False
    )
    for ax, dataset in zip(axes[0], datasets):
        for i, (name, per) in enumerate(d["variants"].items()):
            loss = per[dataset]["loss"]
            ax.plot(d["k"], loss["picaso_r"], "-o", markersize=3, color=f"C{i}", label=f"{name} · PICASO-R")
            ax.plot(d["k"], loss["concat"], "--", color=f"C{i}", label=f"{name} · Concat")
        ax.set(
            xlabel="retrieved contexts k",
            ylabel="continuation loss (nats/token)",
            title=f"demo {d['arch']} · {dataset}",
        )
        ax.legend()
    return fig


def _hybrid_demo(d, plt):
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    ks = sorted(d["k"], key=int)
    for condition in d["k"][ks[0]]:
        axes[0].plot(
            [int(k) for k in ks], [d["k"][k][condition]["accuracy"] for k in ks], "-o", markersize=3, label=condition
        )
        axes[1].plot(
            [int(k) for k in ks], [d["k"][k][condition]["answer_loss"] for k in ks], "-o", markersize=3, label=condition
        )
    axes[0].set(
        xlabel="passages k",
        ylabel="exact answers",
        title=d["model"] + (" (attention zeroed)" if d.get("attention_zeroed") else ""),
    )
    axes[1].set(xlabel="passages k", ylabel="answer loss (nats/token)", title=d["model"])
    for ax in axes:
        ax.legend()
    return fig


# result JSON (relative to benchmarks/results/) -> (PNG name under docs/img/, drawing)
FIGURES = {
    "compose_floor.json": ("compose_floor.png", _compose_floor),
    "compose_vs_concat.json": ("compose_vs_concat.png", _compose_vs_concat),
    "encode_wall.json": ("ops_speed.png", _kernels),
    "kernels.json": ("ops_speed_before_native.png", _kernels),
    "store_read.json": ("store_read.png", _store_read),
    "scale_store.json": ("scale_store.png", _scale_store),
    "cli_startup.json": (
        "cli_startup.png",
        _rows_ratio("fresh interpreter per run", "time / import torch, transformers", log=True),
    ),
    "fingerprint_speed.json": ("fingerprint_speed.png", _rows_ratio("model fingerprint", "time / full hash", log=True)),
    "state_checks.json": ("state_checks.png", _state_checks),
    "ttft.json": ("ttft.png", _ttft),
    "hybrid_ttft.json": ("hybrid_ttft.png", _hybrid_ttft),
    "delta_rule_ttft.json": ("delta_rule_ttft.png", _hybrid_ttft),
    "kda_ttft.json": ("kda_ttft.png", _hybrid_ttft),
    "delta_rule_encode.json": (
        "delta_rule_encode.png",
        _rows_ratio("a Qwen3.5-shaped model's transitions: encode and decode time", "time ratio"),
    ),
    "delta_rule_encode_kda.json": (
        "delta_rule_encode_kda.png",
        _rows_ratio("a Kimi-Linear-shaped model's transitions: encode and decode time", "time ratio"),
    ),
    "hybrid_state_size.json": ("hybrid_state_size.png", _hybrid_state_size),
    "hybrid_keys_dtype.json": ("hybrid_keys_dtype.png", _hybrid_keys_dtype),
    "training_scan.json": ("training_scan.png", _training_scan),
    "serpent_speed.json": ("serpent_speed.png", _serpent_speed),
    "serpent_composition.json": ("serpent_composition.png", _serpent_composition),
    "coffee_parallel.json": ("coffee_parallel.png", _coffee_parallel),
    "coffee/composition.json": ("coffee_composition.png", _coffee_composition),
    "linear_recurrence.json": ("linear_recurrence.png", _linear_recurrence),
    "delta_rule_compose.json": (
        "delta_rule_compose.png",
        _rows_ratio(
            "delta-rule composition of n contexts, one Qwen3-Next-shaped layer", "time / caso of the same n", log=True
        ),
    ),
    "store_dtype.json": ("store_dtype.png", _store_dtype),
    "adversarial.json": ("adversarial.png", _adversarial),
    "eval/picaso_eval_mamba2_recall.json": ("picaso_eval_mamba2_recall.png", _picaso_eval),
    "eval/picaso_eval_mamba2_wikipedia.json": ("picaso_eval_mamba2_wikipedia.png", _picaso_eval),
    "eval/picaso_eval_mamba_recall.json": ("picaso_eval_mamba_recall.png", _picaso_eval),
    "eval/picaso_eval_mamba_wikipedia.json": ("picaso_eval_mamba_wikipedia.png", _picaso_eval),
    "finetune/finetune_mamba2.json": ("finetune_mamba2.png", _finetune),
    "finetune/finetune_mamba.json": ("finetune_mamba.png", _finetune),
    "finetune/finetune_mamba2_recall_2seeds.json": ("finetune_mamba2_recall_2seeds.png", _finetune),
    "eval_hybrid_demo_hybrid.json": ("hybrid_demo_hybrid.png", _hybrid_demo),
    "eval_hybrid_demo_hybrid_zero_attention.json": ("hybrid_demo_hybrid_zero_attention.png", _hybrid_demo),
    "eval_hybrid_demo_mamba2.json": ("hybrid_demo_mamba2.png", _hybrid_demo),
}


def _key(json_path) -> str:
    """The ``FIGURES`` key of a result: its path under ``benchmarks/results/`` (or any folder laid out like it)."""
    path = Path(json_path).resolve().as_posix()
    matches = [key for key in FIGURES if path == key or path.endswith("/" + key)]
    return max(matches, key=len) if matches else Path(json_path).name


def draw(json_path, figure: str | None = None):
    """The laid-out matplotlib figure of one result JSON (the caller closes it); ``figure`` is its ``FIGURES`` key
    (default: found from the JSON's path under ``benchmarks/results/``)."""
    key = figure or _key(json_path)
    if key not in FIGURES:
        raise KeyError(
            f"no figure for {json_path}: known results are {sorted(FIGURES)} (add a drawing to benchmarks/_plot.py FIGURES)"
        )
    plt = _pyplot()
    with plt.rc_context(STYLE):
        fig = FIGURES[key][1](json.loads(Path(json_path).read_text()), plt)
        _legends_outside(fig)
        fig.canvas.draw()  # lays it out (fonts of STYLE)
    return fig


def plot(json_path, out_png, figure: str | None = None) -> Path:
    """Draw the figure of one result JSON into ``out_png``; ``figure`` is its ``FIGURES`` key (default: found from
    the JSON's path under ``benchmarks/results/``)."""
    plt = _pyplot()
    fig = draw(json_path, figure)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    plt.close(fig)
    # a 256-colour palette (Pillow comes with matplotlib): a third of the size, no visible change on a plot
    from PIL import Image

    with Image.open(buffer) as image:
        image.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(out_png, optimize=True)
    return out_png


def plot_docs(json_path, figure: str) -> Path:
    """What a script's ``--plot`` calls: draw the JSON it just wrote as ``figure`` into the PNG the docs show
    (``docs/img/<name>.png``)."""
    if figure not in FIGURES:
        raise KeyError(
            f"no docs figure for {figure}: the figures are drawn from {sorted(FIGURES)} (add one to benchmarks/_plot.py)"
        )
    out = plot(json_path, DOCS_IMG / FIGURES[figure][0], figure)
    print(f"wrote {out}")
    return out


def plot_all(results_dir=RESULTS, out_dir=DOCS_IMG) -> list[Path]:
    """Every figure of ``FIGURES`` whose JSON exists under ``results_dir``, into ``out_dir``."""
    written = []
    for key, (png, _) in FIGURES.items():
        json_path = Path(results_dir) / key
        if json_path.exists():
            written.append(plot(json_path, Path(out_dir) / png, key))
    return written
