import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

# Triton reads TRITON_INTERPRET when the kernels are defined: without a GPU the Triton kernels run in
# its CPU interpreter (slow: the kernel tests keep lengths <= 128). With a GPU they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers.utils import logging as hf_logging

from helpers import tiny_model

hf_logging.set_verbosity_error()


@pytest.fixture(params=["mamba", "mamba2"])
def arch(request):
    return request.param


@pytest.fixture
def model(arch):
    return tiny_model(arch)
