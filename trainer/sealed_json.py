"""Sealed JSON files: a JSON object carrying, under ``"seal"``, the sha256 of the rest of it.

The files a load trusts and a person may read (a prepared corpus's ``token_index.json``, a dense
checkpoint's ``meta.json``) are written sealed, so that a flipped bit or an edit anywhere in them (a step,
a file's hash, the shards' order) is refused before any of it is used. The seal is a hash, not a
signature: it catches damage and careless edits, not an adversary who recomputes it.
"""

from __future__ import annotations

import hashlib
import json

SEAL = "seal"


def seal_of(record: dict) -> str:
    """The sha256 of `record`'s canonical JSON (sorted keys, no spaces) without its ``"seal"`` entry."""
    body = {key: value for key, value in record.items() if key != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(record: dict) -> dict:
    """`record` with its seal added (any older seal replaced)."""
    return {**{key: value for key, value in record.items() if key != SEAL}, SEAL: seal_of(record)}


def seal_holds(record: dict) -> bool:
    """Whether `record` carries the seal of its own contents."""
    return record.get(SEAL) == seal_of(record)
