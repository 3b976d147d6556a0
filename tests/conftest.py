import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

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
