"""hf_statecompose: start Mamba / Mamba-2 generation from a composition of precomputed context states."""
from .cache import ComposableMambaCache, model_fingerprint
from .composition import METHODS, StateComposer, compose_states
from .generation import disable, enable, get_backend, is_enabled, set_backend
from .attribution import Attribution, leave_one_out
from .pipeline import RetrievalGeneration, continuation_losses, generate_with_retrieval, load_demo
from .store import StateStore, StoreEntry

__version__ = "0.1.0"

__all__ = [
    "Attribution",
    "METHODS",
    "RetrievalGeneration",
    "StateStore",
    "StoreEntry",
    "continuation_losses",
    "generate_with_retrieval",
    "leave_one_out",
    "load_demo",
    "ComposableMambaCache",
    "StateComposer",
    "compose_states",
    "disable",
    "enable",
    "get_backend",
    "is_enabled",
    "model_fingerprint",
    "set_backend",
]
