from .cache import ComposableMambaCache
from .fingerprint import model_fingerprint

__all__ = ["ComposableMambaCache", "model_fingerprint"]
