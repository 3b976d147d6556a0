"""One table of every architecture the tests run: name -> tiny random model factory, tolerances, capability flags.

``ARCHITECTURES[name].make(seed=0, **overrides)`` gives a tiny random model of that architecture in eval mode,
enabled for ``past_states``, built so that a context changes its output (the contract tests check that first).
The hybrids' configs (``HYBRID_CONFIGS``) are shared by the exactness / composition tests (float64, perturbed
mixers: :func:`hybrid_model`) and the file / store tests (float32, stock init, vocab 99: :func:`tiny_hybrid`,
which adds the few config differences those tests were written with, ``STORE_FLAVOUR``)."""

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import hf_statecompose as hsc
from hf_statecompose.state.architectures import architecture, has_transitions

from helpers import VOCAB as STORE_VOCAB
from helpers import tiny_model

# ------------------------------------------------------------------------------------------ hybrids
VOCAB = 64
PAD, EOS, BOS = 0, 1, 2
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=BOS,
)
# one or two attention layers among Mamba layers (and MLP layers for NemotronH), small heads and states
HYBRID_CONFIGS = {
    "jamba": dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, num_experts=1, num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False),  # one expert: MLPs (float64 runs)
    "falcon_h1": dict(num_hidden_layers=2, mamba_n_heads=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=8,
                      mamba_n_groups=1, mamba_chunk_size=16, head_dim=8),
    "bamba": dict(num_hidden_layers=3, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                  mamba_n_groups=1, mamba_chunk_size=16),  # partial RoPE (partial_rotary_factor 0.5)
    "granitemoehybrid": dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4,
                             mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
                             num_local_experts=0, shared_intermediate_size=48, position_embedding_type=None),
    "nemotron_h": dict(num_hidden_layers=4, hybrid_override_pattern="M*-M", mamba_num_heads=4, mamba_head_dim=16,
                       ssm_state_size=8, n_groups=1, chunk_size=16),
    # layers 1 and 3 are hybrid layers ("both": a shared attention block and a Mamba layer)
    "zamba2": dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_headdim=8,
                   mamba_d_state=8, mamba_ngroups=1, chunk_size=16, num_mem_blocks=1, use_mem_rope=True,
                   attention_head_dim=16),
}  # fmt: skip
# the delta-rule hybrids (gated DeltaNet layers + one attention layer): 4 value heads on 2 key heads of 8 dims
_GDN = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, head_dim=8)  # fmt: skip
DELTA_RULE_CONFIGS = {
    "qwen3_5_text": _GDN,
    "qwen3_next": dict(_GDN, num_experts=0, mlp_only_layers=[]),  # dense MLPs (float64 runs)
    "olmo_hybrid": _GDN,
    # Kimi Linear: KDA layers (4 heads of 8, a decay per key channel) and one MLA attention layer (NoPE: the cache holds
    # a latent of 16 and a rotary part of 4); MLA expands keys to every query head (no key / value groups)
    "kimi_linear": dict(
        num_hidden_layers=4,
        layer_types=_GDN["layer_types"],
        mlp_layer_types=["dense"] * 4,
        linear_num_heads=4,
        linear_head_dim=8,
        linear_conv_kernel_dim=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        q_lora_rank=None,
    ),
}
# the config entry of a delta-rule hybrid's key head dim (what a "smaller state" halves)
DELTA_RULE_KEY_DIM = {"kimi_linear": "linear_head_dim"}
# Qwen3.5-MoE: its experts' grouped matmul has no float64 kernel, so it runs in float32 only (test_delta_rule_models.py)
DELTA_RULE_MOE = dict(_GDN, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16)  # fmt: skip
HYBRID_CONFIGS.update(DELTA_RULE_CONFIGS)
# what the file / store tests' hybrids differ in: vocab 99 (the character tokenizer's), two Jamba experts,
# GraniteMoeHybrid with RoPE, Zamba2 with 4 Mamba heads of the default size and no memory-block RoPE
STORE_FLAVOUR = {
    "jamba": dict(num_experts=2),
    "granitemoehybrid": dict(position_embedding_type="rope"),
    "zamba2": dict(n_mamba_heads=4, mamba_headdim=None, use_mem_rope=None),
}
WORKING = ("nemotron_h", "granitemoehybrid", "bamba")  # the hybrids every store backend is tested on
PENDING = ()  # hybrids whose state-aware mixer path is pending (xfail); Jamba's and Falcon-H1's landed (mix1)


