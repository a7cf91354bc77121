"""Sealed records: a JSON record with the XXH3-64 of its bytes in front, checked before it is parsed.

Every commit record, manifest and header this program writes into host state or sends over the network is
sealed (`{"xxh3": "<hex>", "record": ...}`), so a changed scalar, entry or identity is refused before
anything reads it; the tensors carry hashes of their own inside the record (docs/design/safety.md).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import xxhash


class SealError(RuntimeError):
    """A sealed record whose hash or framing does not hold; the message names where it came from."""


_SEAL_HEAD, _SEAL_MID = b'{"xxh3": "', b'", "record": '
DIGEST_AT = len(_SEAL_HEAD)  # where a sealed record's digest begins
RECORD_AT = DIGEST_AT + 16 + len(_SEAL_MID)  # where the record itself begins

Record = bytes | Sequence[bytes]  # a JSON record's bytes: whole, or as the parts that make it up in order


def seal_parts(record: Record) -> list[bytes]:
    """`seal(record)` as consecutive parts, the record's own among them: a writer hands them to one `writev`
    and never joins them. Joining a ~1 MB commit record (a layout's entries, then the iteration's fields)
    copies it into fresh pages, which costs the training thread more than hashing and writing it."""
    parts = [record] if isinstance(record, bytes) else list(record)
    digest = xxhash.xxh3_64()
    for part in parts:
        digest.update(part)
    return seal_frame(digest.hexdigest().encode(), parts)


def seal_frame(digest: bytes, parts: Sequence[bytes]) -> list[bytes]:
    """The parts of a sealed record whose `parts` have this `digest` (XXH3-64, 16 hex digits), in order: the
    digest is the second part, and the record's own parts start at byte `RECORD_AT`."""
    return [_SEAL_HEAD, digest, _SEAL_MID, *parts, b"}"]


def seal(record: Record) -> bytes:
    """A JSON record (`encode_json` bytes, or their parts) with its XXH3-64 in front: `{"xxh3": "<hex>",
    "record": ...}`. Every commit record and manifest is written sealed, so a changed scalar, entry or identity
    is caught before anything reads it (the tensors carry hashes of their own, in the record)."""
    return b"".join(seal_parts(record))


def sealed_record(raw: bytes, where: object) -> bytes:
    """The record inside `seal`ed bytes, its hash verified; SealError naming `where` otherwise."""
    digest_end = len(_SEAL_HEAD) + 16
    record = raw[digest_end + len(_SEAL_MID) : -1]
    framed = raw.startswith(_SEAL_HEAD) and raw[digest_end:].startswith(_SEAL_MID) and raw.endswith(b"}")
    if not framed:
        raise SealError(f"{where}: unreadable header (not a sealed record of this program)")
    if xxhash.xxh3_64_hexdigest(record).encode() != raw[len(_SEAL_HEAD) : digest_end]:
        raise SealError(f"{where}: header hash mismatch (the header was changed or corrupted)")
    return record


def unseal(raw: bytes, where: object) -> dict:
    """The JSON object `seal`ed in `raw`, verified (SealError naming `where` otherwise)."""
    try:
        header = json.loads(sealed_record(raw, where))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SealError(f"{where}: unreadable header ({e})") from None
    if not isinstance(header, dict):
        raise SealError(f"{where}: unreadable header (not a JSON object)")
    return header
