"""Reasoning models' thinking, split from the answer: ``--reasoning-parser qwen3`` sends what is
inside ``<think>...</think>`` to ``reasoning_content`` and the rest to ``content``.

Like the tool parsers, it reads the whole text so far and returns both parts, holding back a
partial tag at the end while the text is still growing, so successive parses only ever extend
what was already sent.
"""

from __future__ import annotations

from .tool_parsers import partial_tag_len

PARSERS = ("qwen3",)
THINK_START = "<think>"
THINK_END = "</think>"


def split_qwen3(text: str, final: bool) -> tuple[str, str]:
    """``(reasoning, content)``. Thinking is recognised when the output opens with ``<think>``
    (or, once finished, when a ``</think>`` closes thinking the template opened)."""
    end = text.find(THINK_END)
    if end >= 0:
        reasoning = text[:end]
        if reasoning.lstrip().startswith(THINK_START) or final:
            reasoning = reasoning.lstrip().removeprefix(THINK_START)
            return reasoning.strip("\n"), text[end + len(THINK_END) :].lstrip("\n")
    body = text.lstrip()
    if body.startswith(THINK_START):
        inner = body[len(THINK_START) :]
        return inner.lstrip("\n")[
            : len(inner.lstrip("\n")) - (0 if final else partial_tag_len(inner, THINK_END))
        ], ""
    if not final and THINK_START.startswith(body):
        return "", ""
    return "", text


class ReasoningStream:
    """Successive splits of one choice's growing text as ``(reasoning delta, content so far)``."""

    def __init__(self) -> None:
        self._sent = 0

    def delta(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = split_qwen3(text, final)
        new = reasoning[self._sent :]
        self._sent = max(self._sent, len(reasoning))
        return new, content
