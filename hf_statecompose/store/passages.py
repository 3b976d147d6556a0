"""Passages files: one JSON object per line with a text field (the rest of the object is metadata)."""

from __future__ import annotations

import json


def parse_passages_jsonl(text: str, where: str, text_field: str = "text") -> tuple[list[str], list[dict]]:
    """``(texts, metadata)`` of ``.jsonl`` content: one ``{"text": ..., ...}`` (or a bare string) per
    line, blank lines skipped. ``ValueError`` naming ``where`` and the line on anything else."""
    texts, metadata = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}:{number}: not JSON ({error})") from None
        if isinstance(record, str):
            record = {text_field: record}
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str) or not record[text_field]:
            raise ValueError(f"{where}:{number}: expected an object with a non-empty string field {text_field!r}")
        texts.append(record.pop(text_field))
        metadata.append(record)
    if not texts:
        raise ValueError(f"{where} holds no passages")
    return texts, metadata
