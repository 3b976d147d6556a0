"""``StateComposeLM``: lm-eval's ``HFLM`` conditioned on composed states of retrieved contexts.

Registered as the lm-eval model ``statecompose`` when ``hf_statecompose`` is imported. Every request
retrieves the ``k`` stored contexts most similar to its context string from a :class:`StateStore`,
composes their states (``composition``, most relevant context last, next to the query) and scores or
generates from that state, with HFLM's own tokenization, batching and bookkeeping. With ``k=0`` every
method is HFLM's, unchanged.

* ``loglikelihood``: retrieval by the request's context; a doc with a list field ``exclude_passages``
  excludes the store entries with exactly those texts (the Wikipedia task excludes the sample's own
  segment). Requests sharing a retrieval (the choices of a multiple-choice doc) run in one batch.
* ``loglikelihood_rolling``: retrieval by the document's first ``rolling_query_chars`` (1000)
  characters; the whole document is scored after the composed state (HFLM's windows: one window per
  ``max_length`` tokens, each starting from the same composed state; the first window starts with
  HFLM's prefix token, as with k=0). The retrieval query is part of the scored text, so a store that
  holds the document itself would leak it: evaluate held-out text, or use ``exclude_passages``.
* ``generate_until``: retrieval by the context; ``model.generate(..., past_states=...)`` with HFLM's
  stop sequences, ``max_gen_toks`` and greedy default.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import torch
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from . import TASKS_DIR, ModelArgumentError

logger = logging.getLogger("hf_statecompose")

BUNDLED_PASSAGES = TASKS_DIR / "passages.jsonl"


def cache_root() -> Path:
    root = os.environ.get("HF_STATECOMPOSE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "hf_statecompose" / "stores"


def _resolve_pretrained(pretrained):
    from ..demo import DEMO_DIR, DEMO_SPECS

    if isinstance(pretrained, str) and pretrained in DEMO_SPECS:
        return str(DEMO_DIR / DEMO_SPECS[pretrained])
    return pretrained


def _read_passages(spec) -> tuple[list[str], list[dict], str]:
    """``(texts, metadata, sha256 of the file)`` of a .jsonl of ``{"text": ...}`` (``bundled``: ours)."""
    path = BUNDLED_PASSAGES if spec == "bundled" else Path(spec).expanduser()
    if not path.is_file():
        raise ValueError(
            f"passages={spec!r}: no such file (a .jsonl with one {{\"text\": ...}} per line, or 'bundled')"
        )
    from ..store.passages import parse_passages_jsonl

    raw = path.read_bytes()
    texts, metadata = parse_passages_jsonl(raw.decode("utf-8"), str(path))
    return texts, metadata, hashlib.sha256(raw).hexdigest()


def _as_int(name, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, float) and value != number:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return number


@contextmanager
def _model_args_errors():
    """What lm-eval's command line builds from ``--model_args``: a refusal there is the user's to fix
    (a bad value, a missing file or folder, an unknown argument), so it becomes a ModelArgumentError."""
    try:
        yield
    except ModelArgumentError:
        raise
    except (ValueError, KeyError, TypeError, OSError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise ModelArgumentError(f"--model_args: {message}") from error


class StateComposeLM(HFLM):
    """lm-eval model ``statecompose``: HFLM + retrieval from a :class:`~hf_statecompose.StateStore` + composition.

    Arguments (strings from ``--model_args``, or objects from Python) besides HFLM's own:

    * ``pretrained``: as HFLM (a local checkpoint folder or a model object), or ``demo`` /
      ``demo-mamba`` for the embedded Mamba-2 / Mamba-1 demo checkpoints. ``peft``: HFLM's adapter path.
    * ``store``: path of an existing store built by this very model, or a ``StateStore`` object.
    * ``passages``: a ``.jsonl`` of ``{"text": ...}`` or ``bundled`` (the passages of the bundled tasks):
      the store is built for the current model at ``store`` (if that path holds no store yet) or in
      the cache ``$HF_STATECOMPOSE_CACHE`` (default ``~/.cache/hf_statecompose/stores``), under
      ``<model fingerprint[:16]>-<sha256 of passages file + retriever + storage dtype[:16]>``, reused when present.
    * ``k`` (default 5; 0 = plain HFLM), ``composition`` (one of ``hf_statecompose.METHODS``,
      default ``picaso_r``), ``retriever`` (``minilm``, the default, or from Python any callable
      ``list[str] -> [n, E]`` with a ``name``), ``storage_dtype`` (``fp32`` / ``bf16``, for a new store),
      ``rolling_query_chars`` (1000).
    """

    def __init__(
        self,
        pretrained="demo",
        store=None,
        passages=None,
        k=5,
        composition="picaso_r",
        retriever="minilm",
        storage_dtype=None,
        rolling_query_chars=1000,
        device=None,
        **kwargs,
    ) -> None:
        from ..composition.composer import StateComposer
        from ..ops.compose.methods import METHODS

        self.k = _as_int("k", k)
        if self.k < 0:
            raise ValueError(f"k must be >= 0 (0 = no retrieval, plain HFLM), got {self.k}")
        if isinstance(composition, StateComposer):
            self.composition = composition
        elif composition not in METHODS:
            raise ValueError(f"unknown composition {composition!r}; choose one of {', '.join(METHODS)}")
        else:
            self.composition = composition
        self.rolling_query_chars = _as_int("rolling_query_chars", rolling_query_chars)
        if self.k > 0 and store is None and passages is None:
            raise ValueError(
                "k > 0 needs contexts to retrieve: pass store=<path of a StateStore built by this model> "
                "or passages=<file.jsonl | bundled> (or k=0 for plain HFLM)"
            )
        if passages is not None and passages != "bundled" and not Path(passages).expanduser().is_file():
            _read_passages(passages)  # its error, before minutes of model and retriever loading
        if retriever is not None and not callable(retriever) and retriever not in ("minilm", "default"):
            raise ValueError(
                f"retriever={retriever!r}: use 'minilm' (the default) or, from Python, a callable list[str] -> [n, E]"
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=_resolve_pretrained(pretrained), device=device, **kwargs)

        from ..generation.integration import enable

        core = self._model
        if hasattr(core, "get_base_model"):  # peft.PeftModel: enable the transformers model inside
            core = core.get_base_model()
        enable(core)
        self._core = core
        self._active = None  # the states (context order) of the requests being run, or None
        self._retrievals: OrderedDict = OrderedDict()
        self.store = None
        if self.k > 0 or store is not None or passages is not None:
            self.store = self._open_store(store, passages, retriever, storage_dtype)
            self._ids_by_text: dict[str, list[str]] = {}
            for entry in self.store.entries():
                self._ids_by_text.setdefault(entry.text, []).append(entry.id)

    @classmethod
    def create_from_arg_string(cls, arg_string, additional_config=None):
        with _model_args_errors():
            return super().create_from_arg_string(arg_string, additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict, additional_config=None):
        with _model_args_errors():
            return super().create_from_arg_obj(arg_dict, additional_config)

    # ------------------------------------------------------------------------------------- the store
    def _open_store(self, store, passages, retriever, storage_dtype):
        from ..retrieval import default_retriever
        from ..state.fingerprint import model_fingerprint
        from ..store import StateStore
        from ..store.format import content_id

        if isinstance(store, StateStore):
            if passages is not None:
                raise ValueError("pass either a StateStore object or passages=, not both")
            return store
        if retriever in (None, "minilm", "default"):
            retriever = default_retriever()
        model, tokenizer = self._core, self.tokenizer
        # encoding a store takes minutes for real passages: show it (on the first process only), as the CLI does
        progress = getattr(self, "rank", 0) == 0
        hint = "; pass passages=<file.jsonl | bundled> to build a store for this model"

        def opened(path, **extra):
            try:
                return StateStore(path, model, tokenizer, retriever=retriever, storage_dtype=storage_dtype, **extra)
            except ValueError as error:
                raise ValueError(f"cannot use the store at {path}: {error}{hint}") from error

        if passages is None:
            path = Path(store).expanduser()
            if not (path / "store.json").is_file():
                raise ValueError(f"store={store!r}: no StateStore there{hint}")
            return opened(path)
        texts, metadata, sha = _read_passages(passages)
        name = getattr(retriever, "name", type(retriever).__name__)
        key = hashlib.sha256(f"{sha}\n{name}\n{storage_dtype or 'fp32'}".encode()).hexdigest()[:16]
        info = {"passages_sha256": sha, "lm_eval": True}
        if store is not None:
            path = Path(store).expanduser()
            if (path / "store.json").is_file():
                existing = opened(path)
                recorded = existing.header.get("info", {}).get("passages_sha256")
                if len(existing) and recorded != sha:
                    raise ValueError(
                        f"store={store!r} already holds other passages than {passages!r}; pass an empty or new path"
                    )
                if len(existing):
                    return existing
                existing.add(texts, metadata, show_progress=progress)
                return existing
            new = opened(path, info=info)
            new.add(texts, metadata, show_progress=progress)
            return new
        path = cache_root() / f"{model_fingerprint(model)[:16]}-{key}"
        if (path / "store.json").is_file():
            existing = opened(path)
            distinct = len(
                {content_id(text, meta) for text, meta in zip(texts, metadata)}
            )  # add stores a repeated passage once
            if len(existing) == distinct:
                return existing
            logger.warning(
                "the cached store %s is incomplete (%d of %d entries): rebuilding it", path, len(existing), distinct
            )
        # build next to the final path, then rename: an interrupted build never looks complete
        import shutil
        import tempfile

        path.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=path.name + ".building-", dir=path.parent))
        try:
            logger.info("building a state store of %d passages for this model at %s", len(texts), path)
            opened(building / "store", info=info).add(texts, metadata, show_progress=progress)
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
            os.replace(building / "store", path)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        return opened(path)

    # -------------------------------------------------------------------------------- retrieval
    def _exclude_ids(self, doc) -> tuple[str, ...]:
        texts = doc.get("exclude_passages") if isinstance(doc, dict) else None
        if not texts:
            return ()
        if isinstance(texts, str):
            texts = [texts]
        return tuple(sorted({i for t in texts for i in self._ids_by_text.get(t, [])}))

    def retrieve_states(self, query: str, exclude: tuple[str, ...] = ()):
        """The states (context order: least relevant first) of the top ``k`` entries for ``query``,
        or None (k=0, empty query or nothing retrieved). Cached per (query, exclusions)."""
        from ..pipeline import context_order

        if self.k == 0 or not query.strip():
            return None
        key = (query, exclude)
        if key in self._retrievals:
            self._retrievals.move_to_end(key)
            return self._retrievals[key]
        retrieved = self.store.retrieve(query, self.k, exclude=list(exclude))  # type: ignore[union-attr]  # k > 0: open
        states = [s.to(self.device) for s in context_order(retrieved)] if retrieved else None
        self._retrievals[key] = states
        while len(self._retrievals) > 64:
            self._retrievals.popitem(last=False)
        return states

    @contextmanager
    def _conditioned(self, states):
        self._active = states
        try:
            yield
        finally:
            self._active = None

    def _grouped(self, requests, query_of, method, disable_tqdm, desc):
        """Run ``method`` (an HFLM method) once per distinct retrieval, on that retrieval's requests."""
        groups: OrderedDict = OrderedDict()
        for index, request in enumerate(requests):
            key = (query_of(request), self._exclude_ids(getattr(request, "doc", None)))
            groups.setdefault(key, []).append(index)
        results = [None] * len(requests)
        for (query, exclude), indices in tqdm(groups.items(), disable=disable_tqdm or self.rank != 0, desc=desc):
            with self._conditioned(self.retrieve_states(query, exclude)):
                out = method([requests[i] for i in indices], disable_tqdm=True)
            for i, value in zip(indices, out):
                results[i] = value
        return results

    # ----------------------------------------------------------------------------- lm-eval API
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        if self.k == 0:
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)
        return self._grouped(
            requests, lambda r: r.args[0], super().loglikelihood, disable_tqdm, "statecompose loglikelihood"
        )

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        if self.k == 0:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        return self._grouped(
            requests,
            lambda r: r.args[0][: self.rolling_query_chars],
            super().loglikelihood_rolling,
            disable_tqdm,
            "statecompose loglikelihood_rolling",
        )

    def generate_until(self, requests, disable_tqdm: bool = False):
        if self.k == 0:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        return self._grouped(
            requests, lambda r: r.args[0], super().generate_until, disable_tqdm, "statecompose generate_until"
        )

    # ------------------------------------------------------------------ HFLM's model calls, conditioned
    def _model_call(self, inps, attn_mask=None, labels=None):
        if self._active is None:
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=self.device.type,
                dtype=self.mixed_precision_dtype,
                enabled=self.mixed_precision_dtype is not None,
            ),
        ):
            return self.model(input_ids=inps, past_states=self._active, composition=self.composition).logits

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self._active is not None:
            generation_kwargs["past_states"] = self._active
            generation_kwargs["composition"] = self.composition
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update(
            {
                "statecompose_k": self.k,
                "statecompose_composition": str(self.composition),
                "statecompose_store": str(getattr(self.store, "path", None)),
                "statecompose_store_entries": len(self.store) if self.store is not None else 0,
            }
        )
        return info
