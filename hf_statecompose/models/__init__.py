"""Running models on states: the per-architecture mixer paths, the state-aware mixer classes, the kernel
choice per model, :func:`encode`, the SeRpEnt-Mamba model (:mod:`.serpent`) and the COFFEE models (:mod:`.coffee`).

The names are imported on first use (PEP 562). Importing this package itself stays light (torch and
transformers' cache classes, no transformers modeling code) because it is the parent of the SeRpEnt
config, which transformers' post-import hook for ``AutoConfig`` imports, possibly while transformers is
half way through importing its own modeling modules (``hf_statecompose/__init__.py``).
"""

import importlib
from typing import TYPE_CHECKING

from ..state.cache import ComposableMambaCache

# the names of _EXPORTS as type checkers see them (at run time, __getattr__ imports them on first use)
if TYPE_CHECKING:
    from .coffee import CoffeeConfig, CoffeeForCausalLM, CoffeeForImageClassification, CoffeeModel  # noqa: F401
    from .encode import encode  # noqa: F401
    from .mamba import mamba_mixer_forward  # noqa: F401
    from .mamba2 import mamba2_mixer_forward  # noqa: F401
    from .mixers import disable_state_path, enable_state_path, get_backend, set_backend, using_backend  # noqa: F401
    from .serpent import SeRpEntMambaConfig, SeRpEntMambaForCausalLM, SeRpEntMambaModel  # noqa: F401

# public name -> the submodule that defines it
_EXPORTS = {
    "encode": "encode",
    "mamba_mixer_forward": "mamba",
    "mamba2_mixer_forward": "mamba2",
    "disable_state_path": "mixers",
    "enable_state_path": "mixers",
    "get_backend": "mixers",
    "set_backend": "mixers",
    "using_backend": "mixers",
    "SeRpEntMambaConfig": "serpent",
    "SeRpEntMambaModel": "serpent",
    "SeRpEntMambaForCausalLM": "serpent",
    "CoffeeConfig": "coffee",
    "CoffeeModel": "coffee",
    "CoffeeForCausalLM": "coffee",
    "CoffeeForImageClassification": "coffee",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    # (importing the submodule `encode` bound the module to this name: the function replaces it)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _encode(model, input_ids, attention_mask=None, backend=None, enable_grad=False):
    """:func:`hf_statecompose.models.encode.encode`, imported on the first call."""
    return __getattr__("encode")(
        model, input_ids, attention_mask=attention_mask, backend=backend, enable_grad=enable_grad
    )


# ComposableMambaCache.encode (data layer) runs models through this layer's encoder
ComposableMambaCache._encoder = staticmethod(_encode)
