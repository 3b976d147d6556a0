"""Delta-rule mixer forward on a ``ComposableDeltaRuleCache``: gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE,
Olmo-Hybrid) and Kimi delta attention (Kimi Linear).

The stock mixers (``Qwen3_5GatedDeltaNet`` and its siblings) continue a cached state, but a left-padded row's
padding steps still decay it (``g`` is computed from zeroed inputs, not masked) and its conv window takes the
padding's zeros, and they do not know a context's *transition*. This forward does the same maths with:

* left padding inert: a padded step is the identity (``g = 0``, ``β = 0``), the conv window is continued per row
  over real tokens only, so every row equals that row alone;
* the transition ``M`` of every layer that holds one (and of every layer of an empty cache, i.e. at encode) kept
  up to date: ``M ← A_t M`` with the step matrix ``A_t = exp(g_t)(I − β_t k_t k_tᵀ)``, in the same pass as the
  state (:func:`hf_statecompose.ops.delta_rule.chunk_delta_rule` runs ``[S | M]`` with values ``[v | 0]``);
* ΣΔ ``[B, H]`` accumulated as for Mamba-2: ``Σ_t softplus(a_t + dt_bias)`` over real tokens, ``A = −exp(A_log)``
  (so ``A · ΣΔ = Σ_t g_t``, the log of the scalar part of the decay). Kimi delta attention (KDA) decays each key
  channel: its step is ``(I − β_t k_t k_tᵀ) Diag(exp g_t)`` with ``g_t = A · softplus(f_t + dt_bias)`` ``[H, k_dim]``,
  so its ΣΔ is ``[B, H, k_dim]`` (``A`` ``[H]`` per head, as its ``A_log``).

The three projection layouts: Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba`` (reordered by the mixer's own
``fix_query_key_value_ordering``), Qwen3.5's separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a``, Olmo-Hybrid's ``q_proj`` / ``k_proj`` / ``v_proj`` / ``a_proj`` / ``b_proj`` / ``g_proj`` (β doubled
with ``allow_neg_eigval``), and Kimi Linear's ``q_proj`` / ``k_proj`` / ``v_proj`` / ``b_proj`` with its
``forget_gate`` (``f_a_proj`` → ``f_b_proj``) and output gate (``g_a_proj`` → ``g_b_proj``).
``tests/test_delta_rule_models.py`` checks the forward against the stock mixers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import backends
from ..ops.delta_rule import chunk_delta_rule, delta_rule_reference


def _projections(mixer, hidden_states: torch.Tensor):
    """(mixed q·k·v [B, T, conv_dim] before the conv, gate z [B, T, H, v_dim], b [B, T, H], a: the decay's input,
    [B, T, H] for GDN, None for KDA, whose decay :func:`_decay` reads from its forget gate)."""
    batch, length, _ = hidden_states.shape
    if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next
        query, key, value, z, b, a = mixer.fix_query_key_value_ordering(
            mixer.in_proj_qkvz(hidden_states), mixer.in_proj_ba(hidden_states)
        )
        mixed = torch.cat([x.reshape(batch, length, -1) for x in (query, key, value)], dim=-1)
        return mixed, z, b, a
    if hasattr(mixer, "in_proj_qkv"):  # Qwen3.5, Qwen3.5-MoE
        z = mixer.in_proj_z(hidden_states).reshape(batch, length, -1, mixer.head_v_dim)
        return mixer.in_proj_qkv(hidden_states), z, mixer.in_proj_b(hidden_states), mixer.in_proj_a(hidden_states)
    mixed = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)], dim=-1)
    if hasattr(mixer, "forget_gate"):  # Kimi Linear (KDA)
        z = mixer.g_b_proj(mixer.g_a_proj(hidden_states)).reshape(batch, length, -1, mixer.head_dim)
        return mixed, z, mixer.b_proj(hidden_states), None
    # Olmo-Hybrid
    z = mixer.g_proj(hidden_states).reshape(batch, length, -1, mixer.head_v_dim)
    return mixed, z, mixer.b_proj(hidden_states), mixer.a_proj(hidden_states)


def _dims(mixer) -> tuple[int, int, int, int]:
    """(key_dim, value_dim, head_k_dim, head_v_dim) of a GDN or KDA mixer (KDA: q, k, v all ``heads × head_dim``)."""
    if hasattr(mixer, "forget_gate"):
        return mixer.qkv_dim, mixer.qkv_dim, mixer.head_dim, mixer.head_dim
    return mixer.key_dim, mixer.value_dim, mixer.head_k_dim, mixer.head_v_dim


def _decay(mixer, hidden_states: torch.Tensor, a: torch.Tensor | None):
    """(g, Δ, A): the log decay of each step g = A · Δ, its Δ (what ΣΔ sums) and A = −exp(A_log) [H], in float32.
    GDN: one per head, Δ = softplus(a + dt_bias) [B, T, H]. KDA: one per key channel, Δ = softplus(f + dt_bias)
    [B, T, H, k_dim] with f the forget gate's projection (softplus as the stock gate writes it)."""
    if a is not None:
        delta = F.softplus(a.float() + mixer.dt_bias)
        A = -mixer.A_log.float().exp()
        return A * delta, delta, A
    gate = mixer.forget_gate
    batch, length, _ = hidden_states.shape
    raw = (gate.f_b_proj(gate.f_a_proj(hidden_states)).float() + gate.dt_bias.float()).view(
        batch, length, -1, gate.head_dim
    )
    delta = torch.where(raw > 20.0, raw, torch.log(1.0 + torch.exp(raw)))
    A = -gate.A_log.float().exp().reshape(-1)
    return A[:, None] * delta, delta, A


