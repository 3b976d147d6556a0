"""pytest plugin (``-p enable_plugin``, with this folder importable): every model of transformers' that the
architecture table guards (``hf_statecompose.state.architectures.guarded_classes()``: Mamba, Mamba-2, FalconMamba, the
hybrids) that the tests of the session build is ``hf_statecompose.enable``d as soon as it is built.

test_transformers_suites.py runs transformers' own test modules for those models once without and once with this
plugin: ``enable`` must change nothing for calls without ``past_states``, so the outcomes must be the same.

How: the ``__init__`` of each class that ``guarded_classes()`` names (MambaModel, MambaForCausalLM, ...,
JambaModel, ...) is wrapped so that the outermost model built (a causal LM, not the backbone it builds inside) is
enabled when its ``__init__`` returns, as a user would enable it right after ``from_pretrained`` / ``from_config``. At the end the
plugin writes how many models it enabled to the file named by ``HSC_ENABLED_COUNT_FILE`` (if set).
"""

from __future__ import annotations

import functools
import importlib
import os
import threading

import hf_statecompose as hsc
from hf_statecompose.state.architectures import guarded_classes

COUNT_FILE_ENV = "HSC_ENABLED_COUNT_FILE"
_building = threading.local()  # how deep we are in wrapped __init__ calls, per thread
_enabled = {"models": 0}


def _enabling_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        depth = getattr(_building, "depth", 0)
        _building.depth = depth + 1
        try:
            original(self, *args, **kwargs)
        finally:
            _building.depth = depth
        if depth == 0:  # the outermost model: a backbone built inside a causal LM is enabled with it
            hsc.enable(self)
            _enabled["models"] += 1

    __init__._hsc_enabling = True
    return __init__


def pytest_configure(config):
    for module_name, class_names in guarded_classes().items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a transformers release without that model
            continue
        for name in class_names:
            cls = getattr(module, name)
            if not getattr(cls.__init__, "_hsc_enabling", False):
                cls.__init__ = _enabling_init(cls.__init__)


def pytest_unconfigure(config):
    path = os.environ.get(COUNT_FILE_ENV)
    if path:
        with open(path, "w") as handle:
            handle.write(str(_enabled["models"]))