def hybrid_params():
    """pytest params: every supported hybrid (Zamba2 and Falcon-H1 have layers with both parts)."""
    return list(WORKING) + ["zamba2", "jamba", "falcon_h1", *DELTA_RULE_CONFIGS]


def arch_params(names=tuple(HYBRID_CONFIGS)):
    """``names`` as pytest params, the architectures whose mixer path is pending marked xfail."""
    return [pytest.param(name, marks=pytest.mark.xfail(reason="mixer path pending", strict=False))
            if name in PENDING else name for name in names]  # fmt: skip


def hybrid_config(arch: str, **overrides):
    return AutoConfig.for_model(arch, **{**SMALL, **HYBRID_CONFIGS.get(arch, {}), **overrides})


def hybrid_model(arch: str, dtype=torch.float64, seed: int = 0, enable: bool = True, bare: bool = False, **overrides):
    """A tiny random ``arch`` model in eval mode (enabled for ``past_states`` unless ``enable=False``); ``bare``
    gives the backbone class (``AutoModel``). The SSM mixers' parameters are moved off their tidy init and the
    output head scaled up (random init gives near-uniform next-token distributions)."""
    torch.manual_seed(seed)
    config = hybrid_config(arch, **overrides)
    model = (AutoModel if bare else AutoModelForCausalLM).from_config(config).to(dtype).eval()
    with torch.no_grad():
        layout = architecture(arch)
        backbone = model if bare else model.model
        for block in backbone.layers:
            mixer = layout.mixer_of(block)
            for parameter in mixer.parameters() if mixer is not None else ():
                parameter.add_(torch.randn_like(parameter) * 0.1)
        if has_transitions(layout):
            # slow decays (A = exp(A_log) in [0.02, 0.2], not up to 16): the transitions then carry a context
            # across the next one (with the stock init a state forgets it within a few tokens, and every
            # composition is close to the last state)
            for v in range(layout.num_state_layers(config)):
                A_log = layout.A_log_of(backbone, v)
                A_log.copy_(torch.empty_like(A_log).uniform_(0.02, 0.2).log())
        if not bare:  # logits of a spread of about 2 (not 0.1): sampling then depends on them, not only on the seed
            final_norm = next(
                getattr(model.model, name)
                for name in ("final_layernorm", "norm", "norm_f")
                if hasattr(model.model, name)
            )
            final_norm.weight.mul_(20.0)  # (not the head: Zamba2 ties it to the input embeddings)
    return hsc.enable(model) if enable else model


def ids(length: int, batch: int = 1, seed: int = 0):
    """Random token ids in [3, VOCAB) of the hybrids' vocabulary: no pad, eos or bos."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_pad(rows, pad: int = PAD):
    """Left-padded ``[B, max length]`` ids and their 0/1 mask from 1-d id tensors."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return out, mask


