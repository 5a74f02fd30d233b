"""The engine's side of multi-LoRA, pure bookkeeping: which adapters it serves (by name),
which are resident in the ``max_loras`` device slots (least recently used evicted first),
and whether a waiting request's adapter can join the running batch.

A step may mix the base model and any adapters, as long as the requests running at once use
at most ``max_loras`` distinct ones: the scheduler asks ``admissible`` before admitting a
waiting request, and one whose adapter would be one too many waits (it is skipped, not
failed, and admitted when a slot's last request ends). ``activate`` then makes the step's
adapters resident, evicting only adapters no request of the step uses, and returns each
request's slot. An adapter unloaded by name stays usable by the requests already holding it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from ..models.config import ModelConfig
from .adapter import LoraAdapter, LoraLoadError, load_adapter

if TYPE_CHECKING:
    from ..request import Request


class LoraRegistry:
    def __init__(
        self,
        model_config: ModelConfig,
        max_loras: int,
        max_rank: int,
        load_slot: Callable[[int, LoraAdapter], None],
    ) -> None:
        self.model_config = model_config
        self.max_loras, self.max_rank = max_loras, max_rank
        self._load_slot = load_slot
        self._adapters: dict[str, LoraAdapter] = {}
        # name -> path, replaced whole on each change: other threads read it as it is
        self.served: Mapping[str, str] = MappingProxyType({})
        # identity -> (slot, adapter), least recently used first
        self._resident: OrderedDict[str, tuple[int, LoraAdapter]] = OrderedDict()
        self.loads = 0  # adapters copied into a slot since start

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter (any thread; nothing changes until ``add``)."""
        return load_adapter(name, path, self.model_config, self.max_rank)

    def add(self, adapter: LoraAdapter, replace: bool = False) -> None:
        """Serve ``adapter`` under its name; ``replace`` swaps out the one served under it in
        one change of ``served`` (no moment without the name; requests holding the old one
        finish through it)."""
        if adapter.name in self._adapters and not replace:
            raise LoraLoadError(f"an adapter named {adapter.name!r} is already loaded")
        self._adapters[adapter.name] = adapter
        self.served = MappingProxyType({n: a.path for n, a in self._adapters.items()})

    def remove(self, name: str) -> bool:
        """Stop serving ``name``; requests already holding it finish through it."""
        if self._adapters.pop(name, None) is None:
            return False
        self.served = MappingProxyType({n: a.path for n, a in self._adapters.items()})
        return True

    def get(self, name: str) -> LoraAdapter | None:
        return self._adapters.get(name)

    def admissible(self, req: Request, running: Sequence[Request]) -> bool:
        """Whether ``req`` may run beside ``running`` without more than ``max_loras`` adapters."""
        if req.lora is None:
            return True
        active = {r.lora.identity for r in running if r.lora is not None}
        return req.lora.identity in active or len(active) < self.max_loras

    def activate(self, requests: Sequence[Request]) -> list[int]:
        """Make the step's adapters resident; each request's slot (-1: the base model)."""
        needed = {r.lora.identity: r.lora for r in requests if r.lora is not None}
        for identity in needed:
            if identity in self._resident:
                self._resident.move_to_end(identity)
        for identity, adapter in needed.items():
            if identity not in self._resident:
                self._resident[identity] = (self._free_slot(needed), adapter)
                self._load_slot(self._resident[identity][0], adapter)
                self.loads += 1
        return [-1 if r.lora is None else self._resident[r.lora.identity][0] for r in requests]

    def _free_slot(self, needed: dict[str, LoraAdapter]) -> int:
        used = {slot for slot, _ in self._resident.values()}
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next((i for i in self._resident if i not in needed), None)
        if victim is None:  # the scheduler admits at most max_loras adapters at once
            raise RuntimeError(f"a step uses more than max_loras={self.max_loras} adapters")
        return self._resident.pop(victim)[0]

    @property
    def resident(self) -> list[str]:
        """The names of the resident adapters, least recently used first."""
        return [adapter.name for _, adapter in self._resident.values()]


def adapter_names(requests: Sequence[Request]) -> list[str]:
    """The distinct adapters ``requests`` use, in order (the metrics' label values)."""
    return list(dict.fromkeys(r.lora.name for r in requests if r.lora is not None))
