"""The thread tuner: it keeps the count whose steps were fastest and follows a change of load.

Steps are fed made-up durations and busy shares (no clock): what is tested is the choice, not
a timing. ``busy`` is the stepping thread's CPU time over the step's wall time: ~1.0 on cores of
its own, ~0.5 beside a co-tenant.
"""

from __future__ import annotations

from tandem.server.engine.threads import FIRST_EXPLORE, ThreadTuner, thread_counts

DECODE = ThreadTuner.kind_of(True, 1)


QUIET, SHARED = 1.0, 0.5


def _steps(
    tuner: ThreadTuner, seconds: dict[int, float], n: int, busy: float = SHARED
) -> list[int]:
    chosen = []
    for _ in range(n):
        threads = tuner.choose(DECODE)
        tuner.record(DECODE, threads, seconds[threads], busy)
        chosen.append(threads)
    return chosen


def test_counts_tried_are_all_half_and_one() -> None:
    assert thread_counts(8) == (8, 4, 1)
    assert thread_counts(2) == (2, 1)
    assert thread_counts(1) == (1,)


def test_on_cores_of_its_own_every_step_takes_all_threads() -> None:
    """No try of fewer threads while the steps show no co-tenant: on a quiet machine a try is
    only a loss (a big prefill on one thread of two takes twice as long)."""
    tuner = ThreadTuner(2)
    assert _steps(tuner, {2: 0.010, 1: 0.018}, 400, busy=QUIET) == [2] * 400


def test_keeps_the_fastest_count_and_tries_the_other_seldom() -> None:
    tuner = ThreadTuner(2)
    chosen = _steps(tuner, {2: 0.010, 1: 0.018}, 400)
    # shared cores: each count runs a first step (not a measure) and is measured once
    assert chosen[:4] == [2, 2, 1, 1]
    assert chosen.count(1) <= 2 + 400 // FIRST_EXPLORE
    assert chosen[-100:].count(2) >= 95


def test_follows_a_co_tenant_arriving_and_leaving() -> None:
    """Quiet: two threads win; with the cores shared one thread does; quiet again: two."""
    tuner = ThreadTuner(2)
    _steps(tuner, {2: 0.010, 1: 0.018}, 200, busy=QUIET)
    loaded = _steps(tuner, {2: 0.080, 1: 0.020}, 200)
    assert loaded[-100:].count(1) >= 95
    quiet = _steps(tuner, {2: 0.010, 1: 0.018}, 400, busy=QUIET)
    assert quiet[-100:].count(2) >= 95


def test_kinds_of_step_are_tuned_apart() -> None:
    """A long prefill may want every thread while a one-row decode wants one."""
    tuner = ThreadTuner(2)
    prefill = ThreadTuner.kind_of(False, 512)
    chosen: dict[tuple[bool, int], list[int]] = {DECODE: [], prefill: []}
    for _ in range(200):
        for kind, best in ((DECODE, 1), (prefill, 2)):
            threads = tuner.choose(kind)
            tuner.record(kind, threads, 0.01 if threads == best else 0.05, SHARED)
            chosen[kind].append(threads)
    assert chosen[DECODE][-100:].count(1) >= 95
    assert chosen[prefill][-100:].count(2) >= 95
    assert ThreadTuner.kind_of(False, 512) != ThreadTuner.kind_of(False, 100)
    assert ThreadTuner.kind_of(False, 512) == ThreadTuner.kind_of(False, 1000)


def test_a_counts_first_step_of_a_kind_is_not_a_measure() -> None:
    """The first step pays one-off costs (weights faulted in and packed, kernels made for a new
    shape): ten times a usual step, on cores seemingly shared, must not hand the kind to one
    thread."""
    tuner = ThreadTuner(2)
    threads = tuner.choose(DECODE)
    # the worker keeps a step the tuner does not count out of its step curve too
    assert tuner.record(DECODE, threads, 0.100, busy=SHARED) is False
    assert tuner.record(DECODE, tuner.choose(DECODE), 0.010, busy=QUIET) is True
    assert _steps(tuner, {2: 0.010, 1: 0.018}, 50, busy=QUIET) == [2] * 50


def test_a_kind_first_seen_on_shared_cores_starts_on_one_thread() -> None:
    """The batch's big prefills are kinds of their own, run once or twice: beside a co-tenant
    each would otherwise pay its first steps on every thread (bf16, up to ten times one
    thread's) before its choice. Its third step tries every thread, kept where they win."""
    tuner = ThreadTuner(2)
    _steps(tuner, {2: 0.080, 1: 0.020}, 50)  # the decodes found the cores shared
    prefill = ThreadTuner.kind_of(False, 4096)
    tried = []
    for _ in range(3 * FIRST_EXPLORE):
        threads = tuner.choose(prefill)
        tuner.record(prefill, threads, 0.5 if threads == 2 else 1.0, SHARED)
        tried.append(threads)
    assert tried[:2] == [1, 1]
    assert tried[-FIRST_EXPLORE:] == [2] * FIRST_EXPLORE


def test_a_kind_first_seen_on_quiet_cores_starts_on_every_thread() -> None:
    tuner = ThreadTuner(2)
    _steps(tuner, {2: 0.080, 1: 0.020}, 50)
    _steps(tuner, {2: 0.010, 1: 0.018}, 200, busy=QUIET)  # the co-tenant left
    prefill = ThreadTuner.kind_of(False, 4096)
    assert tuner.choose(prefill) == 2


def test_a_new_kind_starts_on_its_nearest_measured_neighbours_count() -> None:
    tuner = ThreadTuner(2)
    decode_8 = ThreadTuner.kind_of(True, 8)
    for busy in [SHARED] * 50 + [QUIET]:
        threads = tuner.choose(decode_8)
        tuner.record(decode_8, threads, 0.02 if threads == 1 else 0.5, busy)
    assert tuner.chosen(decode_8) == 1  # one thread won, though the newest step looked quiet
    assert tuner.choose(ThreadTuner.kind_of(True, 16)) == 1
    assert tuner.choose(ThreadTuner.kind_of(False, 4096)) == 2  # no prefill measured yet


def test_a_try_waits_for_ten_times_its_expected_loss() -> None:
    """Beside a co-tenant a two-thread decode step took ten times a one-thread step: trying it
    every interval cost half a batch's time."""
    tuner = ThreadTuner(2)
    chosen = _steps(tuner, {2: 1.0, 1: 0.1}, 1000)
    # the first tries (a first step, then a measure) find two threads ten times slower; after
    # them, each try waits for ten times its loss (9 s, 90 one-thread steps)
    assert chosen.count(2) <= 4 + 1000 // 90


def test_a_long_prefill_tries_every_thread_though_the_decodes_lost_on_them() -> None:
    """Beside a co-tenant, each parallel region's join waits out a timeslice: a decode step of
    short regions ran ten times slower on two threads, but float32 4,096-token prefills (long
    regions) ran 1.4x faster on two. A phase's tries do not gate the other's."""
    tuner = ThreadTuner(2)
    _steps(tuner, {2: 1.0, 1: 0.1}, 50)
    prefill = ThreadTuner.kind_of(False, 4096)
    tried = []
    for _ in range(8):
        threads = tuner.choose(prefill)
        tuner.record(prefill, threads, 14.0 if threads == 2 else 20.0, SHARED)
        tried.append(threads)
    assert tried == [1, 1, 2, 2, 2, 2, 2, 2]
