"""What this package's own causal LMs (SeRpEnt-Mamba, COFFEE) share around their backbone: the state cache in
``generate()``, the refusal of ``past_states`` before ``hf_statecompose.enable``, and the LM head's loss and
outputs.

Their modeling files import this module absolutely (``hf_statecompose.models.causal_lm``), so the copies that
``save_pretrained`` writes for ``trust_remote_code`` keep working.
"""

from __future__ import annotations

import functools

from .. import compat
from .._guard import refusal
from ..state.cache import ComposableMambaCache


def refuse_past_states(model, kwargs, method: str = "forward") -> None:
    """``forward(**kwargs)`` (and ``generate``, whose model-kwargs check would only say "not used") would take
    ``past_states`` for something else: a model that was not given ``hf_statecompose.enable`` refuses them with
    the message of the guard on transformers' Mamba classes."""
    if kwargs.get("past_states") is not None:
        raise ValueError(refusal(type(model).__name__, method))


class StateCacheGenerationMixin(compat.CacheGenerationMixin):
    """``generate()`` for a model whose state is this package's cache (:class:`ComposableMambaCache` or the
    architecture's subclass), passed under transformers' cache name (``cache``; ``cache_params`` before 5.24).
    The generation hooks themselves are transformers' private methods, overridden in the adapter
    (:class:`hf_statecompose.compat.CacheGenerationMixin`); here: which cache, and the LM outputs."""

    def _hsc_empty_cache(self):
        return ComposableMambaCache.empty_for(self)

    @functools.wraps(compat.CacheGenerationMixin.generate)
    def generate(self, *args, **kwargs):
        # hsc.enable's generate consumes past_states before it calls this one: here they mean "never enabled"
        refuse_past_states(self, kwargs, "generate")
        return super().generate(*args, **kwargs)

    def _lm_outputs(self, outputs, logits, labels, return_dict, output_class, **kwargs):
        """Loss (next-token, shifted inside; -100 ignored) and the output of ``forward``, as transformers'
        Mamba returns them: ``output_class(loss, logits, cache, hidden_states)`` or a tuple."""
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        cache = compat.output_cache(outputs)
        if not return_dict:
            output = tuple(v for v in (logits, cache, outputs.hidden_states) if v is not None)
            return ((loss,) + output) if loss is not None else output
        return output_class(loss=loss, logits=logits, hidden_states=outputs.hidden_states, **compat.cache_kwargs(cache))
