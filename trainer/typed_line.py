"""What the trainer's typed console lines share (docs/design/event-records.md): each is a frozen
dataclass whose `line()` is the console line byte for byte, whose `record()` is the JSON object the run
record keeps of it (`trainer/records/event_log.py`): its `kind`, then its fields, numbers rounded as the line
prints them (`ROUNDED`: field -> decimals), tuples as lists; and whose `from_record(record)` is the line
again. Imports no torch (the rank shell's lines are typed lines too)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar


class TypedLine:
    """The record of a typed line's plain fields (see the module docstring); a subclass names its `KIND`,
    the fields it rounds, and its `line()`."""

    KIND: ClassVar[str]
    ROUNDED: ClassVar[dict[str, int]] = {}

    def line(self) -> str:
        raise NotImplementedError

    def record(self) -> dict:
        """The run record's JSON object of this line."""
        record = {"kind": self.KIND}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.ROUNDED and value is not None:
                value = float(f"{value:.{self.ROUNDED[f.name]}f}")
            record[f.name] = list(value) if isinstance(value, tuple) else value
        return record

    @classmethod
    def from_record(cls, record: dict):
        """The line of a record `record()` wrote (KeyError, TypeError or ValueError if it is not one: a line
        that cannot print, such as an unknown `what`, is not a record this program wrote)."""
        values = {k: v for k, v in record.items() if k != "kind"}
        for f in dataclasses.fields(cls):
            if isinstance(values.get(f.name), list):
                values[f.name] = tuple(values[f.name])
        line = cls(**values)
        line.line()
        return line