def _output(mixer, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The gated norm and the output projection, as the stock mixer: core [B, T, H, v_dim] -> [B, T, hidden]."""
    batch, length = core.shape[:2]
    norm = mixer.o_norm if hasattr(mixer, "o_norm") else mixer.norm
    head_v_dim = _dims(mixer)[3]
    out = norm(core.reshape(-1, head_v_dim), z.reshape(-1, head_v_dim))
    projection = mixer.o_proj if hasattr(mixer, "o_proj") else mixer.out_proj
    return projection(out.reshape(batch, length, -1))


# whether the forward keeps the transitions: always, but benchmarks/delta_rule_encode.py switches it off to time what
# they cost (a state encoded without them fails the state checks: it cannot be composed by the order-based methods)
_TRACK_TRANSITIONS = True


def gated_deltanet_mixer_forward(mixer, hidden_states: torch.Tensor, cache, mask: torch.Tensor | None):
    """hidden_states [B, T, hidden] -> [B, T, hidden]; advances layer ``mixer.layer_idx`` of ``cache``."""
    if mask is not None:
        hidden_states = hidden_states * mask[:, :, None].to(hidden_states.dtype)
    batch, length, _ = hidden_states.shape
    layer = cache.layers[mixer.layer_idx]
    has_state = layer.filled
    backend = getattr(mixer, "_hsc_backend", "auto")
    mixed, z, b, a = _projections(mixer, hidden_states)
    mixed, conv_window = backends.causal_conv1d(
        mixed.transpose(1, 2),
        mixer.conv1d.weight.squeeze(1),
        mixer.conv1d.bias,
        conv_state=layer.conv_state if has_state else None,
        mask=mask,
        activation=mixer.activation,
        backend=backend,
    )
    key_dim, value_dim, head_k_dim, head_v_dim = _dims(mixer)
    query, key, value = torch.split(mixed.transpose(1, 2), [key_dim, key_dim, value_dim], dim=-1)
    query = query.reshape(batch, length, -1, head_k_dim)
    key = key.reshape(batch, length, -1, head_k_dim)
    value = value.reshape(batch, length, -1, head_v_dim)
    beta = b.sigmoid()
    if getattr(mixer, "allow_neg_eigval", False):
        beta = beta * 2.0
    g, delta, A = _decay(mixer, hidden_states, a)  # g, Δ: [B, T, H] (GDN) or [B, T, H, k_dim] (KDA)
    if mask is not None:
        delta = delta * mask.view(*mask.shape, *[1] * (delta.dim() - 2)).to(delta.dtype)
    # the transition is kept wherever the layer holds one, and started at encode (an empty layer)
    track = _TRACK_TRANSITIONS and ((not has_state) or layer.transition is not None)
    run = chunk_delta_rule if length > 1 else delta_rule_reference
    # in float32 whatever the model's dtype, as the stock mixers compute it (and as the state is kept)
    core, state, transition = run(
        query.float(),
        key.float(),
        value.float(),
        g.float(),
        beta.float(),
        initial_state=layer.ssm_state if has_state else None,
        initial_transition=layer.transition if has_state and track else None,
        output_transition=track,
        use_qk_l2norm=True,
        mask=mask,
    )
    cache.advance_layer(mixer.layer_idx, ssm_state=state, conv_state=conv_window, delta_sum=delta.sum(1), A=A)
    layer.transition = transition.float() if transition is not None else None
    return _output(mixer, core.to(hidden_states.dtype), z)
