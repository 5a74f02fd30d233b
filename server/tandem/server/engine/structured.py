"""Constrained decoding with xgrammar: grammars compiled off the engine thread and cached by
source, one matcher per sequence, one token bitmask per step (see docs/structured.md).

A request's ``SamplingParams.structured`` names what its output must match (a JSON schema,
any JSON, a regex, a choice of strings, an EBNF/Lark grammar). ``GrammarCache.submit``
compiles it on a worker thread and returns a future that every request with the same source
shares; the engine admits the request once it is done. Each sequence then holds a
``SequenceGrammar``: the sampler masks its row with the tokens the grammar allows, and the
engine advances it with every token appended. Output tokens are never taken back in this
engine (a preempted request keeps them and recomputes only its KV), so a matcher never has
to roll back; a P/D decode engine advances it with the prefill engine's first token.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .grammar_limits import COMPILE_BUDGET_S, GrammarError, check_size

GrammarKind = Literal["json", "json_schema", "regex", "choice", "grammar"]
CACHE_SIZE = 256  # compiled grammars kept (least recently asked for dropped first)
__all__ = ["GrammarError", "GrammarSpec", "GrammarCache", "SequenceGrammar"]


@dataclass(frozen=True)
class GrammarSpec:
    """What a sequence's output must match. ``source`` is the schema as JSON text, the regex,
    the choices as a JSON list, or the EBNF/Lark grammar. With ``after_token_ids`` the grammar
    starts only once the output contains those tokens (a reasoning model's end of thinking)."""

    kind: GrammarKind
    source: str = ""
    after_token_ids: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.source)


