"""Data attribution through composition: which retrieved context mattered (PICASO paper, appendix).

Leave-one-out: compose all ``n`` contexts, and each set of ``n - 1``; a context's attribution is how
much the continuation's loss rises without it. Composition makes this cheap: no context is re-read,
the ``n + 1`` compositions are elementwise, and their losses come from one batched forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Attribution:
    loss_all: float  # loss with every context composed
    loss_without: list[float]  # loss_without[i]: context i left out
    scores: list[float]  # loss_without[i] - loss_all: > 0 when context i helped

    def ranking(self) -> list[int]:
        """Context indices, most helpful first."""
        return sorted(range(len(self.scores)), key=lambda i: -self.scores[i])


@torch.no_grad()
def leave_one_out(model, states: list, query_ids, continuation_ids, composition="picaso_r") -> Attribution:
    """Leave-one-out attribution of ``states`` (batch-1 context states, composition order) for the
    continuation ``continuation_ids`` of ``query_ids`` under ``composition`` (name or StateComposer).

    With one context, leaving it out means no context at all.
    """
    from .composition.composer import StateComposer
    from .pipeline import continuation_losses

    states = list(states)
    if not states:
        raise ValueError("leave_one_out needs at least one context state")
    composer = composition if isinstance(composition, StateComposer) else StateComposer(composition)
    subsets = [states] + [states[:i] + states[i + 1 :] for i in range(len(states))]
    composed = [composer.compose(s, model=model) if s else None for s in subsets]
    losses = continuation_losses(
        model, composed, torch.as_tensor(query_ids), torch.as_tensor(continuation_ids)
    ).tolist()
    return Attribution(losses[0], losses[1:], [without - losses[0] for without in losses[1:]])
