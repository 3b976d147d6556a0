"""Where transformers' own tests are, for the tests that run them (test_transformers_common.py,
test_transformers_suites.py).

transformers' tests are not an installable package: they live in its source tree (``tests/``), which the test
command fetches for the installed release and names in the environment variable ``HSC_TRANSFORMERS_TESTS``.
transformers' PyPI source distribution (what the test command can fetch: these machines reach package registries
only) carries only the top-level ``tests/*.py``, without the ``generation/``, ``exporters/``, ``utils/`` and
``models/`` folders. From it, ``ModelTesterMixin`` (``test_modeling_common.py``) still runs: the two mixins it
imports from the missing folders are registered as empty placeholders (:func:`import_transformers_test`), so the
model tests run and the generation / export tests are simply absent. With the full tree (the repository at the
release's tag), everything runs: the generation mixin, the config tester and transformers' Mamba suites.
They import each other relatively as the package ``tests`` (``from .generation.test_utils import ...``), so
:func:`import_transformers_test` loads them as that package from that folder with importlib: this module is
the one place that does, and it edits no ``sys.path``. Without the variable (or with a folder that lacks the
files), the tests that need them skip, saying why.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import transformers

ENV = "HSC_TRANSFORMERS_TESTS"
PACKAGE = "tests"  # the name transformers' test modules import each other under
# the files the common tests import (test_modeling_common imports the generation and export mixins,
# test_configuration_common the repository's utils/test_module); paths under transformers' tests/
COMMON_FILES = (
    "__init__.py",
    "test_modeling_common.py",
    "test_configuration_common.py",
    "generation/__init__.py",
    "generation/test_utils.py",
    "exporters/__init__.py",
    "exporters/test_export.py",
    "utils/__init__.py",
    "utils/test_configuration_utils.py",
    "../utils/test_module/custom_configuration.py",
)
# what ModelTesterMixin alone needs (the transformers sdist has it; the rest of COMMON_FILES needs the full tree)
MODEL_MIXIN_FILES = ("test_modeling_common.py",)
# imported by test_modeling_common from folders the sdist lacks: empty placeholders stand in for them there
_PLACEHOLDERS = {"generation.test_utils": "GenerationTesterMixin", "exporters.test_export": "ExportTesterMixin"}
# what the model test modules import besides (the pipeline mixin reads the tiny-model summary and the source tree)
MODEL_SUITE_FILES = ("test_pipeline_mixin.py", "utils/tiny_model_summary.json", "../src/transformers/__init__.py")


def transformers_tests_dir() -> Path | None:
    """The ``tests/`` folder of transformers' source tree named by ``HSC_TRANSFORMERS_TESTS`` (None if unset)."""
    value = os.environ.get(ENV)
    return Path(value).resolve() if value else None


def missing_reason(*files: str) -> str | None:
    """Why transformers' tests ``files`` (paths under its ``tests/``) cannot run here, or None if they can."""
    folder = transformers_tests_dir()
    if folder is None:
        return (
            f"{ENV} is not set: it names the tests/ folder of transformers' source tree for the installed "
            f"release (transformers {transformers.__version__}); the test command sets it"
        )
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        return f"{ENV}={folder} lacks {', '.join(missing)} (transformers' tests for {transformers.__version__})"
    return None


def import_transformers_test(name: str):
    """Import ``tests.<name>`` (e.g. ``"test_modeling_common"``) from transformers' tests folder."""
    folder = transformers_tests_dir()
    package = sys.modules.get(PACKAGE)
    if package is None:
        if (folder / "__init__.py").is_file():
            spec = importlib.util.spec_from_file_location(
                PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
            )
            package = importlib.util.module_from_spec(spec)
            sys.modules[PACKAGE] = package
            spec.loader.exec_module(package)
        else:  # the sdist's tests/ has no __init__.py: a plain package over that folder
            package = types.ModuleType(PACKAGE)
            package.__path__ = [str(folder)]
            sys.modules[PACKAGE] = package
        for module, mixin in _PLACEHOLDERS.items():
            if not (folder / (module.replace(".", "/") + ".py")).is_file():
                _placeholder(module, mixin)
    elif Path(package.__path__[0]).resolve() != folder:
        raise ImportError(
            f"a module named {PACKAGE!r} is already imported from {list(package.__path__)}, "
            f"not transformers' tests at {folder}"
        )
    return importlib.import_module(f"{PACKAGE}.{name}")


def _placeholder(module: str, mixin: str) -> None:
    """Register ``tests.<module>`` holding an empty class ``mixin``: what test_modeling_common imports from a
    folder that transformers' sdist lacks. A tester inheriting it gets no tests from it."""
    parent = f"{PACKAGE}.{module.split('.')[0]}"
    if parent not in sys.modules:
        sys.modules[parent] = types.ModuleType(parent)
        sys.modules[parent].__path__ = []
    placeholder = types.ModuleType(f"{PACKAGE}.{module}")
    setattr(
        placeholder,
        mixin,
        type(mixin, (), {"__doc__": f"placeholder: transformers' sdist lacks tests/{module}", "hsc_placeholder": True}),
    )
    sys.modules[placeholder.__name__] = placeholder


def is_placeholder(cls) -> bool:
    """Whether ``cls`` is a placeholder mixin (its tests could not be loaded from the folder given)."""
    return bool(vars(cls).get("hsc_placeholder", False))  # its own, not inherited (ModelTesterMixin inherits one)
