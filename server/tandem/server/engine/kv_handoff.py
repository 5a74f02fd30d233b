"""The P/D handoff, engine side: leases on a prefill engine, pulls into a decode engine.

Prefill: a request added with ``do_remote_decode`` runs one token; when it finishes, its
blocks go under a lease instead of back to the pool and its output carries the handle.
Decode: a request with a ``do_remote_prefill`` handle takes the prefill's first token as its
own and waits here until it gets blocks; then a ``PullTask`` is queued for the host to run
off the engine thread (the I/O lives in ``tandem.server.disagg``), which reports back with
``complete_pull``. When that first token already ends the request (EOS, a stop string,
``max_tokens: 1``), it finishes at once and its task pulls no blocks, only releases the lease. Bookkeeping only: nothing here does I/O.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from .config import EngineConfig
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVLayout, PullTask, RemotePrefill, handoff_params
from .leases import LeaseStore
from .request import HandoffState, Request, RequestStatus
from .sampling_params import InvalidParamError, SamplingParams
from .scheduler import Scheduler


class KVHandoff:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        scheduler: Scheduler,
        layout: KVLayout,
    ) -> None:
        self.config = config
        self.kv = kv
        self.scheduler = scheduler
        self.layout = layout
        self.engine_id = uuid.uuid4().hex[:12]
        self.address: str | None = None  # set by the host once its transport listens
        self.leases = LeaseStore(kv.pool, config.kv_lease_seconds)
        self.waiting: list[Request] = []  # decode side: waiting for blocks to pull into
        self.pulling: dict[str, Request] = {}
        self._tasks: list[PullTask] = []

    def parse(
        self,
        kv_transfer: dict[str, Any] | None,
        params: SamplingParams,
        session_id: str | None,
        num_prompt_tokens: int,
    ) -> tuple[SamplingParams, HandoffState | None]:
        """A request's ``kv_transfer_params``: its params, and its P/D part (None when it is
        not disaggregated): whether it runs as a prefill, the handle to pull."""
        if not kv_transfer:
            return params, None
        remote_decode = bool(kv_transfer.get("do_remote_decode"))
        remote = (
            RemotePrefill.from_params(kv_transfer) if kv_transfer.get("do_remote_prefill") else None
        )
        if not (remote_decode or remote):
            return params, None
        if params.n != 1 or session_id is not None:
            raise InvalidParamError(
                "kv_transfer_params", "a disaggregated request takes n=1 and no session"
            )
        if self.config.tensor_parallel_size > 1:
            raise InvalidParamError(
                "kv_transfer_params",
                "KV transfer with tensor_parallel_size > 1 is not "
                "supported yet (each rank holds only its own KV heads)",
            )
        if remote is not None and remote.num_tokens != num_prompt_tokens:
            raise InvalidParamError(
                "kv_transfer_params",
                f"the prefill engine computed {remote.num_tokens} prompt "
                f"tokens but this prompt has {num_prompt_tokens}: the engines tokenize differently",
            )
        if remote_decode:
            params = params.clone(max_tokens=1, min_tokens=0)
        return params, HandoffState(remote_decode, remote)

    # ----- prefill side -------------------------------------------------------------------
    @staticmethod
    def check_lora(kv_transfer: dict[str, Any] | None, lora: str | None) -> None:
        """A decode request runs through the LoRA adapter its prefill ran through: the KV it
        pulls was computed by that adapter, and another's (or the base's) would be wrong."""
        if not kv_transfer or not kv_transfer.get("do_remote_prefill"):
            return
        prefilled = kv_transfer.get("lora_name")
        if prefilled != lora:
            raise InvalidParamError(
                "kv_transfer_params",
                f"the prefill ran through LoRA adapter {prefilled!r}, this request names "
                f"{lora!r}: the model must be the same on both engines",
            )

    def grant_lease(self, req: Request) -> None:
        """The finished prompt's blocks stay held for the decode engine's pull."""
        lease_id = self.leases.grant(req.block_ids)
        req.handoff.kv_transfer_params = handoff_params(
            self.engine_id,
            req.block_ids,
            req.num_computed_tokens,
            lease_id,
            self.address,
            req.output_token_ids[:1],
            self.config.kv_lease_seconds,
            req.lora.name if req.lora is not None else None,
        )
        req.block_ids, req.block_hashes = [], []

    # ----- decode side --------------------------------------------------------------------
    def wait_for_blocks(self, req: Request) -> None:
        """A decode request holding the prefill's first token waits here for blocks to pull into."""
        self.waiting.append(req)

    def release_unpulled(self, req: Request) -> None:
        """The first token ended the request: the host only releases the prefill's lease
        (a pull of no blocks), so no engine holds blocks for nobody."""
        remote = req.handoff.remote_prefill
        self._tasks.append(
            PullTask(req.request_id, remote.address, remote.lease_id, remote.engine_id, [], [])
        )

    def admit(self) -> None:
        """Give waiting requests blocks (local prefix hits first, so only the tail is pulled)."""
        still = []
        for req in self.waiting:
            prefix = self.kv.find_cached_prefix(req)
            hit = len(prefix.block_ids)
            if not self.kv.allocate(req, req.num_prompt_tokens - hit * self.kv.block_size, prefix):
                still.append(req)
                continue
            remote = req.handoff.remote_prefill
            end = self.kv.blocks_for(req.num_prompt_tokens)
            self._tasks.append(
                PullTask(
                    req.request_id,
                    remote.address,
                    remote.lease_id,
                    remote.engine_id,
                    remote.block_ids[hit:end],
                    req.block_ids[hit:end],
                )
            )
            req.handoff.pull_in_flight = True
            self.pulling[req.request_id] = req
        self.waiting = still

    def take_pull_tasks(self) -> list[PullTask]:
        """The pulls the host must run (off the engine thread), then report with ``complete_pull``."""
        tasks, self._tasks = self._tasks, []
        return tasks

    def complete_pull(self, request_id: str, error: str | None) -> Request | None:
        """A pull ended; returns the request if that ended it (an error, no fallback)."""
        req = self.pulling.pop(request_id, None)
        if req is None:
            return None
        req.handoff.pull_in_flight = False
        if req.status.finished:  # aborted while its blocks were being written
            self.kv.free(req)
            return None
        if error is None:
            req.num_computed_tokens = req.num_prompt_tokens
            self.kv.cache_full_blocks(req, req.num_computed_tokens)
            self.scheduler.add(req, front=True)
            return None
        self.kv.free(req)
        if self.config.kv_pull_fallback == "recompute":
            req.num_computed_tokens = 0
            self.scheduler.add(req, front=True)
            return None
        req.output.error = f"KV transfer from prefill engine {req.handoff.remote_prefill.engine_id} failed: {error}"
        req.output.error_code = "kv_transfer_error"
        req.status = RequestStatus.FINISHED_ABORTED
        req.times.finished = time.monotonic()
        return req

    def abort(self, req: Request) -> bool:
        """Take an aborted request out; True if a pull still writes into its blocks (freed when
        the pull completes), so the caller must not free them now."""
        if req.handoff is not None and req.handoff.pull_in_flight:
            req.status = RequestStatus.FINISHED_ABORTED
            return True
        if req in self.waiting:
            self.waiting.remove(req)
        return False

    def release_lease(self, lease_id: str) -> bool:
        """Any thread: hand a lease's blocks back (they are freed at the next sweep)."""
        return self.leases.ask_release(lease_id)
