import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when the kernels are defined: without a GPU the Triton kernels run in
# its CPU interpreter (slow: the kernel tests keep lengths <= 128). With a GPU they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from helpers import tiny_model  # noqa: E402

hf_logging.set_verbosity_error()


@pytest.fixture(params=["mamba", "mamba2"])
def arch(request):
    return request.param


@pytest.fixture
def model(arch):
    return tiny_model(arch)
