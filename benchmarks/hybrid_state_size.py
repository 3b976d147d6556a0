"""Bytes of a hybrid model's state, on paper: the fixed part (SSM states, conv windows, ΣΔ, A) and the part that
grows with the context (keys and values of the attention layers), for the real checkpoints' configs.

    python benchmarks/hybrid_state_size.py [--out benchmarks/results/hybrid_state_size.json]

No download and no model: each checkpoint's config.json values (the ones a state's shapes depend on) are
written below with where they came from, put in a ``types.SimpleNamespace``, and read by the package's own
shape functions (``ARCHITECTURES[model_type]``: ``layer_kinds``, ``state_shapes``, ``decay_shapes``,
``attention_shape``), so the figures are what ``ComposableHybridCache`` holds for one context (batch 1):

* per SSM layer: the SSM state (float32), the conv window ``[C, K]`` (the model dtype), ΣΔ and ``A`` (float32), and
  for the delta-rule hybrids (Qwen3.5, Qwen3-Next, Kimi Linear) the context's transition ``[heads, k, k]`` (float32);
* per context token: keys and values ``[kv heads, head dim]`` per attention layer (the model dtype) and one
  int64 position (``positions`` ``[B, L]``, one tensor shared by the attention layers); a state that keeps its
  ``token_ids`` (for the concat baselines) holds 8 more bytes per token, not counted here.

For a bf16 model and a float32 model (keys / values and conv windows follow the model dtype; the SSM state,
ΣΔ and A are float32 in both), next to a pure Mamba-2 (mamba2-2.7b), whose state does not grow. The
"crossover" is the context length at which the attention part equals the fixed SSM part. Prints a markdown
table and writes benchmarks/results/hybrid_state_size.json.
"""

from pathlib import Path

HERE = Path(__file__).resolve().parent


import argparse
import math
from types import SimpleNamespace

import torch

from hf_statecompose.benchmarking import git_commit, write_result
from hf_statecompose.state.architectures import ARCHITECTURES

POSITION_BYTES = 8  # int64 position per key slot, shared by the attention layers

