"""A character tokenizer and a bag-of-words retriever for store tests on tiny random models."""

import hashlib
import re

import torch

from helpers import VOCAB


class CharTokenizer:
    """One token per character (ids 3..VOCAB-1); enough to drive tiny random models."""

    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        ids = [3 + ord(c) % (VOCAB - 3) for c in text]
        if return_tensors == "pt":
            return {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        return {"input_ids": ids}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(32 + (int(i) - 3) % 95) for i in ids)


class BagOfWords:
    """Hashed word counts: texts sharing words are similar; deterministic, instant."""

    name = "test-bag-of-words"

    def __init__(self, dim: int = 64):
        self.dim = dim

    def __call__(self, texts):
        out = torch.zeros(len(texts), self.dim)
        for row, text in enumerate(texts):
            for word in re.findall(r"\w+", text.lower()):
                out[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % self.dim] += 1
        return out + 1e-3  # no all-zero rows


TEXTS = [
    "the red fox jumps over the fence",
    "a quiet river runs to the sea",
    "copper and tin make bronze",
    "the mountain town is known for wool",
    "bees make honey in the summer",
    "iron ships sail across the bay",
    "glass is made from sand and heat",
]


def tiny_mamba2():
    """(model, tokenizer) for encode_corpus's actors: the tiny random Mamba-2 of the tests (seed 0)."""
    from helpers import tiny_model

    return tiny_model("mamba2"), CharTokenizer()


class DyingBagOfWords(BagOfWords):
    """BagOfWords (same name: same store) whose process SIGKILLs itself on its 3rd call if the file named
    by $HSC_KILL_MARKER does not exist yet (it creates it first): a worker dying mid-run, once."""

    def __call__(self, texts):
        import os
        import signal

        self.calls = getattr(self, "calls", 0) + 1
        marker = os.environ.get("HSC_KILL_MARKER")
        if marker and self.calls == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__call__(texts)
