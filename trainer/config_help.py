"""Every config key with its type, default and doc, for `train.py --help`, and a config as TOML
(`--print-config`). One source of truth: the config dataclasses, whose field comments are the docs."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import json
import math
import re
import textwrap
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path

from trainer.config import Config, choices


@dataclass(frozen=True)
class KeyDoc:
    key: str  # section.name
    type: str
    default: object
    doc: str


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its comment} of a dataclass, inherited fields included (`_declared_docs`)."""
    docs: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        docs.update(_declared_docs(base))
    return docs


def _declared_docs(cls: type) -> dict[str, str]:
    """{field: its comment} of the fields a dataclass declares itself: the comment ending the field's line,
    else the comment lines right above it (a heading above a group of fields is therefore never a field's
    doc when the field has its own comment); "" for a field without either."""
    above: dict[str, str] = {}
    trailing: dict[str, str] = {}
    lines: list[str] = []
    line_of_name: dict[int, str] = {}
    source = textwrap.dedent(inspect.getsource(cls))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            name = line_of_name.get(token.start[0])
            if name is None:
                lines.append(text)
            else:
                trailing[name] = text
        elif token.type == tokenize.NAME and token.start[1] == 4 and token.start[0] not in line_of_name:
            line_of_name[token.start[0]] = token.string
            above[token.string] = " ".join(lines)
            lines = []
        elif token.type == tokenize.NL and token.line.strip() == "":
            lines = []
    docs = {name: trailing.get(name) or text for name, text in above.items()}
    names = set(cls.__annotations__)
    return {name: doc for name, doc in docs.items() if name in names}


def config_keys(cfg: Config | None = None) -> list[KeyDoc]:
    """Every key of every section, in declaration order, with `cfg`'s values (default: the defaults)."""
    cfg = cfg or Config()
    out = []
    for section in dataclasses.fields(cfg):
        obj = getattr(cfg, section.name)
        hints = typing.get_type_hints(type(obj))
        docs = field_docs(type(obj))
        for f in dataclasses.fields(obj):
            key = f"{section.name}.{f.name}"
            doc, allowed = docs.get(f.name, ""), choices(hints[f.name])
            if allowed and "|" not in doc:
                doc = f"{doc} ({' | '.join(allowed)})".strip()
            kind = type(allowed[0]) if allowed else hints[f.name]
            out.append(KeyDoc(key, kind.__name__, getattr(obj, f.name), doc))
    return out


def help_text() -> str:
    """The `--help` epilog: every section and key, `--section.key value` to override."""
    lines = ["config keys (override any with --section.key value; defaults shown):"]
    section = None
    for k in config_keys():
        name, _, field = k.key.partition(".")
        if name != section:
            section = name
            lines.append(f"\n  [{name}]")
        lines.append(f"    {field} ({k.type}, default {toml_value(k.default)}){': ' + k.doc if k.doc else ''}")
    return "\n".join(lines)


def to_toml(cfg: Config) -> str:
    """`cfg` as a TOML document that `load_config` reads back into an equal Config."""
    lines, section = [], None
    for k in config_keys(cfg):
        name, _, field = k.key.partition(".")
        if name != section:
            lines.append(f"{'' if section is None else chr(10)}[{name}]")
            section = name
        lines.append(f"{field} = {toml_value(k.default)}")
    return "\n".join(lines) + "\n"


def toml_value(value: object) -> str:
    """A TOML literal of a bool, int, float or str (JSON's string escapes are valid TOML)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))


def markdown_tables() -> str:
    """Every section as a Markdown table (key, type, default, doc): the key reference of docs/configuration.md."""
    out, section = [], None
    for k in config_keys():
        name, _, _ = k.key.partition(".")
        if name != section:
            out += [*([""] if section else []), f"### `[{name}]`", "", "| key | type | default | meaning |"]
            out.append("|---|---|---|---|")
            section = name
        doc = k.doc.replace("|", "\\|").replace("<", "\\<")
        out.append(f"| `{k.key}` | {k.type} | `{toml_value(k.default)}` | {doc} |")
    return "\n".join(out) + "\n"


GENERATED = re.compile(r"(<!-- BEGIN GENERATED KEYS -->\n)(.*?)(<!-- END GENERATED KEYS -->)", re.S)
REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def generated_block(text: str) -> str:
    """The generated key tables inside a document's markers ("" without markers)."""
    m = GENERATED.search(text)
    return m[2] if m else ""


if __name__ == "__main__":  # rewrite the key tables of docs/configuration.md
    REFERENCE.write_text(GENERATED.sub(lambda m: m[1] + markdown_tables() + m[3], REFERENCE.read_text()))
    print(f"updated {REFERENCE}")
