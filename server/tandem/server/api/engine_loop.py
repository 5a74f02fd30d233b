"""The engine loop: one thread owns the ``LLMEngine``; the async API talks to it through a queue.

``LLMEngine`` is synchronous and not thread-safe. Routes never touch it: they put commands
(add, abort, a function to run) on a thread-safe queue, which the loop applies between
steps, and read results from a per-request ``asyncio.Queue`` the loop fills through
``call_soon_threadsafe``. A slow client therefore never stalls a step, and a client that
goes away only costs an ``abort`` command. The thread sleeps on the queue when idle.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tandem.server.engine import (
    CompletionOutput,
    LLMEngine,
    PoolingParams,
    RequestOutput,
    SamplingParams,
)
from tandem.server.engine.model_details import describe
from tandem.server.engine.models.config import ModelLoadError
from tandem.server.engine.parallel import RankGroupLost
from tandem.server.engine.stats import EngineStats

log = logging.getLogger("tandem.api.engine")

T = TypeVar("T")

LOADING, READY, FAILED, STOPPED = "loading", "ready", "failed", "stopped"


class QueueFullError(Exception):
    """The engine's waiting queue is at the admission limit: the API's 429."""


class EngineNotReadyError(Exception):
    """The engine is still loading, failed to load, or has stopped: the API's 503."""


class UpdateInProgressError(Exception):
    """A weight update was asked for while another waits for requests to drain: the API's 409."""


class EngineStepError(Exception):
    """The engine failed while stepping; every request in flight gets this."""


class EngineMetrics(Protocol):
    """What the loop reports as it runs; ``metrics.ServerMetrics`` implements it."""

    def on_added(self, num_prompt_tokens: int) -> None: ...

    def on_first_token(self, seconds: float) -> None: ...

    def on_tokens(self, seconds: float, count: int) -> None: ...

    def on_finished(
        self, reasons: list[str], num_tokens: int, num_cached_tokens: int, e2e_seconds: float
    ) -> None: ...

    def on_aborted(self, count: int) -> None: ...


@dataclass
class _Tracked:
    """Per-request bookkeeping the loop keeps for delivery and latency metrics."""

    sink: asyncio.Queue
    arrival: float
    prompt_ids: list[int] = field(default_factory=list)
    n: int = 1
    last: RequestOutput | None = None  # a non-streamed request's latest (cumulative) output
    stream: bool = False
    num_tokens: int = 0
    reasons: dict[int, str] = field(default_factory=dict)  # finished choices
    first_token_at: float | None = None
    last_token_at: float | None = None
    session_id: str | None = None


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    stream: bool
    session_id: str | None
    sink: asyncio.Queue
    arrival: float
    future: concurrent.futures.Future
    kv_transfer: dict[str, Any] | None = None
    pooling: PoolingParams | None = None
    # The prefix-cache partition: the caller's key (tenancy.request_tenant) and cache_salt.
    tenant: str | None = None
    cache_salt: str | None = None
    lora: str | None = None  # the LoRA adapter it runs through (None: the base model)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


@dataclass
class _Update:
    """Replace the weights (``fn``) once the engine is idle; ``drain`` False aborts first."""

    fn: Callable[[LLMEngine], Any]
    drain: bool
    future: concurrent.futures.Future


class _Stop:
    pass


