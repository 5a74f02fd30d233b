"""Requests whose grammar is still compiling: held beside the queue, admitted once it is done.

A schema can take long to compile; holding its request here (instead of blocking ``step``)
is what keeps a slow schema from stalling every other request.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

from .request import Request, RequestStatus
from .structured import GrammarCache, GrammarSpec


@dataclass
class Compiling:
    group: list[Request]
    grammar: Future

    def fail(self) -> None:
        """The grammar did not compile: the group ends, aborted, with the compiler's error."""
        self.group[0].output.error = str(self.grammar.exception())
        self.group[0].output.error_code = "invalid_schema"
        for req in self.group:
            req.status = RequestStatus.FINISHED_ABORTED
            req.times.finished = time.monotonic()


class CompilingGroups:
    def __init__(self, grammars: GrammarCache) -> None:
        self.grammars = grammars
        self._held: list[Compiling] = []

    def __len__(self) -> int:
        return len(self._held)

    def submit(self, spec: GrammarSpec | None) -> Future | None:
        """Start compiling ``spec`` (None without one); a grammar that already failed is
        this request's 400, raised here."""
        if spec is None:
            return None
        grammar = self.grammars.submit(spec)
        if grammar.done():
            grammar.result()
        return grammar

    def hold(self, group: list[Request], grammar: Future) -> None:
        self._held.append(Compiling(group, grammar))

    def drop(self, group: list[Request]) -> None:
        self._held = [c for c in self._held if c.group is not group]

    def take_done(self) -> list[Compiling]:
        """The groups whose grammar finished (compiled or failed), in arrival order."""
        done: list[Compiling] = []
        still: list[Compiling] = []
        for c in self._held:  # one look per future: it may finish while we sort
            (done if c.grammar.done() else still).append(c)
        self._held = still
        return done

    def bind(self, group: list[Request], grammar: Future) -> None:
        """Give each sequence of the group a matcher of its own (n > 1 sample independently)."""
        compiled = grammar.result()
        for req in group:
            req.sampling.grammar = self.grammars.sequence(compiled, req.params.structured)
