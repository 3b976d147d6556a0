"""Running models on states: the per-architecture mixer paths, the state-aware mixer classes, the kernel
choice per model, and :func:`encode`."""
from ..state.cache import ComposableMambaCache
from .encode import encode
from .mamba import mamba_mixer_forward
from .mamba2 import mamba2_mixer_forward
from .mixers import disable_state_path, enable_state_path, get_backend, set_backend, using_backend

# ComposableMambaCache.encode (data layer) runs models through this layer's encoder
ComposableMambaCache._encoder = staticmethod(encode)

__all__ = [
    "disable_state_path",
    "enable_state_path",
    "encode",
    "get_backend",
    "mamba2_mixer_forward",
    "mamba_mixer_forward",
    "set_backend",
    "using_backend",
]
