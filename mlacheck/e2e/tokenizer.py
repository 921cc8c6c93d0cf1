"""Tokenizers of the e2e runner: the small model's character-level vocabulary (committed as
JSON), or a real checkpoint's Hugging Face `tokenizer.json` (through the `tokenizers`
package, imported lazily).

Both files are called `tokenizer.json`; the character vocabulary is told apart by its
`"mlacheck_char_tokenizer"` key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from mlacheck.e2e.config import E2EError

CHAR_FORMAT_KEY = "mlacheck_char_tokenizer"
CHAR_FORMAT_VERSION = 1
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
# Newline plus printable ASCII: everything the problem generator writes (and GSM8K's own
# questions, bar a few non-ASCII symbols, which map to <unk>).
DEFAULT_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    """One token per character; ids 0..3 are <pad>, <bos>, <eos>, <unk>."""

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise E2EError("character vocabulary has duplicates")
        self.chars = chars
        self.pad_token_id, self.bos_token_id, self.eos_token_id, self.unk_token_id = 0, 1, 2, 3
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        unk = self.unk_token_id
        ids = [self._ids.get(c, unk) for c in text]
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        n = len(SPECIALS)
        return "".join(self.chars[i - n] for i in ids if n <= i < self.vocab_size)

    def to_json(self) -> dict[str, Any]:
        return {
            CHAR_FORMAT_KEY: CHAR_FORMAT_VERSION,
            "specials": list(SPECIALS),
            "chars": list(self.chars),
        }

    def save(self, path: Path | str) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CharTokenizer:
        if data.get(CHAR_FORMAT_KEY) != CHAR_FORMAT_VERSION or list(
            data.get("specials", [])
        ) != list(SPECIALS):
            raise E2EError("not an mlacheck character tokenizer (version 1)")
        return cls("".join(data["chars"]))


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (a real checkpoint's), with BOS/EOS from
    `tokenizer_config.json` or the model config."""

    def __init__(self, directory: Path, bos: int | None, eos: int | None) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:
            raise E2EError(
                "this checkpoint has a Hugging Face tokenizer.json: pip install tokenizers"
            ) from None
        self._tok = _Tok.from_file(str(directory / "tokenizer.json"))
        cfg = _read_json(directory / "tokenizer_config.json") or {}
        self.bos_token_id = self._special(cfg.get("bos_token"), bos)
        self.eos_token_id = self._special(cfg.get("eos_token"), eos)
        self.add_bos = bool(cfg.get("add_bos_token", True))

    def _special(self, entry: Any, fallback: int | None) -> int | None:
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str):
            tid = self._tok.token_to_id(content)
            if tid is not None:
                return int(tid)
        return fallback

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise E2EError(f"cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else None


def load_tokenizer(
    directory: Path | str, bos: int | None = None, eos: int | None = None
) -> CharTokenizer | HFTokenizer:
    """The tokenizer of a model directory (`tokenizer.json`, either kind)."""
    d = Path(directory)
    data = _read_json(d / "tokenizer.json")
    if data is None:
        raise E2EError(f"{d} has no tokenizer.json")
    if CHAR_FORMAT_KEY in data:
        return CharTokenizer.from_json(data)
    return HFTokenizer(d, bos, eos)