# The config.json values a state's shapes depend on (the rest of each config does not change a byte).
CONFIGS = {
    # ibm-granite/granite-4.0-h-tiny, https://huggingface.co/ibm-granite/granite-4.0-h-tiny/blob/main/config.json
    # (7B MoE, 1B active): hidden 1536, 40 layers, 4 attention layers (5, 15, 25, 35) of 12 query / 4 kv heads of
    # 1536 / 12 = 128, Mamba-2 layers of 48 heads x 64, state 128, 1 group, conv 4. Values as quoted from that
    # config in public test fixtures (e.g. GRANITE_H_TINY_HF of a hardware-model repository's hf_to_config tests).
    # Granite 4.0-H's attention has no positional encoding (NoPE): it changes no byte here.
    "Granite-4.0-H-Tiny": (
        "granitemoehybrid",
        dict(
            hidden_size=1536,
            num_hidden_layers=40,
            num_attention_heads=12,
            num_key_value_heads=4,
            mamba_n_heads=48,
            mamba_d_head=64,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
            layer_types=["mamba"] * 5
            + ["attention"]
            + ["mamba"] * 9
            + ["attention"]
            + ["mamba"] * 9
            + ["attention"]
            + ["mamba"] * 9
            + ["attention"]
            + ["mamba"] * 4,
            position_embedding_type="nope",
        ),
    ),
    # nvidia/Nemotron-H-8B-Base-8K, https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K/blob/main/config.json:
    # hidden 4096, 52 layers, hybrid_override_pattern with 24 Mamba-2 (M), 24 MLP (-) and 4 attention (*) layers;
    # attention 32 query / 8 kv heads of 128, no RoPE; Mamba-2 128 heads x 64, ssm_state_size 128, n_groups 8,
    # conv_kernel 4, expand 2 (Nemotron-H paper, arXiv:2504.03624, and the config's fields as quoted in public
    # write-ups). The pattern string below is Nemotron-H-4B's published one (52 layers, pruned from the 8B in
    # width only, Megatron-Bridge's Nemotron-H docs): only the counts of M / * matter for the bytes.
    "Nemotron-H-8B": (
        "nemotron_h",
        dict(
            hidden_size=4096,
            num_hidden_layers=52,
            num_attention_heads=32,
            num_key_value_heads=8,
            mamba_num_heads=128,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            conv_kernel=4,
            expand=2,
            hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        ),
    ),
    # tiiuae/Falcon-H1-7B-Base, https://huggingface.co/tiiuae/Falcon-H1-7B-Base/blob/main/config.json: hidden 3072,
    # 44 layers, every layer both attention (12 query / 2 kv heads, head_dim 128, RoPE) and a Mamba-2 mixer in
    # parallel (mamba_d_ssm 3072 = 24 heads x 128, mamba_d_state 256, 1 group, conv 4); Falcon-H1 report
    # (arXiv:2507.22448) table of architectures, and the config as quoted in public test fixtures (FALCON_H1_7B_HF).
    "Falcon-H1-7B": (
        "falcon_h1",
        dict(
            hidden_size=3072,
            num_hidden_layers=44,
            num_attention_heads=12,
            num_key_value_heads=2,
            head_dim=128,
            mamba_n_heads=24,
            mamba_d_head=128,
            mamba_d_ssm=3072,
            mamba_d_state=256,
            mamba_n_groups=1,
            mamba_d_conv=4,
            mamba_expand=2,
        ),
    ),
    # ai21labs/AI21-Jamba-1.5-Mini, https://huggingface.co/ai21labs/AI21-Jamba-1.5-Mini/blob/main/config.json:
    # hidden 4096, 32 layers, attention every 8 layers from 4 (attn_layer_period 8, attn_layer_offset 4: layers
    # 4, 12, 20, 28) of 32 query / 8 kv heads of 128, no positional encoding; Mamba-1 mixers with mamba_expand 2
    # (D = 8192), mamba_d_state 16, mamba_d_conv 4 (Jamba-1.5 report, arXiv:2408.12570: the Jamba-v0.1 layout).
    "Jamba-1.5-Mini": (
        "jamba",
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            attn_layer_period=8,
            attn_layer_offset=4,
            mamba_expand=2,
            mamba_d_state=16,
            mamba_d_conv=4,
        ),
    ),
    # Qwen/Qwen3.5-27B (the text model of its config, model_type qwen3_5_text): hidden 5120, 64 layers in 16 blocks of
    # 3 gated DeltaNet layers + 1 full attention layer; GDN 48 value heads over 16 key heads (each key head serves
    # three value heads), key and value head dims 128, conv 4; attention 24 query / 4 kv heads of 256, partial RoPE
    # 0.25. Values as quoted from the config in public write-ups of the model (model cards of quantized copies and
    # architecture notes); the value head dim 128 is Qwen3-Next's and Qwen3.5's default.
    "Qwen3.5-27B": (
        "qwen3_5_text",
        dict(
            hidden_size=5120,
            num_hidden_layers=64,
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_value_heads=48,
            linear_num_key_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
        ),
    ),
    # Qwen/Qwen3-Next-80B-A3B: transformers' Qwen3NextConfig defaults are this checkpoint's (hidden 2048, 48 layers,
    # 3 GDN + 1 attention per block; GDN 32 value / 16 key heads of 128, conv 4; attention 16 query / 2 kv heads of
    # 256, partial RoPE 0.25; the MoE part does not shape the state).
    "Qwen3-Next-80B-A3B": (
        "qwen3_next",
        dict(
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_value_heads=32,
            linear_num_key_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12,
        ),
    ),
    # moonshotai/Kimi-Linear-48B-A3B (transformers' KimiLinearConfig defaults): hidden 2304, 27 layers, Kimi delta
    # attention in 21 linear_attention layers (32 heads, head dim 128 for q, k and v, conv 4 on q, k and v; a decay per
    # key channel, so ΣΔ is [32, 128]), MLA without positional encoding in the other 6 (layers 4, 8, ..., 24), whose
    # cache holds per token the compressed latent (kv_lora_rank 512) as the keys and the rotary key part (64) as the
    # values, one "head" each.
    "Kimi-Linear-48B-A3B": (
        "kimi_linear",
        dict(
            hidden_size=2304,
            num_hidden_layers=27,
            linear_num_heads=32,
            linear_head_dim=128,
            linear_conv_kernel_dim=4,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            layer_types=["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(27)],
        ),
    ),
    # state-spaces/mamba2-2.7b, https://huggingface.co/state-spaces/mamba2-2.7b/blob/main/config.json: d_model 2560,
    # n_layer 64, Mamba-2 defaults of mamba_ssm (d_state 128, headdim 64, expand 2 -> 80 heads, ngroups 1,
    # d_conv 4); in transformers' Mamba2Config names. No attention: the state does not grow with the context.
    "mamba2-2.7b (pure Mamba-2)": (
        "mamba2",
        dict(
            hidden_size=2560,
            num_hidden_layers=64,
            num_heads=80,
            head_dim=64,
            state_size=128,
            n_groups=1,
            conv_kernel=4,
            expand=2,
        ),
    ),
}


