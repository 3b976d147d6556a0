"""Shared helpers for the tests: tiny random models and comparisons."""
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

import hf_statecompose as hsc

VOCAB = 99


def tiny_model(arch: str, seed: int = 0, layers: int = 2, conv_kernel: int = 4, dtype=torch.float32, **overrides):
    """A tiny random model (hidden 32, vocab 99), in eval mode, enabled for past_states."""
    torch.manual_seed(seed)
    if arch == "mamba":
        config = MambaConfig(
            vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=layers, expand=2,
            conv_kernel=conv_kernel, pad_token_id=0, eos_token_id=1, bos_token_id=2, **overrides,
        )
        model = MambaForCausalLM(config)
    else:
        config = Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=layers, expand=2, num_heads=8,
            head_dim=8, n_groups=2, chunk_size=16, conv_kernel=conv_kernel, pad_token_id=0, eos_token_id=1,
            bos_token_id=2, **overrides,
        )
        model = Mamba2ForCausalLM(config)
    return hsc.enable(model.to(dtype).eval())


def random_ids(length: int, batch: int = 1, generator=None):
    # ids 3.. avoid pad (0), eos (1), bos (2)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


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
