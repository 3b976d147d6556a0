from .integration import compose_for_batch, disable, enable, is_enabled

__all__ = ["compose_for_batch", "disable", "enable", "is_enabled"]
