"""What one server instance holds: its settings, engine loop, tokenizer and metrics.

Kept on ``app.state.tandem`` so two apps in one process (tests) never share anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from tandem.server.wire.auth import Credentials
from tandem.server.wire.edge import DEFAULT_MAX_TOKENS, EdgeSettings
from tandem.server.wire.errors import APIError

from .chat_history import ChatHistories
from .engine_loop import READY, AsyncEngine
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from .lora_config import LoraConfigWatcher

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class ServerSettings:
    """Server-level knobs (not engine config): naming, auth, admission, sessions, shutdown."""

    model_dir: str
    served_model_name: str
    api_key: str | None = None
    role: str = "both"
    # More client keys (a key file); the internal credential (proxy <-> engines, P/D) and
    # the admin key. See docs/security.md.
    extra_api_keys: frozenset[str] = frozenset()
    internal_api_key: str | None = None
    admin_api_key: str | None = None
    max_waiting_requests: int | None = 256
    session_ttl: float | None = 600.0
    shutdown_timeout: float = 30.0
    tool_call_parser: str | None = None  # None: chosen by the chat template's family
    reasoning_parser: str | None = None
    edge: EdgeSettings = EdgeSettings()
    # max_tokens for a request that sets none (--default-max-tokens); None: to the context's end.
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.default_max_tokens is not None and self.default_max_tokens <= 0:
            raise ValueError("default_max_tokens must be > 0")
        if self.session_ttl is not None and self.session_ttl <= 0:
            raise ValueError("session_ttl must be > 0")
        self.credentials  # noqa: B018 - validates the keys (distinct, non-empty)

    @property
    def credentials(self) -> Credentials:
        clients = set(self.extra_api_keys) | ({self.api_key} if self.api_key else set())
        # An engine with the internal credential and no client key is a P/D back end: only
        # its proxy (and the admin) may call it. With only an admin key, clients need none.
        return Credentials(
            frozenset(clients),
            self.internal_api_key,
            self.admin_api_key,
            keyless_clients=not self.internal_api_key,
        )


@dataclass
class ServerState:
    settings: ServerSettings
    engine: AsyncEngine
    tokenizer: Any
    vocab_size: int
    metrics: ServerMetrics
    started_at: float = field(default_factory=time.time)
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    histories: ChatHistories = field(default_factory=lambda: ChatHistories(None))
    # The API tokenizer's thread (generation.off_loop) and its longest vocabulary entry.
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
    )
    longest_token_chars: int = 0
    # Set by the process runner (serve_cli) so /terminate can stop the server.
    shutdown: Callable[[], None] | None = None
    # The --lora-config file's watcher, once the engine is ready (lora_config.py).
    lora_config: LoraConfigWatcher | None = None

    def __post_init__(self) -> None:
        if not self.longest_token_chars:
            self.longest_token_chars = max(map(len, self.tokenizer.get_vocab()))

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name

    def check_model(self, name: str | None) -> str:
        """The ``model`` field may be the served name (Ollama's ``:latest`` tag aside),
        ``default`` (ZSE's), left out, or a LoRA adapter's name (``lora_of``); anything else
        is a 404 naming the served one, so a client asking for another model never gets this
        one's answer unknowingly."""
        served = self.settings.served_model_name
        if name in (None, "", "default", served) or name == f"{served}:latest":
            return self.settings.served_model_name
        if name in self.engine.served_loras:
            return name
        raise APIError(
            404,
            f"The model '{name}' does not exist; this server serves "
            f"'{self.settings.served_model_name}'",
            code="model_not_found",
            param="model",
        )

    def lora_of(self, model: str) -> str | None:
        """The adapter a checked ``model`` names (None: the base model)."""
        return None if model == self.settings.served_model_name else model

    def check_admitting(self) -> None:
        """503 while loading, failed, asleep or draining for shutdown."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        state = self.engine.state
        if state != READY:
            raise APIError(503, f"the engine is {state}; retry later", code=f"engine_{state}")
        if self.engine.stats.is_sleeping:
            raise APIError(503, "the engine is asleep; POST /wakeup first", code="engine_sleeping")


def get_state(request: Request) -> ServerState:
    return request.app.state.tandem
