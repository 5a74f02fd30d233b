"""Routing decisions, as pure functions over what the proxy knows: no I/O, no clocks.

The proxy cannot see the engines' prefix caches, so it keeps its own record of the prompt
text it has recently sent to each engine (hashed chunks in a bounded LRU): an engine that
has seen a long common prefix probably still holds those KV blocks, and sending the request
there saves recomputing them. That affinity is traded against load (requests the proxy has
in flight there plus the queue the engine reports), so a hot prefix does not pile every
request onto one engine.

The same estimate decides conditional disaggregation: when the part of the prompt a decode
engine would have to compute is short, moving KV blocks between engines costs more than
computing them in place, so the request goes straight to that engine.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

CHUNK_CHARS = 64
CHARS_PER_TOKEN = 4
# Chat templates add a few tokens per message (role markers, separators).
TOKENS_PER_MESSAGE = 4

POLICIES = ("score", "least_load", "round_robin")


# ----- the prompt as text -----------------------------------------------------------------
def prompt_text(kind: str, body: dict[str, Any]) -> str:
    """The text the engine will prefill, as well as the proxy can tell without a tokenizer.

    For chat it is the messages in order with their roles (what the template renders,
    minus the template's own markers); for completions the prompt itself. Only its prefix
    structure matters: two requests sharing a conversation's opening share this text's
    opening too.
    """
    if kind in ("chat", "ollama_chat"):
        parts = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(
                    t
                    for p in content
                    if isinstance(p, dict) and isinstance(t := p.get("text"), str)
                )
            elif content is not None and not isinstance(content, str):
                content = json.dumps(content, sort_keys=True)
            parts.append(f"<{m.get('role', '')}>{content or ''}")
        return "\n".join(parts)
    prompt = body.get(_PROMPT_FIELD.get(kind, "prompt"), "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return " ".join(map(str, prompt))  # token ids: each id is roughly a token, keep them apart
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return ""


_PROMPT_FIELD = {
    "embeddings": "input",
    "pooling": "input",
    "encode": "input",
    "generate": "prompt",
    "ollama_embed": "input",
}


def estimate_tokens(kind: str, body: dict[str, Any], text: str | None = None) -> int:
    """Prompt tokens, estimated as ``len(text) // 4`` (plus the chat template's overhead).

    Token ids given as the prompt are counted exactly.
    """
    prompt = body.get("input_ids" if kind == "generate" else "prompt")
    if kind in ("completions", "generate"):
        if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            return len(prompt)
    text = prompt_text(kind, body) if text is None else text
    n = len(text) // CHARS_PER_TOKEN
    if kind in ("chat", "ollama_chat"):
        n += TOKENS_PER_MESSAGE * len(body.get("messages") or [])
    return n


def chain_root(model: str | None, adapters: Collection[str]) -> bytes:
    """Where a request's chunk chain starts: a LoRA adapter's from its name, so no two
    adapters (nor an adapter and the base) ever share a prefix, as on the engine."""
    return b"lora\0" + model.encode() if model is not None and model in adapters else b""


def chunk_hashes(text: str, chunk_chars: int = CHUNK_CHARS, root: bytes = b"") -> list[bytes]:
    """A hash chain over the text's full ``chunk_chars``-character chunks, from ``root``.

    Each hash covers everything before it, so equal hashes at position i mean equal
    prefixes of ``(i + 1) * chunk_chars`` characters, as the engine's block hashes do. A
    LoRA adapter's requests chain from its name (``root``), as the engine's blocks chain
    from the adapter: an engine holds no prefix computed through another adapter.
    """
    out: list[bytes] = []
    parent = root
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(
            parent + text[start : start + chunk_chars].encode(), digest_size=12
        ).digest()
        out.append(parent)
    return out


class PrefixIndex:
    """Which prompt chunks the proxy sent to which engine recently; bounded per engine (LRU)."""

    def __init__(self, capacity_per_node: int = 4096, chunk_chars: int = CHUNK_CHARS) -> None:
        self.capacity = capacity_per_node
        self.chunk_chars = chunk_chars
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, node: str, chunks: Sequence[bytes]) -> None:
        lru = self._seen.setdefault(node, OrderedDict())
        for h in chunks:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)

    def matched_chunks(self, node: str, chunks: Sequence[bytes]) -> int:
        """How many leading chunks of the prompt this engine has seen."""
        lru = self._seen.get(node)
        if not lru:
            return 0
        n = 0
        for h in chunks:
            if h not in lru:
                break
            n += 1
        return n

    def matched_tokens(self, node: str, chunks: Sequence[bytes]) -> int:
        return self.matched_chunks(node, chunks) * self.chunk_chars // CHARS_PER_TOKEN

    def forget(self, node: str) -> None:
        self._seen.pop(node, None)

    def __len__(self) -> int:
        return sum(len(v) for v in self._seen.values())


class SessionTable:
    """``session_id`` -> the engine holding the session's blocks; bounded LRU."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._map: OrderedDict[str, str] = OrderedDict()

    def get(self, session_id: str) -> str | None:
        node = self._map.get(session_id)
        if node is not None:
            self._map.move_to_end(session_id)
        return node

    def set(self, session_id: str, node: str) -> None:
        self._map[session_id] = node
        self._map.move_to_end(session_id)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)

    def forget(self, session_id: str) -> None:
        self._map.pop(session_id, None)

    def forget_node(self, node: str) -> None:
        for sid in [s for s, n in self._map.items() if n == node]:
            del self._map[sid]

    def __len__(self) -> int:
        return len(self._map)


