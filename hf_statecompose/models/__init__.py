"""Per-architecture mixer forwards that run on a ComposableMambaCache."""
from .mamba import mamba_mixer_forward
from .mamba2 import mamba2_mixer_forward

__all__ = ["mamba_mixer_forward", "mamba2_mixer_forward"]
