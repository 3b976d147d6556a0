"""COFFEE (arXiv 2510.14027, ``model_type = "coffee"``): the state-feedback selective SSM mixer, parallel by
Newton / DEER (:mod:`.mixer`); config, models (causal LM with the ``"lm"`` and the paper's ``"core"`` head,
the MNIST classifier of App. I.2) and their registration with transformers' Auto classes.

As for SeRpEnt (:mod:`hf_statecompose.models.serpent`): this package registers the config (``AutoConfig``)
when imported, ``modeling_coffee`` the models (``AutoModel``, ``AutoModelForCausalLM``,
``AutoModelForImageClassification``); ``import hf_statecompose`` imports them as soon as transformers
imports its Auto classes. The mixer and modeling modules are imported on first use (PEP 562):
transformers' hook imports this package while transformers may be half way through importing its own
modeling code, so the package must not import them.
"""

from __future__ import annotations

import importlib

from .configuration_coffee import CoffeeConfig

_LAZY = {
    "CoffeeMixer": "mixer",
    "CoffeeSolveInfo": "mixer",
    "CoffeeCausalLMOutput": "modeling_coffee",
    "CoffeeForCausalLM": "modeling_coffee",
    "CoffeeForImageClassification": "modeling_coffee",
    "CoffeeModel": "modeling_coffee",
    "CoffeeOutput": "modeling_coffee",
    "CoffeePreTrainedModel": "modeling_coffee",
    "LinearizedS6Mixer": "baselines",
    "S6Mixer": "baselines",
}

__all__ = ["CoffeeConfig", *_LAZY, "register_auto_config", "register_auto_models"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def register_auto_config() -> None:
    """``AutoConfig`` knows ``coffee`` (done when this package is imported)."""
    from transformers.models.auto.configuration_auto import AutoConfig

    AutoConfig.register(CoffeeConfig.model_type, CoffeeConfig, exist_ok=True)


def register_auto_models() -> None:
    """``AutoModel`` / ``AutoModelForCausalLM`` / ``AutoModelForImageClassification`` build COFFEE models from a
    ``CoffeeConfig`` (done when :mod:`.modeling_coffee` is imported)."""
    importlib.import_module(f"{__name__}.modeling_coffee")._register_auto_models()


register_auto_config()