# ----- scoring ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One routable engine as the scorer sees it."""

    url: str
    load: int  # requests the proxy has in flight there + the engine's reported waiting queue
    cached_tokens: int = 0  # estimated prompt tokens this engine likely holds
    kv_layout: str | None = None  # a prefill engine hands KV only to a decode of its layout


class Routable(Protocol):
    """What the scorer reads of a node (``registry.Node``), whichever front door holds it."""

    url: str
    kv_layout: str | None

    @property
    def load(self) -> int: ...


R = TypeVar("R", bound=Routable)


def candidates(
    nodes: Sequence[R],
    prefix: PrefixIndex,
    chunks: Sequence[bytes],
    load: Callable[[R], int] = lambda n: n.load,
) -> list[Candidate]:
    """The nodes as the scorer sees them: their load (``load``: what this front door knows
    of it; the proxy's ``Node.load`` by default) and the prompt tokens they likely hold."""
    return [
        Candidate(n.url, load(n), prefix.matched_tokens(n.url, chunks), n.kv_layout) for n in nodes
    ]


def score(c: Candidate, prompt_tokens: int, load_weight: float = 0.25) -> float:
    """Affinity (share of the prompt likely cached there, 0..1) minus ``load_weight`` per queued
    request: a full prefix hit is worth skipping ~4 requests of queue, a 25% hit one."""
    affinity = min(c.cached_tokens, prompt_tokens) / prompt_tokens if prompt_tokens > 0 else 0.0
    return affinity - load_weight * c.load


def pick(
    candidates: Sequence[Candidate], prompt_tokens: int, policy: str = "score", turn: int = 0
) -> Candidate | None:
    """The best candidate under ``policy``; ties go to the first listed (callers list in a stable order).

    ``turn`` is a counter for round robin, advanced by the caller.
    """
    if not candidates:
        return None
    if policy == "round_robin":
        return candidates[turn % len(candidates)]
    if policy == "least_load":
        return min(candidates, key=lambda c: c.load)
    if policy != "score":
        raise ValueError(f"unknown routing policy {policy!r}; use one of {', '.join(POLICIES)}")
    best = candidates[0]
    best_score = score(best, prompt_tokens)
    for c in candidates[1:]:
        s = score(c, prompt_tokens)
        if s > best_score:
            best, best_score = c, s
    return best


def uncached_tokens(prompt_tokens: int, cached_tokens: int) -> int:
    """What an engine would still have to prefill (at least the last token)."""
    return max(1, prompt_tokens - cached_tokens) if prompt_tokens > 0 else 0


def should_disaggregate(prompt_tokens: int, cached_on_decode: int, threshold: int) -> bool:
    """Disaggregate when the decode engine would have to prefill ``threshold`` tokens or more.

    ``threshold`` 0 disaggregates everything (when a prefill engine exists).
    """
    return uncached_tokens(prompt_tokens, cached_on_decode) >= threshold


# Routes served whole on one engine, and why.
NOT_HANDED_OFF = {
    "generate": "the P/D handoff speaks OpenAI's request and response shapes",
    "ollama_generate": "the P/D handoff speaks OpenAI's request and response shapes",
    "ollama_chat": "the P/D handoff speaks OpenAI's request and response shapes",
}


def disaggregatable(kind: str, body: dict[str, Any]) -> str | None:
    """Why this request must run on one engine, or None when P/D can serve it.

    The two-step flow hands one sequence's KV from one prefill to one decode: several
    choices or prompts, per-token logprobs of the first token and prompt logprobs (both
    computed on the prefill side), stay on one engine.
    """
    if kind not in ("chat", "completions"):
        return NOT_HANDED_OFF.get(kind, "no generation")
    n = body.get("n")
    if isinstance(n, int) and n > 1:
        return "n > 1"
    best_of = body.get("best_of")
    if isinstance(best_of, int) and best_of > 1:
        return "best_of > 1"
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs"):
        return "logprobs"
    if body.get("prompt_logprobs") is not None:  # the prompt's logits are the prefill's
        return "prompt_logprobs"
    if kind == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
            if len(prompt) > 1:
                return "several prompts"
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens == 1:
        return "max_tokens is 1"  # the prefill engine's one token is the whole answer
    return None


@dataclass(frozen=True)
class Plan:
    """Where one request goes: its decode (or aggregated) engine, the prompt tokens that engine
    likely holds, and the prefill engine when it should run prefill -> decode."""

    decode: Candidate
    prefill: Candidate | None = None


def plan(
    decoders: Sequence[Candidate],
    prefillers: Sequence[Candidate],
    prompt_tokens: int,
    *,
    policy: str = "score",
    turn: int = 0,
    disagg_threshold: int = 32,
    why_not: str | None = None,
) -> Plan | None:
    """The one routing decision both front doors take (the proxy, the gateway's picker): the
    best decode engine, then, when the request can be split (``why_not`` None) and that
    engine would prefill ``disagg_threshold`` tokens or more, the best prefill engine of its
    KV layout. None when no decode engine is given."""
    decode = pick(decoders, prompt_tokens, policy, turn)
    if decode is None:
        return None
    same_layout = [p for p in prefillers if p.kv_layout == decode.kv_layout]
    if (
        not same_layout
        or why_not is not None
        or not should_disaggregate(prompt_tokens, decode.cached_tokens, disagg_threshold)
    ):
        return Plan(decode)
    return Plan(decode, pick(same_layout, prompt_tokens, policy, turn))


def round_robin_counter() -> Iterator[int]:
    """A fresh counter for ``pick(..., policy="round_robin")``; one per app, never global."""
    return itertools.count()
