"""Incremental detokenization that never emits a broken UTF-8 character.

Each step decodes a short window of tokens before and after the read offset and emits only
the new suffix, holding it back while it ends in U+FFFD (an incomplete multi-byte
character). ``finish`` flushes the rest so the stream ends equal to the full decode.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; returns the text that became final."""
        self.token_ids.extend(token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.text += new
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return new

    def finish(self) -> str:
        """Emit whatever is still held back, so ``text`` equals the decode of all tokens."""
        full = self._decode(self.token_ids)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += rest
        self._read_offset = len(self.token_ids)
        return rest
