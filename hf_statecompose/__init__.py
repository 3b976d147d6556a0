"""hf_statecompose: start Mamba / Mamba-2 generation from a composition of precomputed context states.

Importing the package is light (no torch): the public names below are imported on first use
(PEP 562), so ``hf-statecompose --help`` answers at once. The import only sets up two hooks, each
run when (and if) the module it needs is imported by anyone:

* lm-eval's model registry gets the model ``statecompose`` (when ``lm_eval.api.registry`` is imported);
* the stock ``forward`` and ``generate`` of the transformers models in the architecture table
  (:mod:`hf_statecompose.state.architectures`) refuse ``past_states=`` with a
  ``ValueError`` naming :func:`enable` (a model that was never enabled would silently ignore them);
* transformers' ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` learn the SeRpEnt-Mamba model
  (``model_type = "serpent_mamba"``) and the COFFEE models (``model_type = "coffee"``, also with
  ``AutoModelForImageClassification``) when transformers imports them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _guard, compat
from .state import architectures as _architectures

if TYPE_CHECKING:  # what the lazy names below are, for type checkers (at run time, __getattr__ imports them)
    from .attribution import Attribution, leave_one_out
    from .composition import METHODS, StateComposer, compose_states
    from .demo import load_demo
    from .distributed import encode_corpus
    from .generation import disable, enable, enabled, get_backend, is_enabled, set_backend
    from .models import (
        CoffeeConfig,
        CoffeeForCausalLM,
        CoffeeForImageClassification,
        CoffeeModel,
        SeRpEntMambaConfig,
        SeRpEntMambaForCausalLM,
        SeRpEntMambaModel,
    )
    from .models.coffee import CoffeeMixer
    from .models.encode import encode
    from .ops import use_kernel
    from .pipeline import RetrievalGeneration, continuation_losses, generate_with_retrieval
    from .state import ComposableMambaCache, ComposableSeRpEntCache, model_fingerprint, refresh_fingerprint
    from .store import StateStore, StoreEntry
    from .training import CompositionExample, composition_loss

__version__ = "0.2.0"

# public name -> the subpackage that defines it
_EXPORTS = {
    "ComposableMambaCache": "state",
    "ComposableSeRpEntCache": "state",
    "model_fingerprint": "state",
    "refresh_fingerprint": "state",
    "encode": "models",
    "SeRpEntMambaConfig": "models",
    "SeRpEntMambaModel": "models",
    "SeRpEntMambaForCausalLM": "models",
    "CoffeeMixer": "models.coffee",
    "CoffeeConfig": "models",
    "CoffeeModel": "models",
    "CoffeeForCausalLM": "models",
    "CoffeeForImageClassification": "models",
    "METHODS": "composition",
    "StateComposer": "composition",
    "compose_states": "composition",
    "disable": "generation",
    "enable": "generation",
    "enabled": "generation",
    "get_backend": "generation",
    "is_enabled": "generation",
    "set_backend": "generation",
    "Attribution": "attribution",
    "leave_one_out": "attribution",
    "RetrievalGeneration": "pipeline",
    "continuation_losses": "pipeline",
    "generate_with_retrieval": "pipeline",
    "StateStore": "store",
    "StoreEntry": "store",
    "CompositionExample": "training",
    "composition_loss": "training",
    "load_demo": "demo",
    "encode_corpus": "distributed",
    "use_kernel": "ops",
}
_SUBPACKAGES = (
    "attribution",
    "benchmarking",
    "cli",
    "compat",
    "composition",
    "demo",
    "distributed",
    "generation",
    "lmeval",
    "models",
    "ops",
    "pipeline",
    "retrieval",
    "state",
    "store",
    "training",
)

__all__ = [
    "METHODS",
    "Attribution",
    "CoffeeConfig",
    "CoffeeForCausalLM",
    "CoffeeForImageClassification",
    "CoffeeMixer",
    "CoffeeModel",
    "ComposableMambaCache",
    "ComposableSeRpEntCache",
    "CompositionExample",
    "RetrievalGeneration",
    "SeRpEntMambaConfig",
    "SeRpEntMambaForCausalLM",
    "SeRpEntMambaModel",
    "StateComposer",
    "StateStore",
    "StoreEntry",
    "compose_states",
    "composition_loss",
    "continuation_losses",
    "disable",
    "enable",
    "enabled",
    "encode",
    "encode_corpus",
    "generate_with_retrieval",
    "get_backend",
    "is_enabled",
    "leave_one_out",
    "load_demo",
    "model_fingerprint",
    "refresh_fingerprint",
    "set_backend",
    "use_kernel",
]


def __getattr__(name: str):
    if name in _EXPORTS:
        _install_encoder()  # also done by the hook below; here in case that hook could not run
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBPACKAGES))


def _register_lm_eval_model(_module=None) -> None:
    """Register the lm-eval model ``statecompose`` (a lazy placeholder: lm-eval's HFLM and our
    :mod:`hf_statecompose.lmeval.model` are imported only when lm-eval asks for the model)."""
    try:
        from .lmeval import register

        register()
    except Exception as error:  # a broken lm-eval must not break this package
        import logging

        logging.getLogger("hf_statecompose").warning("could not register the lm-eval model 'statecompose': %r", error)


def _install_encoder(_module=None) -> None:
    """``ComposableMambaCache.encode`` runs through the models layer, which the data layer cannot import:
    load it as soon as the cache is, however it was reached (``from hf_statecompose.state import ...``).
    Safe at that point: models imports only ops and state, never a layer that may be half-imported."""
    importlib.import_module(f"{__name__}.models")


def _register_serpent_config(_module=None) -> None:
    """``AutoConfig`` learns ``serpent_mamba`` as soon as transformers has it: the SeRpEnt package registers its
    config when imported. This may run while transformers is half way through importing its modeling
    code, so that package's import stays clear of that code (and if the package is itself half imported,
    it registers when it finishes)."""
    importlib.import_module(f"{__name__}.models.serpent")


def _register_serpent_models(_module=None) -> None:
    """``AutoModel`` / ``AutoModelForCausalLM`` learn the SeRpEnt-Mamba classes as soon as transformers has
    them: the modeling module registers its classes when imported."""
    importlib.import_module(f"{__name__}.models.serpent.modeling_serpent")


def _register_coffee_config(_module=None) -> None:
    """``AutoConfig`` learns ``coffee`` as soon as transformers has it (as :func:`_register_serpent_config`)."""
    importlib.import_module(f"{__name__}.models.coffee")


def _register_coffee_models(_module=None) -> None:
    """``AutoModel`` / ``AutoModelForCausalLM`` / ``AutoModelForImageClassification`` learn the COFFEE classes as
    soon as transformers has them: the modeling module registers its classes when imported."""
    importlib.import_module(f"{__name__}.models.coffee.modeling_coffee")


compat.warn_if_untested()  # once, if the installed transformers is outside the tested range
# the classes the architecture table names (no torch imported), each guard inside transformers' deprecation wrappers
_guard.install(_architectures.guarded_classes(), wrap=compat.wrap_inside_deprecations)
_guard.when_imported("lm_eval.api.registry", _register_lm_eval_model)
_guard.when_imported(f"{__name__}.state.cache", _install_encoder)
_guard.when_imported("transformers.models.auto.configuration_auto", _register_serpent_config)
_guard.when_imported("transformers.models.auto.modeling_auto", _register_serpent_models)
_guard.when_imported("transformers.models.auto.configuration_auto", _register_coffee_config)
_guard.when_imported("transformers.models.auto.modeling_auto", _register_coffee_models)
