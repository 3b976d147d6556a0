from .composer import METHODS, StateComposer, compose_states
from .weights import caso_weights, picaso_r_weights, picaso_s_weights, soup_weights

__all__ = [
    "METHODS",
    "StateComposer",
    "caso_weights",
    "compose_states",
    "picaso_r_weights",
    "picaso_s_weights",
    "soup_weights",
]
