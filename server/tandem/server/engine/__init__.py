"""The generation engine: paged KV cache, continuous batching, exact against HuggingFace."""

from .config import EngineConfig
from .limits import PromptTooLongError
from .llm import LLM
from .llm_engine import LLMEngine
from .memory import EngineBusyError, EngineSleepingError
from .outputs import CompletionOutput, RequestOutput
from .pooling import PoolingParams
from .sampling_params import InvalidParamError, SamplingParams

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "PoolingParams",
    "RequestOutput",
    "CompletionOutput",
    "InvalidParamError",
    "PromptTooLongError",
    "EngineSleepingError",
    "EngineBusyError",
]
