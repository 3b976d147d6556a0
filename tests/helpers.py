"""Shared helpers for the tests: tiny random models and comparisons."""

import torch
from transformers import (
    FalconMambaConfig,
    FalconMambaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)

import hf_statecompose as hsc

VOCAB = 99


def tiny_model(arch: str, seed: int = 0, layers: int = 2, conv_kernel: int = 4, dtype=torch.float32, **overrides):
    """A tiny random model (hidden 32, vocab 99), in eval mode, enabled for past_states."""
    torch.manual_seed(seed)
    if arch in ("mamba", "falcon_mamba"):
        config_class, model_class = (
            (MambaConfig, MambaForCausalLM) if arch == "mamba" else (FalconMambaConfig, FalconMambaForCausalLM)
        )
        config = config_class(
            **{
                **dict(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    state_size=8,
                    num_hidden_layers=layers,
                    expand=2,
                    conv_kernel=conv_kernel,
                    pad_token_id=0,
                    eos_token_id=1,
                    bos_token_id=2,
                ),
                **overrides,
            }
        )
        model = model_class(config)
    else:
        config = Mamba2Config(
            **{
                **dict(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    state_size=8,
                    num_hidden_layers=layers,
                    expand=2,
                    num_heads=8,
                    head_dim=8,
                    n_groups=2,
                    chunk_size=16,
                    conv_kernel=conv_kernel,
                    pad_token_id=0,
                    eos_token_id=1,
                    bos_token_id=2,
                ),
                **overrides,
            }
        )
        model = Mamba2ForCausalLM(config)
    return hsc.enable(model.to(dtype).eval())


