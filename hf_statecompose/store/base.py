"""``StateStore``: the one type every store backend is (:class:`~hf_statecompose.store.folder.FolderStateStore`,
a folder of safetensors shards; :class:`~hf_statecompose.store.lance.LanceStateStore`, LanceDB tables), and the
registry of backends that ``StateStore(path, model, tokenizer, backend=...)`` dispatches through.

This class holds what the backends share: the choice of backend, the model / tokenizer / retriever binding, the
checks of every public method's arguments, embedding and tokenizing, and the encoding of one entry's tensors and
the verified decoding back into a state (dtypes, shapes, finite values, ΣΔ >= 0 against the model). Each backend
implements the storage: ``add``, ``get``, ``retrieve``, ``delete``, ``compact``, ``entries``, ``ids``,
``refresh``, ``stats``, ``__len__``, ``__contains__``, and registers itself by name (:func:`register_backend`);
the built-in backends (``"folder"``, ``"lance"``) are registered below by their module paths, each imported on first
use (the ``lance`` backend's dependencies are an optional extra).
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterable, Sequence

import torch

from ..state.architectures import architecture, check_extra_tensors
from ..state.cache import ComposableMambaCache
from ..state.fingerprint import model_fingerprint
from ..state.validation import EMPTY_CONTEXT, check_state, expected_state_shapes
from .format import (
    STORAGE_DTYPES,
    StoreEntry,
    all_finite,
    check_count,
    check_id,
    check_utf8,
    checked_json,
    tokenizer_record,
)

# ------------------------------------------------------------------------------------ the backends' registry
# name -> the backend class, or "package.module:Class" for a backend imported on first use (as fsspec's
# known_implementations); filled by register_backend (the backend modules, users). The built-in backends are
# registered here by their module paths (imported on first use: the package's __init__ imports no backend)
_BACKENDS: dict[str, type[StateStore] | str] = {
    "folder": "hf_statecompose.store.folder:FolderStateStore",
    "lance": "hf_statecompose.store.lance:LanceStateStore",
}
_BACKENDS_LOCK = threading.Lock()
# what a backend implements: StateStore's methods that only raise NotImplementedError (checked at registration and
# when a backend class is instantiated, as an abstract base class would, without making StateStore abstract: mypy
# would then refuse ``StateStore(path, model, tokenizer)``, which returns the backend's object)
BACKEND_METHODS = (
    "add",
    "get",
    "retrieve",
    "delete",
    "compact",
    "entries",
    "ids",
    "refresh",
    "stats",
    "__len__",
    "__contains__",
)


def register_backend(name: str, backend: type[StateStore] | str, *, replace: bool = False) -> None:
    """Make ``StateStore(path, model, tokenizer, backend=name)`` open a store with ``backend``: a subclass of
    :class:`StateStore` whose ``backend`` attribute is ``name`` and which implements :data:`BACKEND_METHODS`, or
    the string ``"package.module:Class"`` naming one (imported, then checked, on first use: for a backend
    whose dependencies are optional; that class may then register itself under the name). A name registered
    already (to something else) is refused unless ``replace=True``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a store backend's name must be an identifier string, got {name!r}")
    if isinstance(backend, str):
        module, _, attribute = backend.partition(":")
        if not module or not attribute:
            raise ValueError(f"a backend given by name must be 'package.module:Class', got {backend!r}")
    else:
        _check_backend_class(name, backend)
    with _BACKENDS_LOCK:
        known = _BACKENDS.get(name)
        lazy_for = isinstance(known, str) and not isinstance(backend, str) and known == _path_of(backend)
        if known is not None and known != backend and not lazy_for and not replace:
            raise ValueError(
                f"a store backend named {name!r} is registered already ({_describe(_BACKENDS[name])}); "
                "pass replace=True to replace it"
            )
        _BACKENDS[name] = backend


