"""Request and response models: OpenAI's, LMDeploy's and Ollama's field names and shapes.

Types are strict (``"5"`` is not an integer, ``1`` is not a boolean), so a wrong type is a
400 rather than a silent coercion. Unknown fields are accepted and ignored: the OpenAI SDK
and LangChain send fields a given server does not know (``user``, ``store``,
``parallel_tool_calls``, ``service_tier`` ...), and refusing them would break those clients.
The names of ignored fields are logged, and the OpenAPI document says so
(``additionalProperties: true``). Fields we know but cannot honour (image inputs) are
refused with a 400 that says so, never dropped. The ranges the engine enforces
(``SamplingParams``) are declared on the fields too, so the document states exactly what is
accepted (``bench/fuzz.py`` checks both directions).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Bounds on what one request may carry: generous for any real client, small enough that a
# hostile body cannot make the server spend unbounded time or memory before it is refused.
MAX_STOP = 64
MAX_STOP_LEN = 1024
MAX_MESSAGES = 4096
MAX_N = 128
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_TOKEN_IDS = 1_000_000
MAX_INPUTS = 2048  # inputs in one embeddings request, as OpenAI's API allows
MAX_LOGPROBS = 20  # SamplingParams's (the proxy imports this module, never the engine)

Finite = Annotated[float, Field(allow_inf_nan=False, ge=-1e6, le=1e6)]
Temperature = Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=100.0)]
# The ranges SamplingParams enforces, declared here too, so the OpenAPI document says exactly
# what is accepted (schemathesis's positive/negative data checks hold the two together).
TopP = Annotated[float, Field(allow_inf_nan=False, gt=0.0, le=1.0)]
MinP = Annotated[float, Field(allow_inf_nan=False, ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(allow_inf_nan=False, ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(allow_inf_nan=False, gt=0.0, le=1e6)]
TopK = Annotated[int, Field(ge=-1, lt=2**31, description="0 or -1 turns top-k off")]
MaxTokens = Annotated[int, Field(ge=1, lt=2**31)]
MinTokens = Annotated[int, Field(ge=0, lt=2**31)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Bias = Annotated[float, Field(allow_inf_nan=False, ge=-100.0, le=100.0)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)]
# A token id is a vocabulary index: huge ints overflowed the tokenizer's C long (a 500).
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKEN_IDS)]
PromptIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_IDS)]
Text = Annotated[str, Field(min_length=1)]  # a prompt or an input: an empty one is refused
SessionId = (
    Annotated[str, Field(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")] | int
)  # printable: it becomes a URL path segment at the proxy
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class APIModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StrictOut(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----- shared pieces ------------------------------------------------------------------------
class StreamOptions(APIModel):
    include_usage: bool | None = False


class ContentPart(APIModel):
    type: str
    text: str | None = None


class ChatMessage(APIModel):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class JsonSchema(APIModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = False


class ResponseFormat(APIModel):
    type: Literal["text", "json_object", "json_schema", "regex_schema"]
    json_schema: JsonSchema | None = None
    regex_schema: str | None = None


class FunctionDef(APIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(APIModel):
    type: str = "function"
    function: FunctionDef


class SamplingFields(APIModel):
    """Sampling fields every generation route shares (OpenAI's plus vLLM's/LMDeploy's extras)."""

    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: int | None = None
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    min_tokens: MinTokens | None = None
    min_new_tokens: MinTokens | None = Field(
        default=None, description="LMDeploy's name for min_tokens"
    )
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    session_id: SessionId | None = Field(
        default=None,
        description="Keep this conversation's KV cache between turns; empty, null or -1 = "
        "stateless. Scoped to the API key that created it (docs/security.md)",
    )
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        default=None,
        description="vLLM's: partitions the prefix cache further within the API key; only "
        "requests with the same salt (and key) share cached blocks (docs/security.md)",
    )
    return_token_ids: bool | None = False
    prompt_logprobs: LogprobCount | None = Field(
        default=None,
        description="vLLM's: each prompt token's logprob, with this many most likely tokens "
        "(the first token has none)",
    )
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = Field(
        default=None, description="vLLM's: one of json, regex, choice, grammar, json_object"
    )
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None,
        description="P/D handoff: {do_remote_decode: true} on a prefill engine; the prefill's "
        "returned handle (do_remote_prefill, remote_*) on a decode engine",
    )


# ----- OpenAI chat and completions ----------------------------------------------------------
class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | Text = (
        Field(description="The conversation; a string is taken as one user message (LMDeploy)")
    )
    model: str | None = None
    logprobs: bool | None = False
    top_logprobs: LogprobCount | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    do_preprocess: bool | None = True
    add_generation_prompt: bool | None = True
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_N)]
        | PromptIds
        | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_N)]
    )
    model: str | None = None
    echo: bool | None = False
    suffix: (
        Annotated[str, Field(max_length=0, description="not supported: empty or null")] | None
    ) = None
    logprobs: LogprobCount | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None


