from .cache import ComposableMambaCache
from .fingerprint import model_fingerprint, refresh_fingerprint
from .serpent_cache import ComposableSeRpEntCache

__all__ = ["ComposableMambaCache", "ComposableSeRpEntCache", "model_fingerprint", "refresh_fingerprint"]