def _nemotron_block_types(pattern: str) -> list:
    """transformers' NemotronHConfig reads ``hybrid_override_pattern`` into ``layers_block_type``."""
    return [{"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}[c] for c in pattern]


def config_of(values: dict) -> SimpleNamespace:
    values = dict(values)
    if "hybrid_override_pattern" in values:
        values["layers_block_type"] = _nemotron_block_types(values["hybrid_override_pattern"])
    return SimpleNamespace(**values)


def state_bytes(model_type: str, config, model_dtype: torch.dtype) -> dict:
    """The bytes of a batch-1 state of this architecture and config as ``ComposableHybridCache`` (or, for pure
    SSM models, ``ComposableMambaCache``) holds it: ``fixed`` (SSM layers, with their parts) and ``per_token``
    (keys, values and the shared position), from the package's own shape functions."""
    layout = ARCHITECTURES[model_type]
    element = torch.empty((), dtype=model_dtype).element_size()
    f32 = 4
    (ssm_shape, conv_shape), (delta_shape, A_shape) = layout.state_shapes(config), layout.decay_shapes(config)
    ssm_layers = len(layout.ssm_layer_indices(config))
    attention_layers = len(layout.attention_layer_indices(config))
    parts = {
        "ssm_state": ssm_layers * math.prod(ssm_shape) * f32,
        "conv_window": ssm_layers * math.prod(conv_shape) * element,
        "delta_sum": ssm_layers * math.prod(delta_shape) * f32,
        "A": ssm_layers * math.prod(A_shape) * f32,
        # delta-rule layers: each context's transition M [heads, k, k] (float32 in a state; a bf16 store halves it)
        "transition": sum(
            ssm_layers * math.prod(extra.row_shape(config)) * f32 for extra in layout.extras if extra.stored_like_state
        ),
    }
    kv_heads, key_dim, value_dim = layout.attention_dims(config) if attention_layers else (0, 0, 0)
    kv_per_token = attention_layers * kv_heads * (key_dim + value_dim) * element
    per_token = kv_per_token + (POSITION_BYTES if attention_layers else 0)
    fixed = sum(parts.values())
    return {
        "model_type": model_type,
        "dtype": str(model_dtype).replace("torch.", ""),
        "layers": len(layout.layer_kinds(config)) if layout.is_hybrid else layout.num_state_layers(config),
        "ssm_layers": ssm_layers,
        "attention_layers": attention_layers,
        "ssm_state_shape": list(ssm_shape),
        "conv_shape": list(conv_shape),
        "kv_shape": [kv_heads, key_dim, value_dim] if key_dim != value_dim else [kv_heads, key_dim],
        "fixed_bytes": fixed,
        "fixed_parts": parts,
        "kv_bytes_per_token": kv_per_token,
        "bytes_per_token": per_token,
        "crossover_tokens": (fixed / per_token) if per_token else None,
    }


def _mib(n) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="256,4096,32768", help="context lengths to show the total state at")
    parser.add_argument("--out", default=str(HERE / "results" / "hybrid_state_size.json"))
    parser.add_argument("--plot", action="store_true", help="then draw its figure into docs/img/ (benchmarks/_plot.py)")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.contexts.split(",") if n.strip()]
    rows = []
    for name, (model_type, values) in CONFIGS.items():
        config = config_of(values)
        for dtype in (torch.bfloat16, torch.float32):
            row = state_bytes(model_type, config, dtype)
            row["model"] = name
            row["config"] = values
            row["total_bytes_at"] = {n: row["fixed_bytes"] + n * row["bytes_per_token"] for n in lengths}
            rows.append(row)
    print(
        "One context's state (batch 1), as the package holds it; SSM state, ΣΔ, A in float32, conv windows and "
        "keys / values in the model dtype, + 8 B/token of positions (int64, shared by the attention layers)\n"
    )
    print(
        "| model | model dtype | layers (SSM / attention) | SSM state | transitions | conv | ΣΔ + A | fixed | per token (K+V+pos) | crossover (tokens) | "
        + " | ".join(f"total at {n}" for n in lengths)
        + " |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(lengths))
    for row in rows:
        p = row["fixed_parts"]
        cross = "never (no attention)" if row["crossover_tokens"] is None else f"{row['crossover_tokens']:,.0f}"
        per_token = "0" if not row["bytes_per_token"] else f"{row['bytes_per_token'] / 1024:.2f} KiB"
        print(
            f"| {row['model']} | {row['dtype']} | {row['layers']} ({row['ssm_layers']} / {row['attention_layers']}) | "
            f"{_mib(p['ssm_state'])} | {_mib(p['transition']) if p['transition'] else '-'} | {_mib(p['conv_window'])} | "
            f"{_mib(p['delta_sum'] + p['A'])} | "
            f"{_mib(row['fixed_bytes'])} | {per_token} | {cross} | "
            + " | ".join(_mib(row["total_bytes_at"][n]) for n in lengths)
            + " |"
        )
    write_result(
        {
            "rows": rows,
            "position_bytes_per_token": POSITION_BYTES,
            "contexts": lengths,
            "commit": git_commit(),
            "note": "on paper from config values (see the script's comments for sources); batch 1; "
            "token_ids (8 B/token, optional) not counted",
        },
        args.out,
    )
    if args.plot:
        from _plot import plot_docs

        plot_docs(args.out, "hybrid_state_size.json")


if __name__ == "__main__":
    main()
