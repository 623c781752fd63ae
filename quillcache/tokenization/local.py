"""Tokenizers shared by the engine simulator and the gateway's local tokenization.

`ByteTokenizer` (the default) maps every UTF-8 byte to its value: deterministic,
stable across versions and processes, and invertible, so a re-tokenized answer gives
back exactly the ids that were generated (as a real multi-turn chat mostly does).
`HFTokenizer` loads a Hugging Face tokenizer.json (and the chat template from a
tokenizer_config.json next to it, rendered with jinja2).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from quillcache.errors import ConfigError

Message = dict[str, Any]


class Tokenizer(Protocol):
    name: str  # identity for the namespace ("" when implied by the model)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool
    ) -> str: ...


def message_text(content: Any) -> str:
    """Text of an OpenAI message content: a string or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    raise TypeError(f"message content must be a string or a list of parts, not {type(content)}")


class ByteTokenizer:
    """One token per UTF-8 byte; a tiny fixed chat template."""

    name = ""
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode(errors="replace")

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        parts = [f"<|{m.get('role', 'user')}|>{message_text(m.get('content'))}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>")
        return "".join(parts)


class HFTokenizer:
    """A `tokenizers` tokenizer.json, with the chat template of tokenizer_config.json."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"tokenizer file {file} does not exist")
        try:
            self._tok = _Tok.from_file(str(file))
        except Exception as exc:
            raise ConfigError(f"cannot load tokenizer {file}: {exc}") from exc
        self.name = ""
        self._template = None
        self._special: dict[str, str] = {}
        config = file.parent / "tokenizer_config.json"
        if config.is_file():
            data = json.loads(config.read_text())
            template = data.get("chat_template")
            if template:
                import jinja2

                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
                self._template = env.from_string(template)
            for key in ("bos_token", "eos_token"):
                value = data.get(key)
                self._special[key] = (
                    value.get("content", "") if isinstance(value, dict) else value or ""
                )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        if self._template is None:
            return ByteTokenizer().apply_chat_template(messages, add_generation_prompt)
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **self._special
        )


def load_tokenizer(spec: str | None) -> Tokenizer:
    """`None`/"builtin" -> ByteTokenizer; anything else is a tokenizer.json path or its folder."""
    if spec in (None, "", "builtin"):
        return ByteTokenizer()
    return HFTokenizer(spec)