def unregister_backend(name: str) -> None:
    """Remove the backend ``name`` from the registry (``KeyError`` if it is not registered)."""
    with _BACKENDS_LOCK:
        if not isinstance(name, str) or name not in _BACKENDS:
            raise KeyError(f"no store backend named {name!r}; registered: {registered_backends()}")
        del _BACKENDS[name]


def registered_backends() -> list[str]:
    """The names ``StateStore(..., backend=...)`` accepts, in registration order."""
    return list(_BACKENDS)


def backend_class(name: str) -> type[StateStore]:
    """The class registered as ``name`` (imported now if registered by its module path)."""
    entry = _BACKENDS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(
            f"unknown store backend {name!r}; registered: {', '.join(map(repr, registered_backends()))} "
            "(add one with hf_statecompose.store.register_backend)"
        )
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        cls = getattr(importlib.import_module(module), attribute, None)
        if cls is None:
            raise ValueError(f"store backend {name!r}: {module} has no {attribute} (registered as {entry!r})")
        _check_backend_class(name, cls)
        with _BACKENDS_LOCK:
            if _BACKENDS.get(name) == entry:
                _BACKENDS[name] = cls
        return cls
    return entry


def _path_of(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _describe(entry: type | str) -> str:
    return entry if isinstance(entry, str) else _path_of(entry)


def _check_backend_class(name: str, cls) -> None:
    if not isinstance(cls, type) or not issubclass(cls, StateStore) or cls is StateStore:
        raise TypeError(f"store backend {name!r} must be a subclass of StateStore, got {cls!r}")
    if getattr(cls, "backend", None) != name:
        raise ValueError(
            f"store backend {name!r}: {cls.__name__}.backend is {getattr(cls, 'backend', None)!r}; set it to {name!r}"
        )
    missing = _missing_methods(cls)
    if missing:
        raise TypeError(f"store backend {name!r}: {cls.__name__} does not implement {', '.join(missing)}")


def _missing_methods(cls) -> list[str]:
    return [method for method in BACKEND_METHODS if getattr(cls, method) is getattr(StateStore, method)]


class StateStore:
    """A database of context states, retrieved by embedding similarity; ``StateStore(path, model,
    tokenizer)`` opens (or creates) one.

    Args:
        path: the store's directory (created if missing), or for ``backend="lance"`` a LanceDB URI.
        model: the Mamba / Mamba-2 model (or hybrid: Bamba, GraniteMoeHybrid, NemotronH, Zamba2, ...) that encodes
            (and later consumes) the states. A store records the model's fingerprint and refuses a different model.
            A hybrid's entries also hold the keys, values and positions of their tokens at every attention layer.
        tokenizer: the model's tokenizer (a callable returning ``input_ids``, as transformers' are). The
            store records it (name, vocabulary size and hash, how it splits a probe text) and refuses
            another.
        retriever: a callable ``list[str] -> [n, E]`` vectors (tensor or array). ``None``: the default
            all-MiniLM-L6-v2 (:func:`hf_statecompose.retrieval.default_retriever`, offline). The store
            records its ``name`` (attribute, else the class name) and dimension, and refuses another.
        storage_dtype: ``"fp32"`` or ``"bf16"`` for the SSM states and conv windows (decays are always
            fp32). Fixed when the store is created; ``None`` keeps the store's (``"fp32"`` when new).
        info: JSON-able facts to record at creation (the CLI records where the model came from).
        backend: ``"folder"`` (default: :class:`~hf_statecompose.store.folder.FolderStateStore`) or
            ``"lance"``: LanceDB tables at ``path`` (a local folder or an object-storage URI), with the
            same API and checks (:class:`~hf_statecompose.store.lance.LanceStateStore`, which takes
            further keyword arguments; needs the ``[scale]`` extra), or any name given to
            :func:`register_backend`; an unknown name is a ``ValueError`` listing the registered ones.
    """

    backend: str
    storage_dtype: torch.dtype  # set by each backend when it opens the store
    header: dict

    def __new__(cls, path=None, *args, backend: str | None = None, **kwargs) -> StateStore:
        if cls is StateStore:  # the factory: the registered backend (default "folder")
            cls = backend_class("folder" if backend is None else backend)
        elif backend is not None and backend != getattr(cls, "backend", None):
            backend_class(backend)  # an unknown name: the registry's error, listing the registered ones
            raise ValueError(
                f"{cls.__name__} is the {getattr(cls, 'backend', None)!r} backend, got backend={backend!r}; use StateStore(..., backend={backend!r})"
            )
        missing = _missing_methods(cls)
        if missing:  # as an abstract base class refuses an incomplete subclass
            raise TypeError(f"cannot open a store with {cls.__name__}: it does not implement {', '.join(missing)}")
        return super().__new__(cls)

    def _bind(self, model, tokenizer, retriever, storage_dtype, info):
        """The model (enabled), tokenizer and retriever this store runs with, what every state read from
        it carries, and the checked ``storage_dtype`` / ``info`` arguments. Returns (tokenizer record,
        info as checked JSON)."""
        from ..generation.integration import enable

        self.model = enable(model)
        self.tokenizer = tokenizer
        tokenizer_info = tokenizer_record(tokenizer)
        if retriever is None:
            from ..retrieval import default_retriever

            retriever = default_retriever()
        if not callable(retriever):
            raise TypeError(f"retriever must be a callable list[str] -> [n, E] vectors, got {type(retriever).__name__}")
        self.retriever = retriever
        self.retriever_name = str(getattr(retriever, "name", type(retriever).__name__))
        if storage_dtype is not None and storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {sorted(STORAGE_DTYPES)}, got {storage_dtype!r}")
        if info is not None and not isinstance(info, dict):
            raise TypeError(f"info must be a dict, got {type(info).__name__}")
        self.fingerprint = model_fingerprint(model)
        # what every state read from this store carries, taken once: ComposableMambaCache.empty_for
        # re-checks the model's fingerprint (a pass over all weights), far too slow per entry read
        template = ComposableMambaCache.empty_for(model)
        self._state_class = type(template)  # ComposableSeRpEntCache for a SeRpEnt model
        self._layout = architecture(template.architecture)  # what else its states carry (SeRpEnt: resampling)
        self._state_template = {
            "architecture": template.architecture,
            "fingerprint": template.fingerprint,
            "model_dtype": template.model_dtype,
            "model_info": dict(template.model_info),
        }
        # a hybrid model's attention layers (model layer indices): each entry also holds their keys, values and positions
        self._attention_layers = tuple(getattr(template, "attention_layer_indices", ()))
        self._attention_dims = self._layout.attention_dims(model.config) if self._attention_layers else None
        # the A lists (read once per checksum, shared by the states built from them) compared with the model's
        self._A_compared: list[list[torch.Tensor]] = []
        return tokenizer_info, checked_json(dict(info or {}), "info")

    # ------------------------------------------------------------------------------------ argument checks
    def _check_ids(self, ids, what: str) -> list[str]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(f"{what} must be a list of entry ids, got {type(ids).__name__} {ids!r:.40}")
        return [check_id(i, "entry") for i in ids]

    def _check_one_or_many(self, ids) -> tuple[bool, list[str]]:
        """(whether ``ids`` is one id, the checked ids as a list): ``get`` and ``delete`` take either."""
        if isinstance(ids, str):
            return True, [check_id(ids, "entry")]
        return False, self._check_ids(ids, "ids")

    def _check_add(self, texts, metadata, batch_size) -> tuple[list[str], list[dict], int]:
        """``add``'s arguments checked: (texts, one checked-JSON metadata dict per text, batch size)."""
        if isinstance(texts, (str, bytes)):
            raise TypeError(
                "texts must be a list of strings, got a single string (it would add one entry per character): use add([text])"
            )
        if not isinstance(texts, Iterable):
            raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
        texts = list(texts)
        batch_size = check_count(batch_size, "batch_size", 1)
        if metadata is not None and (isinstance(metadata, (dict, str, bytes)) or not isinstance(metadata, Iterable)):
            raise TypeError("metadata must be a list with one dict per text")
        metadata = list(metadata) if metadata is not None else [{} for _ in texts]
        if len(metadata) != len(texts):
            raise ValueError(f"{len(texts)} texts but {len(metadata)} metadata dicts")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"text {i} is empty or not a string; every entry needs some text to encode")
            check_utf8(text, f"text {i}")
        for i, m in enumerate(metadata):
            if m is not None and not isinstance(m, dict):
                raise TypeError(f"metadata of text {i} must be a dict (or None), got {type(m).__name__}")
        return texts, [checked_json(dict(m or {}), f"metadata of text {i}") for i, m in enumerate(metadata)], batch_size

    @staticmethod
    def _check_local_path(path: str) -> None:
        """Refuse a local path that is an existing file (a store is a folder)."""
        if "://" in path:
            return
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(
                f"{path} is a file, not a folder: a store is a folder (give a new or an existing store's folder)"
            )
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if parent and not os.path.isdir(parent):
            raise ValueError(f"cannot make a store at {path}: {parent} is a file, not a folder")

    def _check_query(self, query, k, exclude) -> tuple[int, list[str]]:
        """``retrieve``'s arguments checked: (k, the excluded ids)."""
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be a non-empty string")
        return check_count(k, "k", 0), self._check_ids(exclude, "exclude")

    # ------------------------------------------------------------------------------------ encode
    def _embed(self, texts: list[str]) -> torch.Tensor:
        vectors = self.retriever(list(texts))
        vectors = torch.as_tensor(vectors).detach().to("cpu", torch.float32)
        if vectors.dim() != 2 or vectors.shape[0] != len(texts):
            raise ValueError(
                f"the retriever returned shape {tuple(vectors.shape)} for {len(texts)} texts; expected [n, E]"
            )
        if not torch.isfinite(vectors).all():
            raise ValueError("the retriever returned NaN/inf embeddings")
        return torch.nn.functional.normalize(vectors, dim=-1).contiguous()

    def _tokenize(self, texts: list[str]):
        ids = [[int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]] for text in texts]
        for t, row in zip(texts, ids):
            if not row:
                raise ValueError(
                    f"the tokenizer produced no tokens for {t[:40]!r}: a context of no tokens; {EMPTY_CONTEXT}"
                )
        width = max(len(r) for r in ids)
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
        return input_ids, mask, ids

    @property
    def _transition_rounding(self) -> float:
        """The unit roundoff of the storage dtype (0.0 for float32 and wider): how far a delta-rule transition read
        back may sit above its bound (:func:`hf_statecompose.state.architectures._check_transition_values`)."""
        if self.storage_dtype.itemsize >= 4:
            return 0.0
        return float(torch.finfo(self.storage_dtype).eps) / 2

    @property
    def _keys_dtype(self) -> torch.dtype:
        """The dtype of a hybrid entry's stored keys and values: bfloat16 in a ``"bf16"`` store, else the model
        dtype (no rounding); they are read back in the model dtype."""
        return torch.bfloat16 if self.storage_dtype == torch.bfloat16 else self._state_template["model_dtype"]

    def _entry_tensor_names(self, num_layers: int) -> list[str]:
        """The names of one entry's tensors (without the entry id): per state layer its state, ΣΔ and the
        architecture's extras, per attention layer (hybrids) its keys, values and positions, and the token ids."""
        from ..state.serialization import attention_tensor_names

        kinds = ("ssm", "conv", "delta_sum") + tuple(extra.file_key for extra in self._layout.extras)
        names = [f"{kind}.{layer}" for layer in range(num_layers) for kind in kinds]
        return names + [name for i in self._attention_layers for name in attention_tensor_names(i)] + ["token_ids"]

    def _entry_tensors(self, state: ComposableMambaCache, row: int, tokens: list[int]) -> dict[str, torch.Tensor]:
        """The tensors stored for row ``row`` of ``state`` (its state in the storage dtype, ΣΔ in fp32,
        architecture extras in their own dtypes, a hybrid's keys and values of the row's tokens (no padding
        slots) in :attr:`_keys_dtype` with their positions, its token ids); ``A`` is stored once per shard / store."""
        from ..state.serialization import attention_tensor_names

        out = {}
        for layer in range(state.num_layers):
            out[f"ssm.{layer}"] = (
                state.ssm_states[layer][row : row + 1].detach().to("cpu", self.storage_dtype).contiguous()
            )
            out[f"conv.{layer}"] = (
                state.conv_states[layer][row : row + 1].detach().to("cpu", self.storage_dtype).contiguous()
            )
            out[f"delta_sum.{layer}"] = (
                state.delta_sums[layer][row : row + 1].detach().to("cpu", torch.float32).contiguous()
            )
            for extra in self._layout.extras:  # in their own dtypes (int64 clocks, bool masks): never rounded
                tensor = getattr(state, extra.attribute)[layer][row : row + 1].detach().to("cpu")
                if extra.stored_like_state:  # a delta-rule transition: in the storage dtype, as the SSM state
                    tensor = tensor.to(self.storage_dtype)
                out[f"{extra.file_key}.{layer}"] = tensor.new_empty(tensor.shape).copy_(tensor)  # standard strides
        for i in self._attention_layers:
            layer = state.layers[i]
            real = int((layer.positions[row] >= 0).sum())  # left padded: the row's keys are its last ``real`` slots
            start = layer.keys.shape[-2] - real
            keys, values, positions = attention_tensor_names(i)
            out[keys] = layer.keys[row : row + 1, :, start:].detach().to("cpu", self._keys_dtype).contiguous()
            out[values] = layer.values[row : row + 1, :, start:].detach().to("cpu", self._keys_dtype).contiguous()
            # a copy: the attention layers of one state share one positions tensor, which safetensors refuses to write twice
            out[positions] = layer.positions[row : row + 1, start:].detach().to("cpu").clone()
        out["token_ids"] = torch.tensor([tokens], dtype=torch.long)
        return out

    # ------------------------------------------------------------------------------------ decode
    def _state(self, tensors: dict, record: dict, A, device) -> ComposableMambaCache:
        state = self._state_class(
            self.model.config, **{**self._state_template, "model_info": dict(self._state_template["model_info"])}
        )
        model_dtype = state.model_dtype
        for layer in range(len(A)):
            state.set_layer(
                layer,
                ssm_state=tensors[f"ssm.{layer}"].to(device, torch.float32),
                conv_state=tensors[f"conv.{layer}"].to(device, model_dtype),
                delta_sum=tensors[f"delta_sum.{layer}"].to(device),
                A=A[layer].to(device).clone(),  # the state's own: the store's verified A is shared by every read
            )
            for extra in self._layout.extras:
                tensor = tensors[f"{extra.file_key}.{layer}"]
                if extra.stored_like_state:
                    tensor = tensor.to(extra.dtype(model_dtype))
                getattr(state, extra.attribute)[layer] = tensor.to(device)
        if self._attention_layers:
            from ..state.serialization import attention_tensor_names

            positions = None
            for i in self._attention_layers:
                keys, values, names = attention_tensor_names(i)
                positions = (
                    tensors[names].to(device) if positions is None else positions
                )  # one tensor, as encode makes it
                state.layers[i].fill_keys(
                    tensors[keys].to(device, model_dtype), tensors[values].to(device, model_dtype), positions
                )
        state.num_tokens = torch.tensor([record["num_tokens"]], device=device)
        state.token_ids = tensors["token_ids"].to(device)
        # every backend builds states only from tensors that passed _check_entry_tensors (finite, ΣΔ >= 0): the
        # state's check skips those scans where the conversion above keeps every value (the SSM states and ΣΔ go
        # to float32; the conv windows when the model dtype holds the storage dtype), and compares A with the model
        # once per A list (its states get copies); the state carries the verdict (bound to these tensors, void after
        # an edit), so that its first use (compose, generate) does not check it again
        exact_conv = torch.promote_types(self.storage_dtype, model_dtype) == model_dtype
        compare_A = not any(A is compared for compared in self._A_compared)
        check_state(
            state,
            self.model if compare_A else None,
            where=f"store entry {record['id']}",
            # A: a copy of the store's A list, compared with the model (here, for the first state built from it)
            values_checked=("ssm_state", "delta_sum", "A") + (("conv_state",) if exact_conv else ()),
            fits=self.fingerprint,
            rounding=self._transition_rounding,
        )
        if compare_A:
            self._A_compared.append(A)
        return state

    def _check_entry_tensors(self, where: str, tensors: dict, num_tokens: int, num_layers: int) -> None:
        """The checksum proved the bytes are the ones written; this proves they are a state of this model."""
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(
                f"{where}: its record says {num_tokens!r} tokens: a context of no tokens; {EMPTY_CONTEXT}; delete it"
            )
        ssm_shape, conv_shape = expected_state_shapes(self.model.config)
        for layer in range(num_layers):
            for name, shape, dtype in (
                ("ssm", ssm_shape, self.storage_dtype),
                ("conv", conv_shape, self.storage_dtype),
                ("delta_sum", None, torch.float32),
            ):
                tensor = tensors[f"{name}.{layer}"]
                if (
                    tensor.dtype != dtype
                    or tensor.shape[0] != 1
                    or (shape is not None and tuple(tensor.shape[1:]) != shape)
                ):
                    raise ValueError(
                        f"{where}: layer {layer} {name} is {tensor.dtype} {tuple(tensor.shape)}, not a {self.header['storage_dtype']} state of this model"
                    )
                if not all_finite(tensor):
                    raise ValueError(f"{where}: layer {layer} {name} holds NaN/inf; delete and re-add it")
            if (tensors[f"delta_sum.{layer}"] < 0).any():
                raise ValueError(
                    f"{where}: layer {layer} ΣΔ is negative (impossible for a real encoding); delete and re-add it"
                )
            if self._layout.extras:
                extras = {}
                for extra in self._layout.extras:
                    tensor = tensors[f"{extra.file_key}.{layer}"]
                    if extra.stored_like_state:  # stored in the storage dtype: it must be that, then is read back
                        if tensor.dtype != self.storage_dtype:
                            raise ValueError(
                                f"{where}: layer {layer} {extra.label} is {tensor.dtype}, not the store's "
                                f"{self.header['storage_dtype']}; delete and re-add it"
                            )
                        tensor = tensor.to(extra.dtype(self._state_template["model_dtype"]))
                    extras[extra.attribute] = tensor
                check_extra_tensors(
                    self._layout,
                    extras,
                    layer,
                    config=self.model.config,
                    model_dtype=self._state_template["model_dtype"],
                    batch=1,
                    device=None,
                    refuse=lambda problem: _refuse_entry(where, problem),
                    rounding=self._transition_rounding,
                )
        if self._attention_layers:
            self._check_entry_keys(where, tensors, num_tokens)
        tokens = tensors["token_ids"]
        if tokens.dtype != torch.long or tuple(tokens.shape) != (1, num_tokens):
            raise ValueError(
                f"{where}: token_ids {tokens.dtype} {tuple(tokens.shape)} do not match its {num_tokens} tokens"
            )

    def _check_entry_keys(self, where: str, tensors: dict, num_tokens: int) -> None:
        """A hybrid entry's attention layers: keys and values in the store's keys dtype, ``[1, kv heads, num_tokens,
        head dim]`` from the model's config, finite; positions int64 ``0 .. num_tokens - 1`` (an entry is one context,
        encoded alone: no padding, every layer at the same positions)."""
        from ..state.serialization import attention_tensor_names

        heads, key_dim, value_dim = self._attention_dims
        expected_positions = torch.arange(num_tokens).unsqueeze(0)
        for i in self._attention_layers:
            keys, values, positions = attention_tensor_names(i)
            for name, kind, head_dim in ((keys, "keys", key_dim), (values, "values", value_dim)):
                tensor = tensors[name]
                if tensor.dtype != self._keys_dtype or tuple(tensor.shape) != (1, heads, num_tokens, head_dim):
                    raise ValueError(
                        f"{where}: layer {i} (attention) {kind} are {tensor.dtype} {tuple(tensor.shape)}, not the "
                        f"{self._keys_dtype} {(1, heads, num_tokens, head_dim)} keys of this model for its {num_tokens} tokens"
                    )
                if not all_finite(tensor):
                    raise ValueError(f"{where}: layer {i} (attention) {kind} hold NaN/inf; delete and re-add it")
            tensor = tensors[positions]
            if tensor.dtype != torch.long or not torch.equal(tensor, expected_positions):
                raise ValueError(
                    f"{where}: layer {i} (attention) positions are not 0 .. {num_tokens - 1} (an entry is one "
                    "context, encoded alone); delete and re-add it"
                )

    # ------------------------------------------------------------------------------------ what each backend implements
    # (BACKEND_METHODS: a backend class lacking one is refused by register_backend and when instantiated)
    def add(
        self,
        texts: Iterable[str],
        metadata: Sequence[dict] | None = None,
        batch_size: int = 16,
        show_progress: bool = True,
    ) -> list[str]:
        """Encode ``texts`` in batches of ``batch_size`` (one forward each) and store them; returns their
        ids, in order. A text already stored with the same metadata is not encoded again: its id is
        returned (ids come from the content, :func:`~hf_statecompose.store.format.content_id`), and
        repeats within one call are one entry."""
        raise NotImplementedError

    def get(self, ids: Sequence[str] | str, device=None) -> list[ComposableMambaCache] | ComposableMambaCache:
        """The verified states of ``ids`` (one id: one state); each state owns its tensors (editing one
        in place changes no other state and nothing stored)."""
        raise NotImplementedError

    def retrieve(
        self, query: str, k: int = 5, exclude: Iterable[str] = (), load_states: bool = True
    ) -> list[StoreEntry]:
        """The ``k`` entries most similar to ``query`` (cosine), best first, with their states."""
        raise NotImplementedError

    def delete(self, ids: Sequence[str] | str, missing_ok: bool = False) -> None:
        """Delete entries, all of them or (a crash included) none: one atomic commit per call; their
        bytes go at the next :meth:`compact`. Ids not in the store are a ``KeyError`` naming them, raised
        before anything changes; with ``missing_ok=True`` they are ignored (a retried delete is a no-op)."""
        raise NotImplementedError

    def compact(self) -> dict:
        """Reclaim the space of deleted entries; returns what it did."""
        raise NotImplementedError

    def entries(self, ids: Sequence[str] | None = None) -> list[StoreEntry]:
        """Text and metadata of entries (no state read); all of them with ``ids=None``."""
        raise NotImplementedError

    def ids(self) -> list[str]:
        """The ids of the entries stored now."""
        raise NotImplementedError

    def refresh(self) -> None:
        """See other processes' commits now."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Entries, bytes and settings of the store."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, entry_id) -> bool:
        raise NotImplementedError


def _refuse_entry(where: str, problem: str):
    raise ValueError(f"{where}: {problem}; delete and re-add it")


def progress_bar(total: int, enabled: bool, desc: str = "encoding contexts", unit: str = "ctx"):
    """A tqdm bar over ``total`` items (contexts encoded by default; silent when ``enabled`` is false or tqdm is missing)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; stay silent without it
        enabled = False
    if enabled:
        return tqdm(total=total, desc=desc, unit=unit)

    class _Silent:
        def update(self, n):
            pass

        def close(self):
            pass

    return _Silent()