def random_ids(length: int, batch: int = 1, generator=None):
    # ids 3.. avoid pad (0), eos (1), bos (2)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def craft(source, target, edit):
    """Rewrite state file ``source`` as ``target`` after ``edit(tensors, meta)`` (in place on a dict of tensors and
    the metadata dict), with a fresh digest: a hand-made file that only the schema checks can refuse."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save

    from hf_statecompose.state.serialization import _digest

    tensors = load_file(source)
    with safe_open(source, framework="pt") as handle:
        meta = json.loads(handle.metadata()["hf_statecompose"])
    edit(tensors, meta)
    meta["tensor_digest"] = _digest(tensors)
    with open(target, "wb") as handle:
        handle.write(
            save(
                {k: v.contiguous().clone() for k, v in tensors.items()}, metadata={"hf_statecompose": json.dumps(meta)}
            )
        )
    return target


def compile_without_gpu(script: str, marker: str = "compiled", timeout: int = 300) -> str:
    """Run a Triton compile-only script in a subprocess without the interpreter (ptxas from the Triton wheel).

    The interpreter accepts code the compiler rejects, so the kernel tests also compile for a GPU."""
    import os
    import subprocess
    import sys

    import pytest
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton ships no ptxas here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0 and marker in done.stdout, done.stderr[-3000:]
    return done.stdout


# ------------------------------------------------------------------------------------------ pickle round trips
# The standard asks models and states to survive copy.deepcopy, pickle and torch.save. The tests load those
# bytes back through this restricted unpickler, never a bare pickle.loads / torch.load(weights_only=False):
# it resolves only classes of torch / transformers / this package and the few functions the round trips of
# these objects reference (listed below), and refuses every other global (os.system, builtins.eval, ...).
import io as _io
import pickle as _pickle
import types as _types

_TRUSTED_PACKAGES = ("torch", "transformers", "hf_statecompose")
_TRUSTED_FUNCTIONS = {
    ("builtins", "set"),
    ("__builtin__", "set"),
    ("collections", "OrderedDict"),
    ("_codecs", "encode"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
    ("hf_statecompose.generation.integration", "_new_enabled_model"),
    ("hf_statecompose.models.mixers", "_new_state_aware_mixer"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch._C._nn", "gelu"),
}


# transformers' kernel-aware layers (`use_kernelized_func`: the Mamba / Mamba-2 / GDN mixers from 5.24) give each
# instance private `kernels` wrappers, which pickle as kernels' `_rebuild_kernel_func(module, name)`, and a model
# that `from_pretrained` kernelized keeps its kernels `Mode`; the module path is `kernels.layer` in 0.18 and
# `kernels._internals.layer` in 0.19. Those two names only, and the rebuild only for a transformers module (it
# imports the module it is given)
_KERNELS_MODE = {("kernels.layer.mode", "Mode"), ("kernels._internals.layer.mode", "Mode")}
_KERNELS_REBUILD = {
    ("kernels.layer.layer", "_rebuild_kernel_func"),
    ("kernels._internals.layer.layer", "_rebuild_kernel_func"),
}


def _kernels_rebuild_of_transformers(rebuild):
    def rebuild_transformers_func(module_name, func_name):
        if module_name.split(".")[0] != "transformers":
            raise _pickle.UnpicklingError(
                f"refusing kernels' rebuild of {module_name}.{func_name} in a test round trip"
            )
        return rebuild(module_name, func_name)

    return rebuild_transformers_func


def _attribute_of_trusted(obj, name):
    """``getattr`` as pickled bound methods use it (enabled stock models), limited to non-dunder attributes of
    objects whose class comes from a trusted package (never a module, never ``__globals__`` and the like)."""
    owner = obj if isinstance(obj, type) else type(obj)
    if name.startswith("__") or owner.__module__.split(".")[0] not in _TRUSTED_PACKAGES:
        raise _pickle.UnpicklingError(f"refusing getattr({owner.__name__}, {name!r}) in a test round trip")
    return getattr(obj, name)


class TrustedUnpickler(_pickle.Unpickler):
    def find_class(self, module, name):
        if module in ("builtins", "__builtin__") and name == "getattr":
            return _attribute_of_trusted
        found = super().find_class(module, name)
        if (module, name) in _TRUSTED_FUNCTIONS or (module, name) in _KERNELS_MODE:
            return found
        if (module, name) in _KERNELS_REBUILD:
            return _kernels_rebuild_of_transformers(found)
        trusted_package = module.split(".")[0] in _TRUSTED_PACKAGES
        if trusted_package and (isinstance(found, (type, torch.dtype))):
            return found
        raise _pickle.UnpicklingError(f"refusing to load {module}.{name} in a test round trip")


_TRUSTED_PICKLE = _types.SimpleNamespace(
    Unpickler=TrustedUnpickler, __name__="trusted_pickle", load=lambda f, **kw: TrustedUnpickler(f, **kw).load()
)


def trusted_loads(data: bytes):
    """``pickle.loads`` through :class:`TrustedUnpickler`."""
    return TrustedUnpickler(_io.BytesIO(data)).load()


def pickle_round_trip(obj):
    return trusted_loads(_pickle.dumps(obj))


def torch_save_round_trip(obj):
    """``torch.save`` then ``torch.load`` through :class:`TrustedUnpickler`."""
    buffer = _io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, pickle_module=_TRUSTED_PICKLE)


def load_saved(buffer):
    """``torch.load`` of a buffer this test ``torch.save``-d, through :class:`TrustedUnpickler`."""
    return torch.load(buffer, pickle_module=_TRUSTED_PICKLE)


def save_tiny_finetune_base(folder) -> None:
    """A tiny random Mamba-2 with the demo tokenizer saved in ``folder``: the base model of the fine-tuning
    recipe's fast tests (``--set model=<folder>``)."""
    from transformers import AutoTokenizer, Mamba2Config, Mamba2ForCausalLM

    from hf_statecompose.demo import DEMO_DIR

    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "mamba2")
    torch.manual_seed(0)
    config = Mamba2Config(
        vocab_size=len(tok),
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        num_heads=8,
        head_dim=8,
        n_groups=1,
        chunk_size=16,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )
    Mamba2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def load_recipe(name: str):
    """``recipes/<name>.py`` imported as a module (the recipes are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
