"""Request and response bodies of the OpenAI-compatible API (pydantic models)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class TextPart(BaseModel):
    """A text part of a message's content (OpenAI's `{"type": "text", "text": ...}`)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message: role and text content (a string or a list of text parts, joined).

    The `developer` role is read as `system`.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role

    @property
    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    """`stream_options`: whether the stream ends with a usage chunk."""

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """`POST /v1/chat/completions` body (the subset this server implements; see the README)."""

    model_config = ConfigDict(extra="allow")

    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        values = [stop] if isinstance(stop, str) else stop or []
        if any(not value for value in values):
            raise ValueError("stop strings must be non-empty")
        return stop


class PromptTokensDetails(BaseModel):
    """How much of the prompt the session's cache already held."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KVStats(BaseModel):
    """What the request's KV cache held (agent_kv extension of the response)."""

    policy: str
    session_id: str | None
    rebuild: str
    peak_kv_bytes: int
    kv_bytes: int
    full_kv_bytes: int
    evicted_tokens: int
    quantized_tokens: int


class AssistantMessage(BaseModel):
    """The reply message."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One generated reply."""

    index: int
    message: AssistantMessage
    finish_reason: str


class ChatCompletion(BaseModel):
    """`POST /v1/chat/completions` response."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv: KVStats


class ErrorDetail(BaseModel):
    """OpenAI-shaped error detail."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI-shaped error body: `{"error": {...}}`."""

    error: ErrorDetail