def tiny_hybrid(arch: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A tiny random hybrid model of the file / store tests (vocab 99, stock init), in eval mode, enabled."""
    torch.manual_seed(seed)
    kwargs = {**SMALL, "vocab_size": STORE_VOCAB, **HYBRID_CONFIGS[arch], **STORE_FLAVOUR.get(arch, {}), **overrides}
    config = AutoConfig.for_model(arch, **{k: v for k, v in kwargs.items() if v is not None})
    return hsc.enable(AutoModelForCausalLM.from_config(config).to(dtype).eval())


# ------------------------------------------------------------------------------------------ SeRpEnt, COFFEE
SERPENT_VOCAB = 61
# With the default init the branch SSMs hardly read their states (zeroing every SSM state of a composed state
# moved the next-token logits by ~1e-6 relative, below the tolerance of the exactness checks): a larger init
# (B, C, embeddings) and larger steps Δ make them matter (zeroing them now moves the logits by 20-40%).
SERPENT_STATE_MATTERS = dict(initializer_range=1.0, time_step_min=0.01, time_step_max=0.5)


def serpent_lm(seed: int = 0, **overrides) -> hsc.SeRpEntMambaForCausalLM:
    """A tiny random SeRpEnt LM (3 branches κ = 1, 0.5, 0.1) as test_serpent.py builds it: stock init, tied head,
    not enabled."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=SERPENT_VOCAB, hidden_size=24, num_hidden_layers=2, state_size=4, resample_window=3,
                  num_gaussians=4, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
    kwargs.update(overrides)
    return hsc.SeRpEntMambaForCausalLM(hsc.SeRpEntMambaConfig(**kwargs)).eval()


def tiny_serpent(seed: int = 0, **overrides) -> hsc.SeRpEntMambaForCausalLM:
    """:func:`serpent_lm`, enabled, with an untied N(0, 1) head: it spreads the logits, so that greedy decoding does
    not repeat one token (tied, it echoes) and ties are far."""
    model = serpent_lm(seed, **{"tie_word_embeddings": False, **overrides})
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    return hsc.enable(model)


COFFEE_VOCAB = 40
# With the default init (0.02) the state moves the next-token logits by 3-8% and changes no greedy token; a
# larger init makes it matter (65-180%, other tokens), so that a lost or wrong state cannot pass.
COFFEE_STATE_MATTERS = dict(initializer_range=0.1)


def coffee_lm(seed: int = 0, **overrides) -> hsc.CoffeeForCausalLM:
    """A tiny random COFFEE LM (not enabled); an untied N(0, 1) head spreads the logits (greedy does not echo)."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=COFFEE_VOCAB, hidden_size=16, num_hidden_layers=2, state_size=4, pad_token_id=0,
                  eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    kwargs.update(overrides)
    model = hsc.CoffeeForCausalLM(hsc.CoffeeConfig(**kwargs)).eval()
    if model.lm_head is not None and not model.config.tie_word_embeddings:
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, 1.0)
    return model


def tiny_coffee(seed: int = 0, **overrides) -> hsc.CoffeeForCausalLM:
    """:func:`coffee_lm`, enabled, generating fixed lengths (eos would end them early)."""
    model = coffee_lm(seed, **overrides)
    model.generation_config.eos_token_id = None
    return hsc.enable(model)


# ------------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Architecture:
    """One architecture of the contract tests.

    ``make(seed=0, **overrides)``: a tiny random enabled model whose output depends on its context;
    ``vocab``: ids are drawn from [3, vocab); ``tol``: relative error allowed on logits of state vs concatenation
    (float32 models 1e-4; the float64 hybrids 1e-6, their states being float32 as transformers' own);
    ``has_attention``: its states carry attention keys; ``supports_beams``: beam search with past_states runs;
    ``smaller_state``: config overrides giving a model whose states have other shapes (a smaller state size)."""

    name: str
    make: Callable[..., torch.nn.Module]
    vocab: int
    tol: float = 1e-4
    has_attention: bool = False
    supports_beams: bool = True
    smaller_state: dict = field(default_factory=lambda: {"state_size": 4})


def _stock(arch):
    return lambda seed=0, **overrides: tiny_model(arch, seed=seed, **overrides)


def _hybrid(arch):
    def make(seed=0, **overrides):
        model = hybrid_model(arch, seed=seed, **overrides)
        model.generation_config.eos_token_id = None  # random tiny models: no early stop
        return model

    return make


def _serpent(seed=0, **overrides):
    return tiny_serpent(seed, **{**SERPENT_STATE_MATTERS, **overrides})


def _coffee(seed=0, **overrides):
    return tiny_coffee(seed, **{**COFFEE_STATE_MATTERS, **overrides})


ARCHITECTURES = {
    "mamba": Architecture("mamba", _stock("mamba"), STORE_VOCAB),
    "mamba2": Architecture("mamba2", _stock("mamba2"), STORE_VOCAB),
    "falcon_mamba": Architecture("falcon_mamba", _stock("falcon_mamba"), STORE_VOCAB),
    "serpent_mamba": Architecture("serpent_mamba", _serpent, SERPENT_VOCAB, smaller_state={"state_size": 2}),
    "coffee": Architecture("coffee", _coffee, COFFEE_VOCAB, smaller_state={"state_size": 2}),
    **{
        name: Architecture(
            name,
            _hybrid(name),
            VOCAB,
            # the delta-rule hybrids run their recurrence in float32 in a float64 model, as transformers does
            tol=1e-5 if name in DELTA_RULE_CONFIGS else 1e-6,
            has_attention=True,
            smaller_state=(
                {DELTA_RULE_KEY_DIM.get(name, "linear_key_head_dim"): 4}
                if name in DELTA_RULE_CONFIGS
                else {"ssm_state_size" if name == "nemotron_h" else "mamba_d_state": 4}
            ),
        )
        for name in HYBRID_CONFIGS
    },
}
