"""What this package's own causal LMs (SeRpEnt-Mamba, COFFEE) share around their backbone: the state cache in
``generate()``, the refusal of ``past_states`` before ``hf_statecompose.enable``, and the LM head's loss and
outputs.

Their modeling files import this module absolutely (``hf_statecompose.models.causal_lm``), so the copies that
``save_pretrained`` writes for ``trust_remote_code`` keep working.
"""
from __future__ import annotations

from .. import compat
from ..state.cache import ComposableMambaCache


def refuse_past_states(model, kwargs) -> None:
    """``forward(**kwargs)`` would swallow ``past_states``: a model that was not given ``hf_statecompose.enable``
    would silently run without its contexts (as the guard on transformers' Mamba classes refuses them)."""
    if kwargs.get("past_states") is not None:
        raise ValueError(
            f"{type(model).__name__}.forward() got past_states, but past_states needs hf_statecompose.enable(model) "
            "first: this model was never enabled (or was disabled), so it would ignore the states and silently run "
            "without any context. Call `model = hf_statecompose.enable(model)` once after loading it"
        )


class StateCacheGenerationMixin(compat.CacheGenerationMixin):
    """``generate()`` for a model whose state is this package's cache (:class:`ComposableMambaCache` or the
    architecture's subclass), passed under transformers' cache name (``cache``; ``cache_params`` before 5.24).
    The generation hooks themselves are transformers' private methods, overridden in the adapter
    (:class:`hf_statecompose.compat.CacheGenerationMixin`); here: which cache, and the LM outputs."""

    def _hsc_empty_cache(self):
        return ComposableMambaCache.empty_for(self)

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