# ----- LMDeploy's native routes -------------------------------------------------------------
class GenerateRequest(APIModel):
    """LMDeploy's ``POST /generate``: a raw prompt or token ids, no chat template."""

    model_config = ConfigDict(
        json_schema_extra={  # exactly one of the two, not null (a null one is not given)
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
            ]
        }
    )

    model: str | None = None  # the served model or one of its LoRA adapters
    prompt: Text | None = None
    input_ids: PromptIds | None = None
    session_id: SessionId | None = -1
    stream: bool | None = False
    max_tokens: MaxTokens = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    min_tokens: MinTokens | None = None
    seed: int | None = None
    repetition_penalty: RepetitionPenalty | None = 1.0
    presence_penalty: Penalty | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    stop: Stop | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    include_stop_str_in_output: bool | None = False
    return_logprob: bool | None = None
    return_routed_experts: bool | None = False
    image_data: str | dict[str, Any] | list[str | dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class EncodeRequest(APIModel):
    input: str | list[str]
    do_preprocess: bool | None = False
    add_bos: bool | None = True


class AbortRequest(APIModel):
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["session_id"]},
                {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}},
            ]
        }
    )

    abort_all: bool = False
    session_id: SessionId | None = -1
    abort_message: str | None = None
    finished_reason: dict[str, Any] | None = None


# ----- Ollama-style /api/generate -----------------------------------------------------------
class OllamaOptions(APIModel):
    """The sampling part of Ollama's ``options``, bounded like the OpenAI fields; its many
    runner options (``num_ctx``, ``num_gpu`` ...) mean nothing here and are ignored."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: Stop | None = None
    repeat_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None


class OllamaGenerateRequest(APIModel):
    model: str | None = None
    prompt: str = ""
    stream: bool = True
    system: str | None = None
    raw: bool = False
    options: OllamaOptions | None = None
    context: TokenIds | None = None
    images: list[str] | None = None
    format: str | dict[str, Any] | None = None


class OllamaMessage(APIModel):
    role: Role
    content: str = ""
    images: list[str] | None = None


class OllamaChatRequest(APIModel):
    model: str | None = None
    messages: Annotated[list[OllamaMessage], Field(max_length=MAX_MESSAGES)] = Field(
        default_factory=list
    )
    stream: bool = True
    options: OllamaOptions | None = None
    format: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class OllamaShowRequest(APIModel):
    model: str | None = None
    name: str | None = None  # the field's older name


class OllamaEmbedRequest(APIModel):
    """Ollama's ``/api/embed``: one L2-normalised vector per input."""

    model: str | None = None
    input: Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
    truncate: bool | None = True
    options: OllamaOptions | None = None
    keep_alive: str | int | None = None


class OllamaEmbeddingsRequest(APIModel):
    """Ollama's older ``/api/embeddings``: one vector for ``prompt``, not normalised."""

    model: str | None = None
    prompt: Text
    options: OllamaOptions | None = None
    keep_alive: str | int | None = None


class OllamaPullRequest(APIModel):
    """Ollama's ``/api/pull``: fetch a model Tandem knows into the cache."""

    model: str | None = None
    name: str | None = None  # the field's older name
    insecure: bool | None = False
    stream: bool | None = True


class TokenizeRequest(APIModel):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = (
        None
    )
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(APIModel):
    model: str | None = None
    tokens: TokenIds


# ----- embeddings (OpenAI) and /pooling (LMDeploy, vLLM: the same request) --------------
class EmbeddingRequest(APIModel):
    """One vector per input from the served model's final hidden states (docs/pooling.md)."""

    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
        | PromptIds
        | Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_INPUTS)]
    ) = Field(description="A text, texts, token ids, or lists of token ids; none empty")
    model: str | None = None
    encoding_format: Literal["float", "base64"] = Field(
        default="float", description="base64: little-endian float32 bytes"
    )
    dimensions: Annotated[int, Field(ge=1)] | None = Field(
        default=None,
        description="Truncate to this many dimensions (Matryoshka models only; the hidden "
        "size always works), then normalise",
    )
    normalize: bool | None = Field(default=None, description="L2-normalise (default true; vLLM's)")
    user: str | None = None


class PoolingRequest(EmbeddingRequest):
    """LMDeploy's (and vLLM's) ``/pooling``: the embeddings request, answered as pooling data."""


