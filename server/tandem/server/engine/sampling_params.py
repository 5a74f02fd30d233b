"""Per-request sampling parameters, shaped like vLLM's so users can carry code over."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .structured import GrammarSpec

MAX_LOGPROBS = 20
# A temperature below this is greedy (vLLM's ``_SAMPLING_EPS``): it is argmax's limit, and
# dividing logits by it would overflow float32 (``1e-300`` turned every logit into inf).
GREEDY_TEMPERATURE = 1e-5


class InvalidParamError(ValueError):
    """A request field with a value the engine refuses; ``param`` names the field for the API."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's, with this many top ones
    skip_special_tokens: bool = True
    structured: GrammarSpec | None = None  # the grammar the output must match (structured.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        _require(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _require(
            self.temperature >= 0.0,
            "temperature",
            f"temperature must be non-negative, got {self.temperature}",
        )
        _require(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _require(
            self.top_k == -1 or self.top_k >= 1,
            "top_k",
            f"top_k must be -1 (off) or at least 1, got {self.top_k}",
        )
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _require(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        _require(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        _require(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"repetition_penalty must be positive, got {self.repetition_penalty}",
        )
        _require(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        _require(
            self.min_tokens >= 0,
            "min_tokens",
            f"min_tokens must be non-negative, got {self.min_tokens}",
        )
        _require(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        for name, n in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            ok = n is None or 0 <= n <= MAX_LOGPROBS
            _require(ok, name, f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")
        _require(all(s for s in self.stop), "stop", "stop strings must be non-empty")
        _require(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative",
        )
        if self.logit_bias:
            _require(
                all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias",
                "logit_bias values must be in [-100, 100]",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParamError(param, message)
