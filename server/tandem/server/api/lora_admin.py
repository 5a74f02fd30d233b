"""Serving an adapter under a name, and stopping: the one path that both vLLM's admin routes
(``lora_routes``) and the ``--lora-config`` watcher (``lora_config``) take, so an adapter
hot-loaded from the operator's ConfigMap is checked and added exactly as one loaded by HTTP.

The adapter is read and checked off the engine thread (``LoraLoadError`` says what does not
fit, and nothing changes), then added between two steps; unloading lets the requests
already running through it finish.
"""

from __future__ import annotations

import asyncio
import logging

from tandem.server.engine.lora.adapter import LoraAdapter

from .state import ServerState

log = logging.getLogger("tandem.api")


class LoraNameTaken(ValueError):
    """The name is the base model's, ``default``, or an adapter already served."""


async def load_lora(state: ServerState, name: str, path: str, replace: bool = False) -> LoraAdapter:
    """Read, check and serve the adapter at ``path`` as ``name``; ``replace``: in place of
    the adapter served as ``name``, which keeps serving if the new one does not load."""
    taken = name in state.engine.served_loras and not replace
    if name in (state.model_name, "default") or taken:
        raise LoraNameTaken(f"The lora adapter '{name}' has already been loaded.")
    read = await state.engine.call(lambda e: e.read_lora)
    adapter = await asyncio.to_thread(read, name, path)
    await state.engine.call(lambda e: e.add_lora(adapter, replace))
    log.info("LoRA adapter %s loaded from %s (rank %d)", name, path, adapter.rank)
    return adapter


async def unload_lora(state: ServerState, name: str) -> bool:
    """Stop serving ``name`` (False: no such adapter)."""
    removed = await state.engine.call(lambda e: e.remove_lora(name))
    if removed:
        log.info("LoRA adapter %s unloaded", name)
    return removed
