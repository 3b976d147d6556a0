"""The embedded demo: two small checkpoints (``models/``), bundled passages (``data/``), the main job
(``python -m hf_statecompose.demo``, ``run.py``), the corpora and the PICASO evaluation (``eval.py``)."""
from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent / "models"
DEMO_ARCHS = ("mamba2", "mamba")
# names that mean an embedded demo checkpoint (CLI --model, lm-eval pretrained=, recipes' model=)
DEMO_SPECS = {"demo": "mamba2", "demo-mamba2": "mamba2", "demo-mamba": "mamba"}


def load_demo(arch: str = "mamba2", device=None):
    """``(model, tokenizer)`` of an embedded demo model (``"mamba2"``, default, or ``"mamba"``), enabled.

    Small (3.6M parameters) Mamba-2 / Mamba-1 causal LMs trained by ``recipes/train_demo.py`` on the
    Wikipedia excerpt of the gensim wheel and a synthetic fact-recall task; see ``model_cards/``.
    Loaded from the package's files, never from the Hub.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..generation.integration import enable

    if arch not in DEMO_ARCHS:
        raise ValueError(f"unknown demo arch {arch!r}; choose one of {DEMO_ARCHS}")
    path = DEMO_DIR / arch
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"the demo checkpoint {path} is missing; train it with: python recipes/train_demo.py --arch {arch}")
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if device is not None:
        model.to(device)
    return enable(model.eval()), tokenizer
