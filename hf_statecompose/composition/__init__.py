from ..ops.compose.weights import caso_weights, picaso_r_weights, picaso_s_weights, soup_weights
from .composer import METHODS, MODEL_BASED_METHODS, MODEL_FREE_METHODS, StateComposer, compose_states

__all__ = [
    "METHODS",
    "MODEL_BASED_METHODS",
    "MODEL_FREE_METHODS",
    "StateComposer",
    "caso_weights",
    "compose_states",
    "picaso_r_weights",
    "picaso_s_weights",
    "soup_weights",
]
