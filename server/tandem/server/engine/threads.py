"""How many threads a CPU step runs on, decided by measuring steps, not by counting cores.

On cores of its own, a step is fastest on all of them. On cores another process shares (the
serving pod's event loop, tokenizer and sidecars; a co-tenant), every parallel region waits
at its join for the thread the scheduler took away, a timeslice each time: a step of a few
hundred regions runs many times slower than on one thread. Which case holds changes while
the engine runs, so the tuner times the steps it runs at each thread count and keeps, per
kind of step (prefill or decode, and its size in tokens to a power of two), the count whose
recent steps were fastest. It tries the others now and then (every ``explore`` steps of that
kind, twice as seldom each time the choice is confirmed), so it follows the machine.

A try is not free: a 4,096-token prefill on one thread of two takes twice as long. So on all
threads a kind tries fewer only while its steps show the cores are shared: the stepping
thread's CPU time over the step's wall time (``busy``) is ~1.0 on cores of its own (it runs
or spins the whole step) and ~0.5 when a co-tenant takes half of them (measured on 2 cores:
0.98-1.0 quiet, 0.46-0.50 beside one busy process per core).

A kind first seen starts on the count its phase's measured kind nearest in size chose, or,
with none, on one thread where the newest measured step (of any kind) found the cores shared:
the big prefills of a batch are each a kind of their own, run a few times at most, and beside
one busy process per core two threads took 6.5-38.6 s where one took 4.1 s for the two
4,096-token bf16 prefills of 64 prompts (default model).

A kind measures each count once as soon as a try can be afforded: when its steps on the chosen
count since its last try have run ten times what the try is expected to lose, the newest
figure of that count in the same phase (a try's first step too), as a multiple of its kind's
best count, telling how much slower it runs (a try with no such figure goes ahead). Beside a co-tenant a decode step on two
threads took 0.6-2 s where one thread took ~0.1 (every parallel region's join waits out a
timeslice; tries cost the 64-prompt batch 11-12 s of its 22-26), while float32 4,096-token
prefills, long regions, ran 1.4x faster on two threads than on one: so one phase's losses do
not gate the other's tries.

A count's first step of a kind is not a measure: it pays what is done once (weights faulted in
from the model file and packed on first use, kernels made for a new shape, 4.5x a step of the
default model's 117-token prefill), so it is run and not recorded. Recorded, it made one thread
look faster and kept that kind's prefills on one thread until the next try.

Every C kernel splits its work so its results do not depend on the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.3  # weight of the newest step in each count's moving average
FIRST_EXPLORE = 16  # steps of a kind between tries of another count, at first
MOST_EXPLORE = 1024
SHARED_BELOW = 0.8  # a step's busy share under which its cores count as shared
TRY_SHARE = 10  # a try waits for this many times what the tried count last lost, run since


def thread_counts(most: int) -> tuple[int, ...]:
    """The counts tried: all threads, half, one (distinct, most first)."""
    return tuple(dict.fromkeys((most, max(1, most // 2), 1)))


@dataclass
class _Kind:
    """One kind of step: each count's moving average of seconds per step."""

    seconds: dict[int, float] = field(default_factory=dict)
    steps: int = 0
    every: int = FIRST_EXPLORE
    chosen: int = 0
    shared: bool = False  # the newest step on the chosen count found its cores shared
    warmed: set[int] = field(default_factory=set)  # counts whose first step has run
    since: float = 0.0  # seconds of chosen-count steps since the newest try of another


class ThreadTuner:
    def __init__(self, most: int) -> None:
        self.counts = thread_counts(most)
        self._kinds: dict[tuple[bool, int], _Kind] = {}
        self._shared = False  # the newest measured step, of any kind, found its cores shared
        # (phase, count): its newest figure (a try, or a measure), over its kind's best count
        self._ratio: dict[tuple[bool, int], float] = {}

    @staticmethod
    def kind_of(is_decode: bool, num_tokens: int) -> tuple[bool, int]:
        return is_decode, num_tokens.bit_length()

    def choose(self, kind: tuple[bool, int]) -> int:
        """The thread count for the next step of ``kind``."""
        k = self._kinds.get(kind)
        if k is None:
            k = self._kinds[kind] = _Kind(chosen=self._start(kind), shared=self._shared)
        k.steps += 1
        if k.chosen == self.counts[0] and not k.shared:
            return k.chosen
        if k.chosen not in k.seconds:
            return k.chosen
        best = min(k.seconds, key=k.seconds.__getitem__)
        untried = [c for c in self.counts if c not in k.seconds]
        if untried:  # each count measured once as soon as it can be afforded
            other = untried[0]
        elif k.steps % k.every == 0:  # then the count measured longest ago: the one not best
            others = [c for c in self.counts if c != best]
            other = others[(k.steps // k.every) % len(others)]
        else:
            return best
        return other if self._affordable(kind, k, other, best) else best

    def _affordable(self, kind: tuple[bool, int], k: _Kind, other: int, best: int) -> bool:
        """Whether ``kind``'s steps on the chosen count since its last try have run ten times
        what a try of ``other`` is expected to lose: the newest figure of that count in this
        phase (prefill or decode), as a multiple of its kind's best count, tells how much
        slower it runs. A try whose first step has run is always completed."""
        if other in k.warmed and other not in k.seconds:
            return True
        ratio = self._ratio.get((kind[0], other))
        expected = k.seconds[best] * ratio if ratio else k.seconds.get(other, 0.0)
        return k.since >= TRY_SHARE * (expected - k.seconds[best])

    def _start(self, kind: tuple[bool, int]) -> int:
        """A new kind's first count: the choice of the measured kind of its phase (prefill or
        decode) nearest in size, else one thread if the newest step found the cores shared."""
        measured = [o for o, k in self._kinds.items() if o[0] == kind[0] and k.chosen in k.seconds]
        if measured:
            return self._kinds[min(measured, key=lambda o: abs(o[1] - kind[1]))].chosen
        return self.counts[-1] if self._shared else self.counts[0]

    def chosen(self, kind: tuple[bool, int]) -> int:
        """The count ``kind``'s steps run on when not trying another."""
        return self._kinds[kind].chosen

    def record(
        self, kind: tuple[bool, int], threads: int, seconds: float, busy: float = 1.0
    ) -> bool:
        """A step of ``kind`` took ``seconds`` on ``threads``, its stepping thread on a core for
        ``busy`` of them: the chosen count's average moves toward it; a tried count's figure is
        replaced (its old one may be from another load). Returns whether the step was a
        measure (not the count's first step of the kind), for other timings to skip alike."""
        k = self._kinds[kind]
        if threads != k.chosen and k.chosen in k.seconds:
            self._ratio[kind[0], threads] = seconds / k.seconds[k.chosen]
        if threads not in k.warmed:
            k.warmed.add(threads)
            return False
        self._shared = busy < SHARED_BELOW
        if threads == k.chosen:
            k.shared = self._shared
            k.since += seconds
        else:
            k.since = 0.0
        old = k.seconds.get(threads)
        fresh = old is None or threads != k.chosen
        k.seconds[threads] = seconds if fresh else old + ALPHA * (seconds - old)
        best = min(k.seconds, key=k.seconds.__getitem__)
        for count, figure in k.seconds.items():
            self._ratio[kind[0], count] = figure / k.seconds[best]
        if best == k.chosen:
            if threads != best:  # a try of another count confirmed the choice
                k.every = min(2 * k.every, MOST_EXPLORE)
        else:
            k.chosen, k.every = best, FIRST_EXPLORE
        return True
