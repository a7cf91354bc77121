"""What the lifecycle's typed lines (`shell_lines.py`, `survivor_lines.py`) share: a record of their fields,
numbers rounded as printed, and the line of such a record. Imports no torch."""

from __future__ import annotations

from dataclasses import asdict


def record_of(line, decimals: dict[str, int]) -> dict:
    """`line`'s record: its kind, then its fields, those named in `decimals` rounded to that many places as
    the line prints them (None stays None)."""
    record = {"kind": line.KIND, **asdict(line)}
    for key, places in decimals.items():
        if record[key] is not None:
            record[key] = float(f"{record[key]:.{places}f}")
    return record


def line_of(cls, record: dict):
    """The `cls` line of a record `record_of` wrote (KeyError, TypeError or ValueError if it is not one: an
    unknown `what` is not a record this program wrote)."""
    line = cls(**{k: v for k, v in record.items() if k != "kind"})
    line.line()
    return line
