"""``--lora-config FILE``: the adapters listed in a JSON file stay served as the file changes.

The operator renders an InferenceService's ``spec.loras`` into a ConfigMap mounted into
every engine pod as a directory; the kubelet updates such a volume in place (a new
timestamped directory, then an atomic swap of its ``..data`` link) and never restarts the
pod. So the server polls the file (``POLL_SECONDS``) and reconciles: an adapter new in the
file is loaded, one gone from it is unloaded, each through ``lora_admin``, the path vLLM's
admin routes take; one whose path changed is swapped in place, so its name never stops
being served (the old version keeps serving, and the error is reported, when the new one
does not load). Only the adapters the file brought are unloaded by it: ones loaded by
``--lora-modules`` or HTTP are left alone.

The file is ``[{"name": "sql", "path": "/adapters/sql"}, ...]`` (vLLM's ``--lora-modules``
JSON shape); a missing or empty file means no adapters. A file that does not parse, or an
adapter that cannot be served (missing files, wrong shapes, a name taken), is logged once,
listed in ``/health`` (``lora_config.errors``) and counted by the gauge
``tandem:lora_config_errors``; the engine keeps serving the rest. A failed adapter is tried
again when the file changes, and every ``RETRY_SECONDS`` (its files may still be copying).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tandem.server.engine.lora.adapter import LoraLoadError

from .engine_loop import LOADING, READY
from .lora_admin import LoraNameTaken, load_lora, unload_lora
from .state import ServerState

log = logging.getLogger("tandem.api")
POLL_SECONDS = 2.0
RETRY_SECONDS = 30.0
FILE_ERROR = ""  # the key of ``errors`` for the file itself (adapters are never named "")


class LoraConfigError(ValueError):
    """The file is not a list of ``{name, path}`` with distinct names."""


class LoraEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    path: str = Field(min_length=1)


_ENTRIES = TypeAdapter(list[LoraEntry])


def parse_lora_config(text: str) -> dict[str, str]:
    """The file's adapters, name -> path, in order (empty text: none)."""
    if not text.strip():
        return {}
    try:
        entries = _ENTRIES.validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors()
        )
        raise LoraConfigError(f"not a list of {{name, path}}: {problems}") from None
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise LoraConfigError(f"adapter names repeat: {names}")
    return {e.name: e.path for e in entries}


class LoraConfigWatcher:
    """Keeps one server's adapters equal to what its ``--lora-config`` file lists."""

    def __init__(
        self,
        state: ServerState,
        path: Path,
        poll_seconds: float = POLL_SECONDS,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        self.state, self.path = state, path
        self.poll_seconds, self.retry_seconds = poll_seconds, retry_seconds
        self.managed: dict[str, str] = {}  # the adapters this file brought, name -> path
        self.errors: dict[str, str] = {}  # name (FILE_ERROR: the file) -> why it is not served
        self._seen: str | None = None
        self._retry_at = 0.0

    async def run(self) -> None:
        """Poll until cancelled; one failed round (the engine asleep, a bug) is logged and
        the next one tries again."""
        while True:
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - the watcher outlives any one round
                log.exception("LoRA config %s: reconciling failed", self.path)
            await asyncio.sleep(self.poll_seconds)

    async def sync(self) -> None:
        """One round: reconcile when the file changed, or to retry failed adapters."""
        try:
            text = _read(self.path)
        except OSError as exc:
            self._failed(FILE_ERROR, f"{self.path}: {exc}")
            return
        now = time.monotonic()
        retry = any(self.errors) and now >= self._retry_at
        if text == self._seen and not retry:
            return
        self._retry_at = now + self.retry_seconds
        try:
            desired = parse_lora_config(text)
        except LoraConfigError as exc:  # keep serving what the last good file listed
            self._seen = text
            self._failed(FILE_ERROR, f"{self.path}: {exc}")
            return
        self.errors.pop(FILE_ERROR, None)
        await self._reconcile(desired)
        self._seen = text  # only once reconciled: a round that raised is tried again

    async def _reconcile(self, desired: dict[str, str]) -> None:
        for name in [n for n in self.managed if n not in desired]:
            await unload_lora(self.state, name)
            del self.managed[name]
        for name in [n for n in self.errors if n != FILE_ERROR and n not in desired]:
            del self.errors[name]
        for name, path in desired.items():
            if self.managed.get(name) == path:  # served as listed: a failed swap is undone
                self.errors.pop(name, None)
                continue
            try:
                await load_lora(self.state, name, path, replace=name in self.managed)
            except (LoraLoadError, LoraNameTaken) as exc:
                self._failed(name, str(exc))
                continue
            self.managed[name] = path
            self.errors.pop(name, None)
        self.state.metrics.lora_config_errors.set(len(self.errors))

    def _failed(self, name: str, message: str) -> None:
        """Record why ``name`` as listed (or the file) is not loaded; log it when the reason
        is new. A swap that failed leaves the old version serving under the name."""
        if self.errors.get(name) != message:
            log.warning("LoRA config: %s as listed not loaded: %s", name or "the file", message)
        self.errors[name] = message
        self.state.metrics.lora_config_errors.set(len(self.errors))

    def health(self) -> dict[str, Any]:
        """What ``/health`` shows: the file, the adapters it brought, and what failed."""
        return {"path": str(self.path), "adapters": list(self.managed), "errors": self.errors}


def _read(path: Path) -> str:
    """The file's text; a missing one is no adapters (a local run may write it later)."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


async def watch_lora_config(state: ServerState) -> None:
    """Once the engine is ready, keep its ``--lora-config`` file's adapters served (returns
    at once when it has none)."""
    while state.engine.state == LOADING:
        await asyncio.sleep(0.2)
    if state.engine.state != READY:
        return
    path = await state.engine.call(lambda e: e.config.lora_config)
    if path is None:
        return
    state.lora_config = watcher = LoraConfigWatcher(state, Path(path))
    await watcher.run()
