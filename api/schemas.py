"""Request and response bodies of the OpenAI-compatible API (pydantic models)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
)

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class TextPart(BaseModel):
    """A text part of a message's content (OpenAI's `{"type": "text", "text": ...}`)."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message: role and text content (a string or a list of text parts, joined).

    The `developer` role is read as `system`. `pin: true` (an agent_kv extension) pins the
    message's tokens: never evicted or quantized.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    pin: StrictBool = False

    def as_dict(self) -> dict:
        """`{"role", "content", "pin"}` with the content as one string."""
        return {"role": self.role, "content": self.text, "pin": self.pin}

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

    include_usage: StrictBool = False


class SamplingFields(BaseModel):
    """The conversation and sampling fields both chat endpoints take."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        values = [stop] if isinstance(stop, str) else stop or []
        if any(not value for value in values):
            raise ValueError("stop strings must be non-empty")
        return stop


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions` body (the subset this server implements; see the README)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: str | None = Field(default=None, min_length=1, max_length=256)


Role = Literal["system", "user", "assistant", "tool"]


class PinRulesBody(BaseModel):
    """`pin` of a `/chat` request: the protection rules of this turn (`PinRules`)."""

    model_config = ConfigDict(extra="forbid")

    roles: list[Role] = ["system"]
    latest_observations: StrictInt = Field(default=1, ge=0)
    observation_roles: list[Role] = ["tool"]
    patterns: list[str] = []


PolicyText = Annotated[str, StringConstraints(strict=True, max_length=64)]


class PolicyOverride(BaseModel):
    """`policy` of a `/chat` request: a policy for this turn only (`make_policy`)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    budget: StrictInt | None = Field(default=None, ge=1)
    params: dict[str, StrictInt | float | PolicyText] = {}
    """Numbers, or short names such as ARKV's `quantized: "int8"`; `make_policy` checks each
    against its field (a 422 names the parameter)."""


class NativeChatRequest(SamplingFields):
    """`POST /chat` body: the conversation, sampling, and agent_kv's own controls."""

    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    pin: PinRulesBody | None = None
    policy: PolicyOverride | None = None


class PromptTokensDetails(BaseModel):
    """How much of the prompt the session's cache already held."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ConfidenceStats(BaseModel):
    """CONF-KV's confidence `c` over the turn's gated forward calls (`ConfidenceSummary`)."""

    last: float
    mean: float
    min: float
    steps: int


class KVStats(BaseModel):
    """What the session's KV cache holds after the turn (`KVReport`; an agent_kv extension
    of the OpenAI response). Bytes are live KV bytes; token counts sum over layers."""

    policy: str
    session_id: str
    rebuild: str
    kv_bytes: int
    peak_kv_bytes: int
    full_kv_bytes: int
    evicted_tokens: int
    quantized_tokens: int
    pinned_tokens: int
    confidence: ConfidenceStats | None


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


class Timing(BaseModel):
    """Seconds of one turn."""

    wait_s: float
    ttft_s: float
    decode_tokens_per_s: float


class NativeChatResponse(BaseModel):
    """`POST /chat` response."""

    session_id: str
    message: AssistantMessage
    finish_reason: str
    usage: Usage
    kv: KVStats
    timing: Timing
