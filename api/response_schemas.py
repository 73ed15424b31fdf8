"""Response bodies of the API (pydantic models): chat completions and their usage and KV
figures, the native `/chat` reply, errors, `/tokenize` and the session listings. The requests'
are in `api.schemas`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from api.schemas import ToolCallBody


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


def _deprecated_alias(of: str) -> Any:
    """A response field kept under its old name for one release, equal to the field `of`:
    marked deprecated in the schema, with a description saying so."""
    note = f"deprecated alias of {of}, removed in the next release"
    return Field(deprecated=note, description=f"{note[0].upper()}{note[1:]}.")


class KVStats(BaseModel):
    """What the session's KV cache holds after the turn (`KVReport`; an agent_kv extension
    of the OpenAI response). Live bytes count the keys, values and scales held, allocated
    bytes the buffers holding them (spare capacity included); the shared prefix blocks the
    session reads are held once for every session, so counted apart. Token counts sum over
    layers."""

    policy: str
    session_id: str
    rebuild: str
    kv_live_bytes: int = Field(description="Live KV bytes now.")
    kv_allocated_bytes: int = Field(description="Bytes the KV buffers hold now.")
    peak_kv_live_bytes: int = Field(description="The most live KV bytes the session has held.")
    peak_kv_allocated_bytes: int = Field(
        description="The most bytes the session's KV buffers have held."
    )
    full_kv_live_bytes: int = Field(
        description="Live bytes a full KV cache at full precision would hold for the "
        "session's tokens."
    )
    full_kv_allocated_bytes: int = Field(
        0,
        description="Bytes a full KV cache at full precision would allocate for the "
        "session's tokens under the same growth rule.",
    )
    kv_shared_bytes: int = Field(
        description="Bytes of the shared prefix blocks the session reads (apart from its own)."
    )
    cold_kv_bytes: int = Field(
        0, description="Bytes of the session's cold tier (evicted tokens kept for recall)."
    )
    peak_cold_kv_bytes: int = Field(0, description="The most bytes the cold tier has held.")
    tokens_seen: int = Field(0, description="Tokens the session's cache has taken in.")
    evicted_tokens: int
    quantized_tokens: int
    reencoded_tokens: int = 0
    pinned_tokens: int
    confidence: ConfidenceStats | None
    image_parts_dropped: int = 0
    """Image parts of the request dropped unread (a server started with
    `--drop-image-parts`); the model saw the request's text only."""
    kv_bytes: int = _deprecated_alias("kv_live_bytes")
    peak_kv_bytes: int = _deprecated_alias("peak_kv_live_bytes")
    full_kv_bytes: int = _deprecated_alias("full_kv_live_bytes")


class AssistantMessage(BaseModel):
    """The reply message: its text, or (content null) the tool calls it makes."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallBody] | None = None


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


class TokenizeResponse(BaseModel):
    """Token ids of a `POST /tokenize` request."""

    tokens: list[int]
    count: int
    max_model_len: int


class SessionInfo(BaseModel):
    """One session of `GET /sessions` (`SessionStore.describe`)."""

    id: str
    tokens: int
    kv_live_bytes: int
    kv_allocated_bytes: int
    pinned_tokens: int
    policy: str | None
    last_used: float
    where: Literal["memory", "disk"]
    busy: bool
    replica: str | None = Field(
        default=None,
        description="The replica holding the session (`serve --replicas`); null on one server.",
    )
    kv_bytes: int = _deprecated_alias("kv_live_bytes")


class SessionList(BaseModel):
    """`GET /sessions` response."""

    object: Literal["list"] = "list"
    data: list[SessionInfo]


class DeletedSession(BaseModel):
    """`DELETE /sessions/{id}` response."""

    id: str
    deleted: bool


class Health(BaseModel):
    """`GET /health` response."""

    status: Literal["ok"]
    model: str
    policy: str


class ModelCard(BaseModel):
    """One model of `GET /v1/models`."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    """`GET /v1/models` response."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