# ----- responses (documented in the OpenAPI schema; routes build them as plain dicts) -------
class UsageInfo(StrictOut):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ChatChoice(StrictOut):
    index: int
    message: dict[str, Any]
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class ChatCompletionResponse(StrictOut):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class CompletionChoice(StrictOut):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class CompletionResponse(StrictOut):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class WeightsInfo(StrictOut):
    """Which weights an engine runs (``engine/weights.py``); ``/health`` shows the path only
    to operators (the admin or internal credential, or a server without keys)."""

    path: str | None = None
    version: int
    weight_version: str | None = None
    loaded_at: float
    updating: bool = False


class ModelCard(StrictOut):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    root: str | None = None
    max_model_len: int | None = None
    weights: WeightsInfo | None = None
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(StrictOut):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class BlockPoolInfo(StrictOut):
    total_blocks: int
    free_blocks: int
    utilization: float


class ModelDetailsInfo(StrictOut):
    """What the served weights are (``engine/model_details.py``; Ollama's ``/api/tags``)."""

    format: str
    family: str
    parameter_count: int
    parameter_size: str
    quantization_level: str
    size: int


class SpecDecodeInfo(StrictOut):
    """Speculative decoding since start (only on an engine that speculates)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    accepted_per_position: list[int]


class HealthResponse(StrictOut):
    status: str
    model: str
    role: str
    uptime: str
    uptime_seconds: float
    active_requests: int
    pending_requests: int
    active_sessions: int
    is_sleeping: bool
    block_pool: BlockPoolInfo
    gpus: int = 0
    gpu_memory_used: str | None = None
    gpu_memory_total: str | None = None
    weights: WeightsInfo | None = None
    lora_adapters: list[str] = []  # the LoRA adapters it serves (the proxy routes by them)
    details: ModelDetailsInfo | None = None
    spec_decode: SpecDecodeInfo | None = None


class GenerateMetaInfo(StrictOut):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    output_token_logprobs: list[tuple[float, int]] | None = None


class GenerateResponse(StrictOut):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


class EncodeResponse(StrictOut):
    input_ids: list[int] | list[list[int]]
    length: int | list[int]


class EmbeddingUsage(StrictOut):
    prompt_tokens: int
    total_tokens: int


class EmbeddingData(StrictOut):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class VectorList(StrictOut):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    usage: EmbeddingUsage


class EmbeddingResponse(VectorList):
    data: list[EmbeddingData]


class PoolingData(StrictOut):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(VectorList):
    data: list[PoolingData]


class ErrorDetail(StrictOut):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(StrictOut):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 415, 429, 500, 503)
}


# One server-sent event as OpenAPI before 3.2 describes an event stream: the schema of each
# event, its ``data`` a JSON chunk (or ``[DONE]``).
SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}


def streamed(media_type: str, what: str) -> dict[int | str, dict[str, Any]]:
    """A generation route's 200: JSON, or with ``stream: true`` a stream of ``media_type``."""
    schema = SSE_EVENT if media_type == "text/event-stream" else {"type": "string"}
    return {
        200: {
            "description": f"The answer; with ``stream: true``, {what}",
            "content": {media_type: {"schema": schema}},
        }
    }


SSE_RESPONSES = ERROR_RESPONSES | streamed("text/event-stream", "server-sent events")
# /metrics (engine and proxy): Prometheus' text exposition format, not JSON.
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


class UpdateWeightsRequest(APIModel):
    """``/update_weights``: LMDeploy's fields, and SGLang's/vLLM's ``model_path``."""

    model_path: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    load_format: str | None = None  # auto (None), safetensors, gguf
    drain: bool = True  # False: abort the requests in flight instead of letting them finish
    abort_all_requests: bool = False  # SGLang's spelling of drain: false
    weight_version: Annotated[str, Field(max_length=256)] | None = None  # a label to report
    model: str | None = None  # the served model it is for (the proxy picks engines by it)
    serialized_named_tensors: str | list[str] | dict[str, Any] | None = None  # LMDeploy's; refused
    finished: bool = False  # LMDeploy's; the update applies at once


LoraName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[^\s,]+$")]


class LoadLoraAdapterRequest(APIModel):
    """vLLM's ``/v1/load_lora_adapter``: serve the PEFT adapter at ``lora_path`` (on the
    server) as the model ``lora_name``."""

    lora_name: LoraName
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]


class UnloadLoraAdapterRequest(APIModel):
    """vLLM's ``/v1/unload_lora_adapter``."""

    lora_name: LoraName
    lora_int_id: int | None = None  # vLLM's; adapters are named here


class UpdateWeightsResponse(StrictOut):
    success: bool
    message: str
    weights: WeightsInfo
