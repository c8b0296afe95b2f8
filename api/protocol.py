"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are strict (no "3" for an integer, no true for a number) and reject unknown fields, as
OpenAI does, so a misspelled parameter is an error rather than silently ignored. Fields OpenAI
defines that change nothing here (user, store, metadata, ...) are accepted and ignored; fields
that would change the result but are not supported (n > 1, logprobs, tools, ...) are accepted by
the schema and refused with a 400 that says so (see api.serving.check_unsupported).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from specdec.engine.sampling_params import BOUNDS
from specdec.engine.tokenizer import unicode_error

SpeculativeMode = Literal["auto", "on", "off"]

_SPECULATIVE_DOC = (
    "specdec extension: speculation for this request. 'auto' lets the controller choose k each "
    "step, 'on' always drafts k tokens, 'off' is plain decode. Overrides the "
    "X-Specdec-Speculative header and the server's A/B split."
)


def _valid_unicode(text: str) -> str:
    problem = unicode_error(text)
    if problem is not None:
        raise ValueError(problem)
    return text


# A string that is valid Unicode: JSON can carry lone surrogates (``"\\ud800"``), which no
# tokenizer or UTF-8 encoder accepts, so they are refused as the request is parsed.
Text = Annotated[str, AfterValidator(_valid_unicode)]


def _bounded(name: str, description: str | None = None) -> Any:
    """An optional field whose range the schema states from engine.sampling_params.BOUNDS.

    The range is checked once, by SamplingParams, whose error the API answers as a 400 naming the
    parameter; the schema only describes it, from the same table, so the two cannot disagree.
    """
    return Field(None, description=description, json_schema_extra=BOUNDS[name].json_schema())


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(RequestModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted for compatibility; nothing is padded


class TextContentPart(RequestModel):
    type: Literal["text"]
    text: Text


# Only an assistant message (one that carries tool calls) may leave out its content; the schema
# says so with this rule, the model validator below enforces it.
_CONTENT_RULE = {
    "anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
    ]
}


class ChatMessage(BaseModel):
    """One chat message. Extra keys (tool_calls, tool_call_id, ...) pass through to the
    model's chat template. Content may be missing or null only for the assistant."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_CONTENT_RULE)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        return self


class SamplingFields(RequestModel):
    """Parameters shared by chat and text completions."""

    model: Text | None = Field(None, description="served model name (default: the only one)")
    max_tokens: int | None = _bounded("max_tokens", "default: up to max_model_len")
    temperature: float | None = _bounded("temperature", "0 is greedy (default 1)")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k", "-1 or 0 disables")
    min_p: float | None = _bounded("min_p")
    presence_penalty: float | None = _bounded("presence_penalty")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    repetition_penalty: float | None = _bounded("repetition_penalty", "1 is off")
    seed: int | None = _bounded("seed")
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = Field(None, description="only 1 is supported")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: Text | None = None
    speculative: SpeculativeMode | None = Field(None, description=_SPECULATIVE_DOC)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _bounded("max_tokens", "wins over max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


class CompletionRequest(SamplingFields):
    prompt: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    ) = Field(
        description="a non-empty string or list of token ids (a one-element batch of either is "
        "accepted)"
    )
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: Text | None = None


# ---- responses ----------------------------------------------------------------------------------


class SpeculativeUsage(BaseModel):
    """specdec extension of ``usage``: what speculation did for this request."""

    arm: str
    mode: str
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    # token trees only: nodes verified per tree step, accepted nodes by rank among siblings
    nodes_per_tree_step: float | None = None
    accepted_per_rank: list[int] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative: SpeculativeUsage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specdec"
    root: str
    max_model_len: int
    draft_model: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class SpeculationHealth(BaseModel):
    method: str
    default_mode: str
    num_speculative_tokens: int
    ab_split: float | None
    mean_k: float
    speculating_fraction: float
    acceptance_rate: float
    mean_accepted_length: float


class HealthResponse(BaseModel):
    status: Literal["ok", "unavailable"]
    ready: bool
    reason: str | None = None
    model: str
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    engine_steps: int
    seconds_since_loop_iteration: float
    speculation: SpeculationHealth
    error: ErrorDetail | None = None