class AsyncEngine:
    """Runs an ``LLMEngine`` in a background thread and gives the event loop an async face.

    ``build`` makes the engine inside the thread, so the server can answer (503) while a
    large model loads. ``max_waiting`` bounds the engine's waiting queue (429 beyond it);
    ``session_ttl`` expires idle sessions.
    """

    def __init__(
        self,
        build: Callable[[], LLMEngine],
        *,
        max_waiting: int | None = None,
        session_ttl: float | None = None,
        metrics: EngineMetrics | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        on_ready: Callable[[LLMEngine], None] | None = None,
        puller: Any = None,
    ) -> None:
        self._build = build
        self._on_ready = on_ready
        self.puller = puller  # tandem.server.disagg.puller.KVPuller: runs the engine's KV pulls
        self._max_waiting = max_waiting
        self._session_ttl = session_ttl
        self._metrics = metrics
        self._on_failure = on_failure
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engine: LLMEngine | None = None
        self._last_expiry = time.monotonic()
        self.error: BaseException | None = None
        self.state = LOADING
        self.stats = EngineStats()  # as of the loop's last iteration; read by /health, /metrics
        self.step_seconds = 0.0  # wall time inside engine.step(): the server overhead's baseline
        self.num_queued_adds = (
            0  # adds submitted but not yet applied; only the event loop writes it
        )
        self.info: dict[str, Any] = {}  # static facts about the engine, set once it is built
        self.paused = False  # set by pause()/resume(); the loop applies commands but does not step
        self._steps_left: int | None = None  # resume(steps=N): pause again after N steps
        self._update: _Update | None = None  # a weight update waiting for the engine to drain
        self._deferred: list[_Add] = []  # adds that arrived meanwhile: they run on the new weights

    # ----- lifecycle ----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight are aborted."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout)
        self._thread = None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block (in a thread, not the event loop) until the engine has loaded or failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.state == LOADING:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return self.state == READY

    @property
    def served_loras(self) -> Mapping[str, str]:
        """The LoRA adapters served, name -> path (any thread; empty until loaded)."""
        return self._engine.served_loras if self._engine is not None else {}

    # ----- the async face -----------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        sink: asyncio.Queue,
        stream: bool = False,
        session_id: str | None = None,
        arrival: float | None = None,
        kv_transfer: dict[str, Any] | None = None,
        pooling: PoolingParams | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> list[int]:
        """Queue a request; outputs arrive on ``sink`` as ``(request_id, RequestOutput)``.
        ``tenant`` and ``cache_salt`` name its prefix-cache partition (``InputProcessor``);
        ``lora`` the adapter it runs through.

        Returns the prompt token ids once the engine accepted it; raises what
        ``LLMEngine.add_request`` raises, or ``QueueFullError`` / ``EngineNotReadyError``.
        """
        self._check_ready()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.num_queued_adds += 1
        try:
            self._commands.put(
                _Add(
                    request_id,
                    prompt,
                    params,
                    stream,
                    session_id,
                    sink,
                    arrival or time.monotonic(),
                    fut,
                    kv_transfer,
                    pooling,
                    tenant,
                    cache_salt,
                    lora,
                )
            )
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may have landed just before the cancellation
            raise
        finally:
            self.num_queued_adds -= 1

    def abort(self, request_id: str) -> None:
        """Abort without waiting: safe from a ``finally`` in a cancelled task."""
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the loop thread between steps and return its result."""
        self._check_ready()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Call(fn, fut))
        return await asyncio.wrap_future(fut)

    async def abort_matching(self, session: Callable[[str], bool] | None = None) -> int:
        """Abort every request in flight (or those whose session id ``session`` matches);
        their streams end with ``finish_reason: abort``. Returns how many were aborted."""

        def fn(engine: LLMEngine) -> int:
            ids = [
                rid
                for rid, t in self._tracked.items()
                if session is None or (t.session_id is not None and session(t.session_id))
            ]
            self._abort_tracked(engine, ids)
            return len(ids)

        return await self.call(fn)

    async def update_weights(self, fn: Callable[[LLMEngine], T], *, drain: bool) -> T:
        """Run ``fn(engine)`` (a weight update) with nothing in flight. ``drain``: requests
        already admitted finish first (on the old weights) while new ones wait, then run on
        the new weights; otherwise every request in flight is aborted at once (each answers
        what it produced so far). Returns ``fn``'s result, or raises what it raised."""
        self._check_ready()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Update(fn, drain, fut))
        return await asyncio.wrap_future(fut)

    @property
    def updating(self) -> bool:
        """A weight update is waiting for the requests in flight to finish."""
        return self._update is not None

    def pause(self) -> None:
        """Stop stepping: requests in flight stay admitted, hold their blocks and make no
        progress until ``resume``; commands (adds, aborts, calls) still apply. Used before a
        weight update, and by tests that need a request held in flight deterministically."""
        self.paused = True

    def resume(self, steps: int | None = None) -> None:
        """Step again; with ``steps``, pause once that many steps have run (so a test can
        hold a request in flight after exactly ``steps`` tokens)."""
        self._steps_left = steps
        self.paused = False
        self._commands.put(_Call(lambda e: None, concurrent.futures.Future()))  # wake the loop

    def _check_ready(self) -> None:
        if self.state != READY:
            raise EngineNotReadyError(f"the engine is {self.state}")

    # ----- the loop thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._engine = self._build()
            if self._on_ready is not None:
                self._on_ready(engine)
            stats = engine.stats()
            self.info = {
                "max_model_len": engine.max_model_len,
                "block_size": stats.block_size,
                "num_blocks": stats.total_blocks,
                "device": str(engine.device),
                "weights": engine.weights.as_dict(),
                "details": describe(engine.config.model).as_dict(),
            }
        except BaseException as exc:  # noqa: BLE001 - reported to the server, which exits
            if isinstance(exc, ModelLoadError):  # the message says it all
                log.error("the engine failed to load: %s", exc)
            else:
                log.exception("the engine failed to load")
            self.error = exc
            self.state = FAILED
            if self._on_failure is not None:
                self._on_failure(exc)
            return
        self._publish(READY)
        try:
            self._serve(engine)
        except RankGroupLost as exc:  # the engine cannot step again: the server exits
            log.error("the engine lost a tensor-parallel rank: %s", exc)
            self.error = exc
            if self._on_failure is not None:
                self._on_failure(exc)
        finally:
            for rid in list(self._tracked):
                engine.abort_request(rid)
            self._deliver_error(list(self._tracked), EngineNotReadyError("the engine stopped"))
            self._tracked.clear()
            waiting = [c.future for c in self._deferred] + (
                [self._update.future] if self._update else []
            )
            for fut in waiting:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineNotReadyError("the engine stopped"))
            self.state = STOPPED
            engine.close()

    def _serve(self, engine: LLMEngine) -> None:
        """Step, apply commands, hand out outputs, until told to stop."""
        while True:
            idle = self.paused or not engine.has_unfinished_requests()
            if not self._apply_commands(block=idle):
                return
            if not self.paused and engine.has_unfinished_requests():
                self._step(engine)
                self._count_step()
            self._run_update(engine)
            self._dispatch_pulls(engine)
            self._expire(engine)
            self._publish(READY)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command; when idle, wait for one first. False means stop."""
        timeout = self._idle_wait()
        try:
            cmd = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _idle_wait(self) -> float:
        """How long an idle loop waits for a command: at most 1 s (sessions expire), and no
        later than the next KV lease's expiry, so an engine nobody calls still frees an
        unpulled lease's blocks on time (``_expire``), not at its next step."""
        expiry = self._engine.next_lease_expiry() if self._engine is not None else None
        if expiry is None:
            return 1.0
        return min(1.0, max(0.0, expiry - time.monotonic()) + 0.01)

    def _apply(self, cmd: object) -> None:
        engine = self._engine
        assert engine is not None
        if isinstance(cmd, _Add) and self._update is not None:
            self._deferred.append(cmd)
        elif isinstance(cmd, _Add):
            self._add(engine, cmd)
        elif isinstance(cmd, _Abort):
            tracked = self._tracked.pop(cmd.request_id, None)
            if tracked is not None:
                engine.abort_request(cmd.request_id)
                if self._metrics is not None:
                    self._metrics.on_aborted(tracked.n)
        elif isinstance(cmd, _Call):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                cmd.future.set_result(cmd.fn(engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(exc)
        elif isinstance(cmd, _Update):
            if self._update is not None:
                cmd.future.set_exception(
                    UpdateInProgressError("another weight update is waiting for requests to drain")
                )
                return
            self._update = cmd
            if not cmd.drain:
                self._abort_tracked(engine, list(self._tracked))

    def _add(self, engine: LLMEngine, cmd: _Add) -> None:
        """One add, on the engine thread, in its prefix-cache partition (its tenant and
        salt), so it hits only its own tenant's blocks."""
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            if self._max_waiting is not None and engine.num_waiting >= self._max_waiting:
                raise QueueFullError(
                    f"the waiting queue is full ({self._max_waiting} requests); retry later"
                )
            ids = engine.add_request(
                cmd.request_id,
                cmd.prompt,
                cmd.params,
                stream=cmd.stream,
                session_id=cmd.session_id,
                kv_transfer=cmd.kv_transfer or None,
                pooling=cmd.pooling,
                tenant=cmd.tenant,
                cache_salt=cmd.cache_salt,
                lora=cmd.lora,
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            cmd.future.set_exception(exc)
            return
        self._tracked[cmd.request_id] = _Tracked(
            cmd.sink,
            cmd.arrival,
            prompt_ids=ids,
            n=cmd.params.n,
            stream=cmd.stream,
            session_id=cmd.session_id,
        )
        if self._metrics is not None:
            self._metrics.on_added(len(ids))
        cmd.future.set_result(ids)

    def _count_step(self) -> None:
        if self._steps_left is not None:
            self._steps_left -= 1
            if self._steps_left <= 0:
                self._steps_left = None
                self.paused = True

    def _run_update(self, engine: LLMEngine) -> None:
        """Once nothing is in flight, swap the weights, then admit the adds that waited."""
        cmd = self._update
        if cmd is None or self._tracked:
            return
        self._update = None
        if cmd.future.set_running_or_notify_cancel():
            try:
                cmd.future.set_result(cmd.fn(engine))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(exc)
        self.info = {**self.info, "weights": engine.weights.as_dict()}
        deferred, self._deferred = self._deferred, []
        for add in deferred:
            self._apply(add)

    def _abort_tracked(self, engine: LLMEngine, ids: list[str]) -> None:
        """Abort these requests on purpose: each gets its final output (a non-streamed one
        what it produced so far, marked ``abort``), unlike a disconnect, which gets nothing."""
        batch = []
        for rid in ids:
            tracked = self._tracked.pop(rid)
            last = tracked.last if tracked.stream else engine.partial_output(rid)
            engine.abort_request(rid)
            batch.append(
                (
                    tracked.sink,
                    rid,
                    aborted_output(rid, tracked.prompt_ids, tracked.n, last, tracked.reasons),
                )
            )
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, batch)
        if ids and self._metrics is not None:
            self._metrics.on_aborted(len(ids))

    def _step(self, engine: LLMEngine) -> None:
        try:
            started = time.perf_counter()
            outputs = engine.step()
            self.step_seconds += time.perf_counter() - started
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
            lost = isinstance(exc, RankGroupLost)  # ... unless it can never step again
            if not lost:
                log.exception("engine step failed; aborting the requests in flight")
            ids = list(self._tracked)
            for rid in ids:
                engine.abort_request(rid)
            self._deliver_error(
                ids, EngineStepError(f"the engine failed: {type(exc).__name__}: {exc}")
            )
            for rid in ids:
                self._tracked.pop(rid, None)
            if lost:
                raise
            return
        now = time.monotonic()
        batch: list[tuple[asyncio.Queue, str, RequestOutput]] = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue  # aborted while the step ran
            self._observe(tracked, out, now)
            if not tracked.stream:
                tracked.last = out
            if out.finished:
                del self._tracked[out.request_id]
            batch.append((tracked.sink, out.request_id, out))
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, batch)

    def _observe(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        num = sum(len(o.token_ids) for o in out.outputs)
        new = num if tracked.stream else num - tracked.num_tokens  # deltas, or everything so far
        tracked.num_tokens += new
        tracked.reasons.update((c.index, c.finish_reason) for c in out.outputs if c.finished)
        m = self._metrics
        # The engine reports a non-streamed request only when it finishes, so token timings
        # (TTFT, inter-token latency) come from streamed requests; e2e latency from all.
        if m is not None and new > 0 and tracked.stream:
            if tracked.first_token_at is None:
                tracked.first_token_at = now
                m.on_first_token(now - tracked.arrival)
            elif tracked.last_token_at is not None:
                m.on_tokens((now - tracked.last_token_at), new)
            tracked.last_token_at = now
        if m is not None and out.finished:
            reasons = [tracked.reasons.get(i, "abort") for i in range(tracked.n)]
            m.on_finished(reasons, tracked.num_tokens, out.num_cached_tokens, now - tracked.arrival)

    def _deliver_error(self, request_ids: list[str], exc: Exception) -> None:
        batch = [(self._tracked[rid].sink, rid, exc) for rid in request_ids if rid in self._tracked]
        if batch and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the event loop is closed: nobody is listening
                pass

    def _dispatch_pulls(self, engine: LLMEngine) -> None:
        """Hand the engine's KV pulls to the puller; each reports back as a command."""
        for task in engine.take_pull_tasks():
            if self.puller is None:
                engine.complete_pull(task.request_id, "this engine has no KV transport")
                continue

            def done(request_id: str, error: str | None) -> None:
                fut: concurrent.futures.Future = concurrent.futures.Future()
                self._commands.put(_Call(lambda e: e.complete_pull(request_id, error), fut))

            self.puller.submit(task, engine.kv_cache, done)

    def _expire(self, engine: LLMEngine) -> None:
        """Once per loop, stepped or idle: the loop's one lease sweep (``step`` does none;
        released and expired leases' blocks are freed here), and every so often idle
        sessions expire."""
        engine.sweep_leases()
        ttl = self._session_ttl
        if not ttl:
            return
        now = time.monotonic()
        if now - self._last_expiry < min(1.0, ttl / 4):
            return
        self._last_expiry = now
        if n := engine.expire_sessions(ttl):
            log.info("expired %d idle session(s)", n)

    def _publish(self, state: str) -> None:
        self.stats = self._engine.stats()
        self.state = state


def aborted_output(
    request_id: str,
    prompt_ids: list[int],
    n: int,
    last: RequestOutput | None,
    finished: dict[int, str],
) -> RequestOutput:
    """The final output of a request aborted on purpose: what a non-streamed one had, marked
    ``abort``; for a streamed one, the delta that ends its unfinished choices."""
    if last is None:
        outputs = [
            CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
            for i in range(n)
            if i not in finished
        ]
        return RequestOutput(
            request_id=request_id, prompt_token_ids=prompt_ids, outputs=outputs, finished=True
        )
    outputs = [
        o if o.finish_reason is not None else dataclasses.replace(o, finish_reason="abort")
        for o in last.outputs
    ]
    return dataclasses.replace(last, outputs=outputs, finished=True)


def _deliver(batch: list[tuple[asyncio.Queue, str, object]]) -> None:
    for sink, rid, item in batch:
        sink.put_nowait((rid, item))
