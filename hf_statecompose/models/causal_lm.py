"""What this package's own causal LMs (SeRpEnt-Mamba, COFFEE) share around their backbone: the state cache in
``generate()``, the body of ``forward`` (the refusal of ``past_states`` before ``hf_statecompose.enable``, the
backbone, the LM head's logits, loss and outputs).

Their modeling files import this module absolutely (``hf_statecompose.models.causal_lm``), so the copies that
``save_pretrained`` writes for ``trust_remote_code`` keep working.
"""

from __future__ import annotations

import functools

from .. import compat
from .._guard import refusal, refuses
from ..state.cache import ComposableMambaCache


def refuse_past_states(model, kwargs, method: str = "forward") -> None:
    """``forward(**kwargs)`` (and ``generate``, whose model-kwargs check would only say "not used") would take
    ``past_states`` for something else: a model that was not given ``hf_statecompose.enable`` refuses them with
    the message of the guard on transformers' Mamba classes (and, as it, lets a ``generate`` call that names
    ``custom_generate`` through: :func:`hf_statecompose._guard.refuses`)."""
    if refuses(method, kwargs):
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

    def _hsc_logits(self, hidden_states):
        """Float32 logits of ``hidden_states`` (the positions kept): the linear LM head; a model whose logits come
        otherwise (COFFEE's distances to the embeddings) overrides this."""
        return self.lm_head(hidden_states.to(self.lm_head.weight.dtype)).float()

    def _causal_lm_forward(
        self,
        output_class,
        input_ids,
        attention_mask,
        inputs_embeds,
        cache,
        labels,
        output_hidden_states,
        return_dict,
        use_cache,
        logits_to_keep,
        kwargs: dict,
    ):
        """The body of the causal LMs' ``forward`` (their signatures and docs stay in their modeling files):
        ``past_states`` refused before ``enable``, the cache under either name, the backbone, the logits of the last
        ``logits_to_keep`` positions (0: all; or the given indices), then :meth:`_lm_outputs`."""
        refuse_past_states(self, kwargs)
        cache = compat.resolve_cache(cache, kwargs)  # `cache_params`, the name before transformers 5.24, works too
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.backbone(
            input_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            use_cache=use_cache,
            attention_mask=attention_mask,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self._hsc_logits(hidden_states[:, keep])
        return self._lm_outputs(outputs, logits, labels, return_dict, output_class, **kwargs)

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
