"""The tokenizer files of a Hugging Face export, which ``AutoTokenizer.from_pretrained`` loads.

``tokenizer.json`` is the run's tokenizer: its file, or for the byte tokenizer (``data.tokenizer = "byte"``)
an equivalent byte-level BPE (byte b is id b, ``</s>`` is 256). ``tokenizer_config.json`` declares the
special tokens as the source defines them: those of the ``tokenizer_config.json`` beside the run's
``tokenizer.json`` (a Hugging Face model directory's: ``bos_token``, ``eos_token``, ``pad_token``,
``unk_token``, and ``add_bos_token``/``add_eos_token``), else the end of sequence the trainer separates
documents with (the byte tokenizer's only special token). Their ids go into ``config.json`` and
``generation_config.json`` too (:func:`special_token_ids`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from trainer.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, build_tokenizer
from trainer.hf_errors import HFError

BYTE_EOS = "</s>"
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
FLAGS = ("add_bos_token", "add_eos_token")
CONFIG_TOKENS = ("bos_token", "eos_token", "pad_token")  # those config.json and generation_config.json name


def byte_level_tokenizer():
    """A ``tokenizers`` Tokenizer like :class:`trainer.data.tokenizer.ByteTokenizer` (byte b is id b; `</s>` 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the others for code points 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _source_config(tok: HFTokenizer, token_id) -> dict:
    """The special tokens and flags of the ``tokenizer_config.json`` beside ``tok``'s file ({} without one), each
    token checked to be in the tokenizer (``token_id(text)``: its id or None)."""
    path = tok.path.parent / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        source = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise HFError(f"{path}: unreadable ({e})") from None
    if not isinstance(source, dict):
        raise HFError(f"{path}: not a JSON object")
    out = {}
    for key in SPECIAL_TOKENS:
        value = source.get(key)
        text = value.get("content") if isinstance(value, dict) else value  # an AddedToken is saved as a dict
        if text is None:
            continue
        if not isinstance(text, str) or token_id(text) is None:
            raise HFError(f"{path}: {key} {text!r} is not a token of {tok.path}")
        out[key] = text
    out |= {key: source[key] for key in FLAGS if isinstance(source.get(key), bool)}
    return out


def write_tokenizer(directory: Path, spec: str, max_seq_len: int) -> dict[str, int | None]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the run's tokenizer ``spec`` (``data.tokenizer``) in
    ``directory``; the ids of its special tokens (:func:`special_token_ids`)."""
    try:
        tok = build_tokenizer(spec)
    except TokenizerError as e:
        raise HFError(f"checkpoint tokenizer: {e}") from None
    if isinstance(tok, ByteTokenizer):
        byte_level_tokenizer().save(str(directory / "tokenizer.json"))
        special, ids = {"eos_token": BYTE_EOS}, {BYTE_EOS: ByteTokenizer.eos_id}
    else:
        from tokenizers import Tokenizer

        assert isinstance(tok, HFTokenizer)
        token_id = Tokenizer.from_file(str(tok.path)).token_to_id  # the file HFTokenizer has just read
        shutil.copyfile(tok.path, directory / "tokenizer.json")
        special = {"eos_token": tok.eos_token} | _source_config(tok, token_id)
        ids = {text: token_id(text) for key, text in special.items() if key in SPECIAL_TOKENS}
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_seq_len} | special
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return special_token_ids(special, ids)


def special_token_ids(special: dict, ids: dict[str, int]) -> dict[str, int | None]:
    """``{"bos_token_id": ..., "eos_token_id": ..., "pad_token_id": ...}`` (None where the tokenizer has none), as
    ``config.json`` and ``generation_config.json`` name them."""
    return {f"{key}_id": ids[special[key]] if key in special else None for key in CONFIG_TOKENS}
