"""What an idle engine may do to its device memory: sleep (free the KV cache, and the weights
too at level 2), wake up, and swap in new weights.

Each drops every KV block no request holds (the prefix cache, sessions, P/D leases): after
a sleep that memory is gone, after a weight swap its contents are stale.
"""

from __future__ import annotations

from .kv_cache_manager import KVCacheManager
from .kv_handoff import KVHandoff
from .models.config import ModelConfig
from .sampling_params import InvalidParamError
from .sessions import SessionStore
from .weights import WeightsIdentity, check_compatible
from .worker import Worker


class EngineSleepingError(RuntimeError):
    """The engine's memory is released (sleep mode): the API's 503."""


class EngineBusyError(RuntimeError):
    """An operation that needs an idle engine was asked for while requests are in flight."""


class DeviceMemory:
    def __init__(
        self,
        worker: Worker,
        kv: KVCacheManager,
        sessions: SessionStore,
        handoff: KVHandoff,
        model_config: ModelConfig,
        model_path: str,
    ) -> None:
        self.worker, self.kv, self.sessions, self.handoff = worker, kv, sessions, handoff
        self.model_config = model_config
        self.level = 0
        self.weights = WeightsIdentity(model_path)

    def check_awake(self) -> None:
        if self.level:
            raise EngineSleepingError("the engine is asleep; POST /wakeup first")

    def sleep(self, level: int, in_flight: int) -> None:
        """Free the KV cache (level 1) and the weights too (level 2; reloaded from disk on
        wake-up). On a GPU, level 1 parks the weights in host memory."""
        if level not in (1, 2):
            raise InvalidParamError("level", f"sleep level must be 1 or 2, got {level}")
        if self.level:
            return
        if in_flight:
            raise EngineBusyError(f"{in_flight} requests are in flight; abort them before sleeping")
        self._drop_cached_kv()
        self.worker.sleep(level)
        self.level = level

    def wake_up(self) -> None:
        if self.level:
            self.worker.wake_up(self.level)
            self.level = 0

    def update_weights(self, path: str, label: str | None, in_flight: int) -> WeightsIdentity:
        """Replace the weights with ``path``'s (a model directory or a GGUF file of the same
        shapes). ``WeightsMismatchError`` (nothing changed) when they do not fit."""
        self.check_awake()
        if in_flight:
            raise EngineBusyError(f"{in_flight} requests are in flight; drain or abort them first")
        check_compatible(self.model_config, path)
        self.worker.load_weights(path)
        self._drop_cached_kv()
        self.weights = self.weights.updated(str(path), label)
        return self.weights

    def _drop_cached_kv(self) -> None:
        self.sessions.clear()
        self.handoff.leases.clear()
        self.kv.pool.reset_prefix_cache()
