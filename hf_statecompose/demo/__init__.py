"""The embedded demo: four small checkpoints (``models/``), bundled passages (``data/``), the main job
(``python -m hf_statecompose.demo``, ``run.py``), the corpora and the PICASO evaluation (``eval.py``)."""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "models"
DEMO_ARCHS = ("mamba2", "mamba", "hybrid", "gdn")
# names that mean an embedded demo checkpoint (CLI --model, lm-eval pretrained=, recipes' model=)
DEMO_SPECS = {
    "demo": "mamba2",
    "demo-mamba2": "mamba2",
    "demo-mamba": "mamba",
    "demo-hybrid": "hybrid",
    "demo-gdn": "gdn",
}
# a checkpoint folder holds one of these when it has a tokenizer (without any, transformers 5 makes an
# empty one that turns every text into no tokens)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def checkpoint_problem(path) -> str | None:
    """What makes ``path`` unusable as a local checkpoint folder (a causal LM and its tokenizer), or
    ``None``; files only (nothing is loaded), so that the command line and the Ray driver can refuse a
    wrong ``--model`` before they load or start anything."""
    folder = Path(path)
    if not folder.is_dir():
        return (
            f"{str(path)!r} is not one of {', '.join(DEMO_SPECS)} nor a local checkpoint folder (nothing is downloaded)"
        )
    if not (folder / "config.json").is_file():
        return f"{str(path)!r} holds no config.json: not a transformers checkpoint folder"
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return (
            f"{str(path)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...): "
            "save the tokenizer beside the model (tokenizer.save_pretrained(folder))"
        )
    return None


def load_demo(arch: str = "mamba2", device=None):
    """``(model, tokenizer)`` of an embedded demo model (``"mamba2"``, default, ``"mamba"``, ``"hybrid"`` or
    ``"gdn"``), enabled.

    Small (3.6M parameters) Mamba-2 / Mamba-1 causal LMs, a 4.9M-parameter hybrid (transformers'
    NemotronH: Mamba-2 layers and two attention layers without positional encoding) and a 4.3M-parameter
    gated DeltaNet hybrid (transformers' Qwen3.5 text model, ``qwen3_5_text``: six gated DeltaNet layers and
    one attention layer) trained by ``recipes/train_demo.py`` on the Wikipedia excerpt of the gensim wheel
    and a synthetic fact-recall task; see ``model_cards/``. Loaded from the package's files, never from the Hub.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..compat import quiet_loading
    from ..generation.integration import enable

    if arch not in DEMO_ARCHS:
        raise ValueError(f"unknown demo arch {arch!r}; choose one of {DEMO_ARCHS}")
    path = DEMO_DIR / arch
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"the demo checkpoint {path} is missing; train it with: python recipes/train_demo.py --arch {arch}"
        )
    with quiet_loading():  # no "Loading weights" bar: the checkpoint loads in milliseconds
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if device is not None:
        model.to(device)
    return enable(model.eval()), tokenizer
