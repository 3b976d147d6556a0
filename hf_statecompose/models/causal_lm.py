"""What this package's own causal LMs (SeRpEnt-Mamba, COFFEE) share around their backbone: the state cache in
``generate()``, the refusal of ``past_states`` before ``hf_statecompose.enable``, and the LM head's loss and
outputs.

Their modeling files import this module absolutely (``hf_statecompose.models.causal_lm``), so the copies that
``save_pretrained`` writes for ``trust_remote_code`` keep working.
"""
from __future__ import annotations

import torch
from transformers.generation import GenerationMixin

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


class StateCacheGenerationMixin(GenerationMixin):
    """``generate()`` for a model whose state is this package's cache, passed as ``cache_params``.

    transformers names the cache ``cache_params`` only for classes with "mamba" in their name and otherwise
    builds a ``DynamicCache`` as ``past_key_values``: here, as it does for Mamba, a user's ``cache_params`` is
    kept, else an empty cache of the model's architecture (:meth:`ComposableMambaCache.empty_for`) is made.
    After the prompt every token fed is real, so the attention mask is dropped from the decoding steps.
    """

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get("cache_params")
        if cache is not None:
            if generation_config.cache_implementation is not None:
                raise ValueError("Passing both `cache_implementation` and `cache_params` is unsupported; use one")
            cache._is_user_defined = True
        elif generation_config.use_cache is not False:
            model_kwargs["cache_params"] = ComposableMambaCache.empty_for(self)

    def prepare_inputs_for_generation(
        self,
        input_ids,
        inputs_embeds=None,
        use_cache=None,
        cache_params: ComposableMambaCache | None = None,
        attention_mask: torch.LongTensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs,
    ):
        model_inputs = super().prepare_inputs_for_generation(
            input_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            cache_params=cache_params,
            attention_mask=attention_mask,
            is_first_iteration=is_first_iteration,
            **kwargs,
        )
        if use_cache and not is_first_iteration:
            model_inputs["attention_mask"] = None  # after the prompt every token fed is real
        return model_inputs

    def _lm_outputs(self, outputs, logits, labels, return_dict, output_class, **kwargs):
        """Loss (next-token, shifted inside; -100 ignored) and the output of ``forward``, as transformers'
        Mamba returns them: ``output_class(loss, logits, cache_params, hidden_states)`` or a tuple."""
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        if not return_dict:
            output = tuple(v for v in (logits, outputs.cache_params, outputs.hidden_states) if v is not None)
            return ((loss,) + output) if loss is not None else output
        return output_class(loss=loss, logits=logits, cache_params=outputs.cache_params,
                            hidden_states=outputs.hidden_states)