class SequenceGrammar:
    """One sequence's matcher; inactive (no mask, no advance) until ``after_token_ids`` appear."""

    def __init__(self, matcher: Any, after_token_ids: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.after = after_token_ids
        self.active = not after_token_ids

    def advance(self, output_token_ids: list[int]) -> None:
        """Take the newest output token (already appended to ``output_token_ids``)."""
        if self.active:
            self.matcher.accept_token(output_token_ids[-1])
        elif tuple(output_token_ids[-len(self.after) :]) == self.after:
            self.active = True


class GrammarCache:
    """Compiles grammars on one worker thread; a source compiled once is reused by every request.

    A grammar over ``grammar_limits`` is refused before it is queued. A request waits at most
    ``budget_s`` for its compile (``generation.compile_grammar``); xgrammar cannot stop a
    compile that runs, so one nobody waits for any more is cancelled if it has not started
    (``release``) and otherwise runs out on this thread, its result kept for the next asker:
    the engine thread never waits on it."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tandem-grammar")
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._waiters: dict[tuple[str, str], int] = {}
        self._compiler: Any = None
        self.budget_s = COMPILE_BUDGET_S
        self._executor.submit(self._get_compiler)  # the tokenizer's vocabulary, read ahead

    def acquire(self, spec: GrammarSpec) -> Future:
        """``submit``, counted as one waiter until ``release`` (in one step, so another
        waiter's release cannot cancel the future in between): what a client awaits."""
        check_size(spec.kind, spec.source)
        with self._lock:
            self._waiters[spec.key] = self._waiters.get(spec.key, 0) + 1
            return self._submit_locked(spec)

    def release(self, spec: GrammarSpec) -> None:
        """One waiter is gone (answered, timed out, disconnected). When none is left and the
        compile has not started, it is cancelled and forgotten, so a client that leaves frees
        the compile thread for the others."""
        with self._lock:
            left = self._waiters.get(spec.key, 1) - 1
            if left > 0:
                self._waiters[spec.key] = left
                return
            self._waiters.pop(spec.key, None)
            fut = self._futures.get(spec.key)
            if fut is not None and fut.cancel():
                del self._futures[spec.key]

    def submit(self, spec: GrammarSpec) -> Future:
        """The compiled grammar's future (shared by every request with the same source); a
        grammar over the limits raises ``GrammarError`` here, before anything is compiled."""
        check_size(spec.kind, spec.source)
        with self._lock:
            return self._submit_locked(spec)

    def _submit_locked(self, spec: GrammarSpec) -> Future:
        fut = self._futures.get(spec.key)
        if fut is None:
            fut = self._executor.submit(self._compile, spec)
            self._futures[spec.key] = fut
            if len(self._futures) > CACHE_SIZE:
                self._futures.popitem(last=False)
        else:
            self._futures.move_to_end(spec.key)
        return fut

    def sequence(self, compiled: Any, spec: GrammarSpec) -> SequenceGrammar:
        import xgrammar as xgr

        return SequenceGrammar(xgr.GrammarMatcher(compiled), spec.after_token_ids)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._get_compiler()
        try:
            compiled = _compile_spec(compiler, spec)
        except Exception as exc:  # the library raises RuntimeError/ValueError with the reason
            raise GrammarError(
                "structured_outputs", f"cannot compile the {spec.kind}: {exc}"
            ) from exc
        if not _allows_a_first_token(compiled, self._vocab_size):
            raise GrammarError(
                "structured_outputs",
                f"the {spec.kind} matches no output at all: it allows no first token "
                "(a regex no string matches, say)",
            )
        return compiled


def _compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    if spec.kind == "json":
        return compiler.compile_builtin_json_grammar()
    if spec.kind == "json_schema":
        schema = json_safe_strings(json.loads(spec.source))
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "choice":
        return compiler.compile_grammar(choice_ebnf(json.loads(spec.source)))
    return _compile_grammar(compiler, spec.source)


def _allows_a_first_token(compiled: Any, vocab_size: int) -> bool:
    """Whether any output can begin. ``[^\\s\\S]`` compiles (and ``{"$ref": "#"}`` did before
    xgrammar 0.2.9), yet its matcher rejects every token: caught here it is the request's 400,
    not a failure at its first step."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _compile_grammar(compiler: Any, source: str) -> Any:
    """vLLM's ``guided_grammar`` is EBNF (GBNF) or Lark: try EBNF first, then Lark."""
    try:
        return compiler.compile_grammar(source)
    except Exception as ebnf_error:
        try:
            return compiler.compile_lark(source)
        except Exception:
            raise ebnf_error from None


# A character a JSON string may hold unescaped, as valid UTF-8: printable ASCII but the quote
# and backslash, then each run of code points whose UTF-8 form shares its lead-byte rules, as
# alternatives (one class would be built as a naive byte range: overlong forms, surrogates).
_JSON_CHAR = (
    "(?:"
    + "|".join(
        [
            r"[ !#-\[\]-\x7f]",
            r"[\u0080-\u07ff]",
            r"[\u0800-\u0fff]",
            r"[\u1000-\ucfff]",
            r"[\ud000-\ud7ff]",
            r"[\ue000-\uffff]",
            r"[\u{10000}-\u{3ffff}]",
            r"[\u{40000}-\u{fffff}]",
            r"[\u{100000}-\u{10ffff}]",
        ]
    )
    + ")"
)


def json_safe_strings(schema: Any) -> Any:
    """xgrammar 0.2.8 lets a JSON string hold byte sequences that are not valid UTF-8 (encoded
    surrogates, overlong forms), and one with ``minLength``/``maxLength`` raw control characters
    too: JSON that strict parsers (pydantic's) refuse, or whose length is off once decoded. Each plain string becomes a ``pattern`` over JSON-safe
    characters with the same bounds, so every output the grammar accepts parses."""
    if isinstance(schema, list):
        return [json_safe_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: json_safe_strings(v) for k, v in schema.items()}
    plain = not any(k in out for k in ("pattern", "format", "enum", "const"))
    if out.get("type") == "string" and plain:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"{_JSON_CHAR}{{{low},{high}}}"
    return out


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@torch.inference_mode()  # the model's logits are inference tensors: written in place only here
def apply_grammar_masks(logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> None:
    """Mask, in place, the rows whose sequence has an active grammar: one bitmask for the step,
    filled row by row, applied in one call."""
    rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
    if not rows:
        return
    import xgrammar as xgr

    vocab = logits.shape[-1]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        grammars[i].matcher.fill_next_token_bitmask(bitmask, j)
    if len(rows) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask.to(logits.device))
    logits[rows] = sub
