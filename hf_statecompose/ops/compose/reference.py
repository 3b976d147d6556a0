"""Composition x = Σ_k W_k ⊙ x_k, plainly: the reference of ``compose_ssm_torch`` and
``compose_ssm_triton`` (same contract, see ``vectorized.py``), plus the argument checks they share.

The reference forms the full weight tensor ``W [n, *state]`` from the decays with the functions of
``weights.py`` and sums; in float64 for float64 inputs. Memory: n times one state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .methods import METHODS, get_model_free
from .weights import method_weights


def _check_inputs(ssm_states, delta_sums, A, method, weights):
    """Validate the contract; returns (states list, n, is_mamba1)."""
    spec = get_model_free(method)
    if torch.is_tensor(ssm_states) or not isinstance(ssm_states, Sequence) or len(ssm_states) == 0:
        raise ValueError("ssm_states must be a non-empty list of tensors [B, D, N] or [B, H, P, N]")
    states = list(ssm_states)
    n = len(states)
    first = states[0]
    if not all(torch.is_tensor(s) for s in states):
        raise TypeError("ssm_states must contain tensors")
    if first.dim() not in (3, 4):
        raise ValueError(f"a state must be [B, D, N] (Mamba-1) or [B, H, P, N] (Mamba-2), got {tuple(first.shape)}")
    for k, s in enumerate(states):
        if s.shape != first.shape or s.dtype != first.dtype or s.device != first.device:
            raise ValueError(
                f"ssm_states[{k}] is {tuple(s.shape)} {s.dtype} on {s.device}, ssm_states[0] is "
                f"{tuple(first.shape)} {first.dtype} on {first.device}: states must match"
            )
    if not first.is_floating_point():
        raise TypeError(f"states must be floating point, got {first.dtype}")
    mamba1 = first.dim() == 3
    rows = first.shape[1]  # D or H
    if not torch.is_tensor(delta_sums) or tuple(delta_sums.shape) != (n, first.shape[0], rows):
        got = tuple(delta_sums.shape) if torch.is_tensor(delta_sums) else type(delta_sums).__name__
        name = "D" if mamba1 else "H"
        raise ValueError(f"delta_sums must be [n, B, {name}] = {(n, first.shape[0], rows)}, got {got}")
    a_shape = (rows, first.shape[2]) if mamba1 else (rows,)
    if not torch.is_tensor(A) or tuple(A.shape) != a_shape:
        got = tuple(A.shape) if torch.is_tensor(A) else type(A).__name__
        raise ValueError(f"A must be {'[D, N]' if mamba1 else '[H]'} = {a_shape}, got {got}")
    if spec.user_weights:
        if weights is None:
            raise ValueError(f"method={method!r} needs weights: a tensor [n] (non-negative, summing to 1)")
        if not torch.is_tensor(weights) or tuple(weights.shape) != (n,):
            got = tuple(weights.shape) if torch.is_tensor(weights) else type(weights).__name__
            raise ValueError(f"weights must be a tensor [n] = [{n}], got {got}")
    elif weights is not None:
        raise ValueError(
            f"weights are only used by methods with the user's weights (e.g. 'weighted'), not by {method!r}"
        )
    for name, t in (("delta_sums", delta_sums), ("A", A)):  # the n weights may live anywhere
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device}, the states on {first.device}: move them to one device")
    return states, n, mamba1


def compose_ssm_ref(ssm_states, delta_sums, A, method, weights=None) -> torch.Tensor:
    """Σ_k W_k ⊙ x_k with the weights of ``method`` as one tensor; returns the states' dtype."""
    states, n, mamba1 = _check_inputs(ssm_states, delta_sums, A, method, weights)
    compute = torch.promote_types(torch.promote_types(states[0].dtype, torch.float32), delta_sums.dtype)
    stacked = torch.stack([s.to(compute) for s in states])  # [n, B, D, N] | [n, B, H, P, N]
    spec = METHODS[method]
    if spec.user_weights:
        W = weights.to(device=stacked.device, dtype=compute).view(n, *([1] * (stacked.dim() - 1)))
    else:
        delta = delta_sums.to(compute)
        if mamba1:
            log_decay = delta[..., None] * A.to(compute)  # [n, B, D, N]
        else:
            log_decay = (delta * A.to(compute))[..., None, None]  # [n, B, H, 1, 1]
        W = method_weights(spec, log_decay)
    return (W * stacked).sum(0).to(states[0].dtype)


def _check_layer_counts(layer_states, delta_sums, A) -> None:
    if len(layer_states) == 0 or len(delta_sums) != len(layer_states) or len(A) != len(layer_states):
        raise ValueError(
            f"compose L >= 1 layers with one delta_sums and one A each, got {len(layer_states)} layers of states, "
            f"{len(delta_sums)} delta_sums and {len(A)} A"
        )


def compose_ssm_layers_ref(layer_states, delta_sums, A, method, weights=None) -> list[torch.Tensor]:
    """:func:`compose_ssm_ref` layer by layer: the contract of every multi-layer path. ``layer_states``: L lists of
    n states; ``delta_sums``: L tensors ``[n, B, D | H]``; ``A``: L tensors. Returns L composed states."""
    _check_layer_counts(layer_states, delta_sums, A)
    return [compose_ssm_ref(s, d, a, method, weights) for s, d, a in zip(layer_states, delta_sums, A, strict=True)]
