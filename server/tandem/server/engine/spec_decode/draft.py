"""One request's speculation state: this step's proposed tokens and how many to propose next.

The length adapts to the request's own acceptance, so a request whose proposals keep missing
stops paying for them: each verified proposal sets the next length to one more than it got
accepted (up to the configured most), and a proposal with nothing accepted makes the request
skip proposing for 1, 3, 7, ... 31 steps (doubling while it keeps missing). It also keeps an
estimate of how likely each proposed token is to be accepted (recent proposals weigh most),
which the step's cost model (``cost.StepCost``) weighs against the rows a proposal adds.

That estimate is kept apart for three states, since acceptance comes in runs: a proposal that
follows one accepted whole is likely the same copy going on (an edit copying its paragraph:
nearly every token agrees), while one that follows a rejection starts after a change the
lookup did not foresee. One estimate for both priced the long runs at the misses' rate and
proposed two tokens where four were kept (the default model's ``edit`` bench). The third is
a lookup that matched the last token only (``weak``): right after an edit it is what finds the
copy again, in other text it is a guess; its own estimate keeps those guesses from being
priced at what longer matches earn (and it is never given a free row: it pays by its estimate).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SKIP = 31
# How much of the estimate a verified proposal keeps: about the last five proposals count.
DECAY = 0.8
# The estimate before anything was verified (one accepted and one rejected token, as if seen).
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0
# Verified proposals before the estimate is trusted: until then a first row is free.
ESTABLISHED = 4
# Steps without a verified proposal after which a first row is free again (a probe), so an
# estimate that fell below what a row costs can recover.
PROBE_EVERY = 16


@dataclass(eq=False)
class Draft:
    token_ids: list[int] = field(default_factory=list)  # proposed for this step, unverified
    length: int = 0  # how many to propose next; 0 until the first proposal (then the most)
    skip: int = 0  # steps left without proposing
    misses: int = 0  # proposals in a row with nothing accepted
    # accepted tokens and tokens checked (every accepted one, and the first rejected), decayed;
    # [0] after a proposal not accepted whole (or none yet), [1] after one accepted whole,
    # [2] a weak proposal's
    hits: list[float] = field(default_factory=lambda: [PRIOR_HITS] * 3)
    trials: list[float] = field(default_factory=lambda: [PRIOR_TRIALS] * 3)
    whole: bool = False  # the last verified proposal was accepted whole
    weak: bool = False  # this step's lookup matched the last token only
    verified: int = 0  # proposals verified
    idle: int = 0  # steps since the last verified proposal

    @property
    def free(self) -> bool:
        """Whether this step's first proposed row is given whatever it is worth: the estimate
        is not established yet, or a probe is due (never for a weak proposal)."""
        return not self.weak and (self.verified < ESTABLISHED or self.idle >= PROBE_EVERY)

    @property
    def state(self) -> int:
        """Which estimate this step's proposal is priced and counted by (``hits``' index)."""
        return 2 if self.weak else int(self.whole)

    @property
    def acceptance(self) -> float:
        """The estimated chance that the next proposed token is accepted."""
        return self.hits[self.state] / self.trials[self.state]

    def next_length(self, most: int) -> int:
        """How many tokens to propose this step (0: skip this one)."""
        self.idle += 1
        if self.skip:
            self.skip -= 1
            return 0
        return self.length or most

    def record(self, proposed: int, accepted: int, most: int) -> None:
        """A proposal of ``proposed`` tokens was verified with ``accepted`` of them kept. A weak
        one moves its own estimate only: the length, the backoff and the probes are the
        lookup's longer matches'."""
        state = self.state
        self.hits[state] = DECAY * self.hits[state] + accepted
        self.trials[state] = DECAY * self.trials[state] + accepted + (accepted < proposed)
        self.whole = accepted == proposed
        if self.weak:
            return
        self.length = most if accepted == proposed else max(1, accepted + 1)
        self.verified, self.idle = self.verified + 1, 0
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        self.skip = min(2**self.misses - 1, MAX_SKIP)
