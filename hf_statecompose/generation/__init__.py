from .integration import (
    compose_for_batch,
    disable,
    enable,
    enabled,
    get_backend,
    is_enabled,
    set_backend,
    using_backend,
)

__all__ = [
    "compose_for_batch",
    "disable",
    "enable",
    "enabled",
    "get_backend",
    "is_enabled",
    "set_backend",
    "using_backend",
]
