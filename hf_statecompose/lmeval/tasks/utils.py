"""Loaders and metrics of the bundled ``statecompose_*`` lm-eval tasks.

The data files sit next to this file. lm-eval 0.4.13 resolves ``dataset_kwargs: {data_files: ...}``
relative to the current directory, not to the YAML, so each task loads its ``.jsonl`` with
``custom_dataset: !function utils.load_...`` (``datasets.load_dataset("json", ...)`` on the absolute
path): the tasks run from any directory.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str):
    import datasets

    return datasets.load_dataset("json", data_files={"test": str(HERE / f"{name}.jsonl")})


def load_wikipedia(**kwargs):
    return _load("wikipedia")


def load_wikipedia_rolling(**kwargs):
    return _load("wikipedia_rolling")


def load_recall_mc(**kwargs):
    return _load("recall_mc")


def process_wikipedia(doc, results):
    """``results`` = [(loglikelihood of the continuation, is_greedy)]: the continuation's bits per
    UTF-8 byte and its byte / word perplexities (weighted over the whole task, as for wikitext)."""
    loglikelihood, _ = results[0]
    continuation = doc["continuation"]
    n_bytes = len(continuation.encode("utf-8"))
    n_words = max(1, len(continuation.split()))
    return {
        "bits_per_byte": (loglikelihood, n_bytes),
        "byte_perplexity": (loglikelihood, n_bytes),
        "word_perplexity": (loglikelihood, n_words),
    }
