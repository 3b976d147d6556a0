"""``migrate``: copy a folder store into a Lance store, every entry verified on the way back."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch

from ..state.serialization import _digest
from .base import progress_bar
from .folder import FolderStateStore
from .format import canonical, check_count
from .lance import LanceStateStore, row_seal


def migrate(
    source,
    destination,
    model,
    tokenizer,
    retriever: Callable | None = None,
    batch_size: int = 64,
    show_progress: bool = True,
    **lance_options,
) -> dict:
    """Copy the folder store ``source`` into a Lance store at ``destination`` (created, or extended:
    ids already there are skipped), then read every entry back from the Lance store, verified, and
    compare it with the folder store's: states bit for bit, text, metadata, token count, embedding.
    Returns counts; any difference is a ``ValueError``. Embeddings are copied, not recomputed."""
    if not (os.path.isdir(source) and os.path.isfile(os.path.join(source, "store.json"))):
        raise ValueError(f"no store at {source} (a folder store holds store.json)")
    if "://" not in os.fspath(destination) and os.path.isfile(os.path.join(destination, "store.json")):
        raise ValueError(
            f"{destination} holds a folder store: give a new folder (or an existing Lance store) as the destination"
        )
    folder = FolderStateStore(source, model, tokenizer, retriever=retriever)
    batch_size = check_count(batch_size, "batch_size", 1)
    lance = LanceStateStore(
        destination,
        model,
        tokenizer,
        retriever=folder.retriever,
        storage_dtype=folder.header["storage_dtype"],
        info=folder.header.get("info") or {},
        **lance_options,
    )
    if folder.header.get("embedding_dim") not in (None, lance.embedding_dim):
        raise ValueError(
            f"{source} holds {folder.header['embedding_dim']}-dim embeddings, the Lance store {lance.embedding_dim}-dim ones"
        )
    with folder._locked(shared=True):
        folder.refresh()
        flat_ids, matrix = folder._flat_index()
        vectors = {entry_id: matrix[n] for n, entry_id in enumerate(flat_ids)}
        ids = sorted(flat_ids)
        copied = verified = 0
        from safetensors.torch import save

        progress = progress_bar(len(ids), show_progress, desc="copying entries", unit="entry")
        try:
            for start in range(0, len(ids), batch_size):
                chunk = ids[start : start + batch_size]
                present = set(lance._rows(chunk, ["id"]))
                todo = [i for i in chunk if i not in present]
                if todo:
                    states = folder.get(todo, device="cpu")
                    records = folder.entries(todo)
                    columns: dict[str, list] = {name: [] for name in lance._schema(lance.embedding_dim).names}
                    for entry_id, record, state in zip(todo, records, states):
                        tokens = state.token_ids[0].tolist()
                        tensors = lance._entry_tensors(state, 0, tokens)
                        tensors["num_tokens"] = torch.tensor([len(tokens)], dtype=torch.long)
                        digest = _digest(tensors)
                        blob = save(
                            tensors,
                            metadata={
                                "hf_statecompose": json.dumps(
                                    {**lance._blob_meta, "tensor_digest": digest}, default=repr
                                )
                            },
                        )
                        vector = vectors[entry_id].contiguous()
                        meta_json = canonical(record.metadata).decode()
                        for name, value in (
                            ("id", entry_id),
                            ("text", record.text),
                            ("metadata", meta_json),
                            ("num_tokens", record.num_tokens),
                            ("vector", vector.tolist()),
                            ("state", blob),
                            ("tensor_digest", digest),
                            (
                                "seal",
                                row_seal(
                                    entry_id,
                                    record.text,
                                    meta_json,
                                    record.num_tokens,
                                    vector.numpy().tobytes(),
                                    digest,
                                ),
                            ),
                        ):
                            columns[name].append(value)
                    lance.write_rows(
                        lance._pa.table(columns, schema=lance._schema(lance.embedding_dim)), skip_existing=True
                    )
                    copied += len(todo)
                progress.update(len(chunk))
            progress.close()
            progress = progress_bar(len(ids), show_progress, desc="verifying entries", unit="entry")
            for start in range(0, len(ids), batch_size):
                chunk = ids[start : start + batch_size]
                ours, theirs = folder.get(chunk, device="cpu"), lance.get(chunk, device="cpu")
                mine, copies = folder.entries(chunk), lance.entries(chunk)
                rows = lance._rows(chunk, ["id", "vector"])
                for entry_id, a, b, ra, rb in zip(chunk, ours, theirs, mine, copies):
                    same = (
                        (ra.text, ra.metadata, ra.num_tokens) == (rb.text, rb.metadata, rb.num_tokens)
                        and torch.equal(torch.tensor(rows[entry_id]["vector"], dtype=torch.float32), vectors[entry_id])
                        and _same_state(a, b)
                    )
                    if not same:
                        raise ValueError(
                            f"entry {entry_id} differs between {source} and the Lance store at {destination} after the copy"
                        )
                    verified += 1
                progress.update(len(chunk))
        finally:
            progress.close()
    return {
        "entries": len(ids),
        "copied": copied,
        "already_there": len(ids) - copied,
        "verified": verified,
        "destination": lance.uri,
    }


def _same_state(a, b) -> bool:
    if (
        a.num_layers != b.num_layers
        or not torch.equal(a.token_ids, b.token_ids)
        or a.num_tokens.tolist() != b.num_tokens.tolist()
    ):
        return False
    for layer in range(a.num_layers):
        pairs = [
            (a.ssm_states[layer], b.ssm_states[layer]),
            (a.conv_states[layer], b.conv_states[layer]),
            (a.delta_sums[layer], b.delta_sums[layer]),
            (a.A[layer], b.A[layer]),
        ]
        if not all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs):
            return False
    for x, y in zip(getattr(a, "attention_layers", ()), getattr(b, "attention_layers", ())):  # a hybrid's keys
        if not all(
            u.dtype == v.dtype and torch.equal(u, v)
            for u, v in ((x.keys, y.keys), (x.values, y.values), (x.positions, y.positions))
        ):
            return False
    return True
