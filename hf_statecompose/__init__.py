"""hf_statecompose: start Mamba / Mamba-2 generation from a composition of precomputed context states."""
from .state import ComposableMambaCache, model_fingerprint
from .models import encode
from .composition import METHODS, StateComposer, compose_states
from .generation import disable, enable, get_backend, is_enabled, set_backend
from .attribution import Attribution, leave_one_out
from .pipeline import RetrievalGeneration, continuation_losses, generate_with_retrieval
from .store import StateStore, StoreEntry
from .training import CompositionExample, composition_loss
from .demo import load_demo

__version__ = "0.1.0"


def _register_lm_eval_model() -> None:
    """Register the lm-eval model ``statecompose`` (a lazy placeholder: lm-eval's HFLM and our
    :mod:`hf_statecompose.lmeval.model` are imported only when lm-eval asks for the model)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        return
    try:
        from .lmeval import register

        register()
    except Exception as error:  # a broken lm-eval must not break this package
        import logging

        logging.getLogger("hf_statecompose").warning("could not register the lm-eval model 'statecompose': %r", error)


_register_lm_eval_model()

__all__ = [
    "Attribution",
    "CompositionExample",
    "METHODS",
    "RetrievalGeneration",
    "StateStore",
    "StoreEntry",
    "composition_loss",
    "continuation_losses",
    "generate_with_retrieval",
    "leave_one_out",
    "load_demo",
    "ComposableMambaCache",
    "StateComposer",
    "compose_states",
    "disable",
    "enable",
    "encode",
    "get_backend",
    "is_enabled",
    "model_fingerprint",
    "set_backend",
]
