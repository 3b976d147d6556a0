"""Tiny random hybrid models (Mamba layers + attention layers) for the state-file and store tests."""

import json

import torch
from safetensors.torch import load_file, save
from transformers import AutoConfig, AutoModelForCausalLM

import hf_statecompose as hsc
from hf_statecompose.state.serialization import _digest

from helpers import VOCAB

SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
# tiny configs of every supported hybrid
CONFIGS = {
    "bamba": dict(
        num_hidden_layers=3,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
    ),
    "granitemoehybrid": dict(
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        num_local_experts=0,
        shared_intermediate_size=48,
        position_embedding_type="rope",
    ),
    "nemotron_h": dict(
        num_hidden_layers=4,
        hybrid_override_pattern="M*-M",
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=1,
        chunk_size=16,
    ),
    # layers 1 and 3 are hybrid layers ("both": a shared attention block and a Mamba layer)
    "zamba2": dict(
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        n_mamba_heads=4,
        mamba_d_state=8,
        mamba_ngroups=1,
        chunk_size=16,
        num_mem_blocks=1,
        attention_head_dim=16,
    ),
    "falcon_h1": dict(
        num_hidden_layers=2,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_d_state=8,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        head_dim=8,
    ),
    "jamba": dict(
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    ),
}
WORKING = ("nemotron_h", "granitemoehybrid", "bamba")


def hybrid_params():
    """pytest params: every supported hybrid (Zamba2 and Falcon-H1 have layers with both parts)."""
    return list(WORKING) + ["zamba2", "jamba", "falcon_h1"]


def tiny_hybrid(arch: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random hybrid model (hidden 32, vocab 99), in eval mode, enabled for past_states."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **{**SMALL, **CONFIGS[arch], **overrides})
    return hsc.enable(AutoModelForCausalLM.from_config(config).to(dtype).eval())


def craft(source, target, edit):
    """Rewrite state file ``source`` as ``target`` after ``edit(tensors, meta)`` (in place on a dict of tensors and
    the metadata dict), with a fresh digest: a hand-made file that only the schema checks can refuse."""
    from safetensors import safe_open

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
