"""SeRpEnt-Mamba (``model_type = "serpent_mamba"``): config, model, causal LM, and their registration with
transformers' Auto classes.

Each module registers what it defines when it is imported: this package the config (``AutoConfig``),
``modeling_serpent`` the models (``AutoModel``, ``AutoModelForCausalLM``); ``import hf_statecompose``
imports them as soon as transformers imports its Auto classes (``hf_statecompose/__init__.py``). The
modeling module is imported on first use (PEP 562): transformers' hook imports this package while
transformers may be half way through importing its own modeling code, so the package must not import it.
"""

from __future__ import annotations

import importlib

from .configuration_serpent import SeRpEntMambaConfig

_MODELING = (
    "SeRpEntMambaCausalLMOutput",
    "SeRpEntMambaForCausalLM",
    "SeRpEntMambaModel",
    "SeRpEntMambaOutput",
    "SeRpEntMambaPreTrainedModel",
    "branch_ssm_forward",
)

__all__ = ["SeRpEntMambaConfig", *_MODELING, "register_auto_config", "register_auto_models"]


def __getattr__(name: str):
    if name in _MODELING:
        value = getattr(importlib.import_module(f"{__name__}.modeling_serpent"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_auto_config() -> None:
    """``AutoConfig`` knows ``serpent_mamba`` (done when this package is imported)."""
    from transformers.models.auto.configuration_auto import AutoConfig

    AutoConfig.register(SeRpEntMambaConfig.model_type, SeRpEntMambaConfig, exist_ok=True)


def register_auto_models() -> None:
    """``AutoModel`` / ``AutoModelForCausalLM`` build SeRpEnt models from a ``SeRpEntMambaConfig`` (done when
    :mod:`.modeling_serpent` is imported)."""
    importlib.import_module(f"{__name__}.modeling_serpent")._register_auto_models()


register_auto_config()
