"""hf_statecompose: start Mamba / Mamba-2 generation from a composition of precomputed context states."""
from .cache import ComposableMambaCache, model_fingerprint
from .composition import METHODS, StateComposer, compose_states
from .generation import disable, enable, get_backend, is_enabled, set_backend

__version__ = "0.1.0"

__all__ = [
    "METHODS",
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
