"""Request bodies of the API (pydantic models; the responses' are in `api.response_schemas`).

Every string a client sends is checked to be valid Unicode (`Text`): JSON can carry a lone
UTF-16 surrogate (`"\\ud800"`), which no tokenizer or regex engine takes, so it is refused
as a 400 naming the field. Numbers are strict: `"0.5"` is not a temperature. In a request
body, an optional field's `null` means its default (`RequestBody`), as OpenAI reads the
fields it documents as nullable.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from annotated_types import Ge, Le
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Strict,
    StrictBool,
    StringConstraints,
    Tag,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from agent_kv.kv.policies import POLICIES
from agent_kv.kv.policy_names import RECALL_SUFFIX
from agent_kv.runtime.replies.tool_calls import TOOL_NAME_PATTERN, ToolCall
from agent_kv.valid_text import check_unicode

SEED_RANGE = (-(2**53 - 1), 2**53 - 1)
"""Seeds a client may send: the integers every JSON parser reads exactly (I-JSON, RFC 7493
§2.2), all within what `torch.Generator.manual_seed` takes."""
SESSION_ID_CHARS = 256
"""The longest session id (body field or `X-Session-Id` header), in characters."""


def _valid_unicode(text: str) -> str:
    """`text` unchanged, or a `ConfigError` (a ValueError, so a validation error) naming the
    first lone surrogate."""
    check_unicode(text, "the text")
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
"""A client string: valid Unicode (no lone surrogates)."""
Number = Annotated[float, Strict()]
"""A JSON number (an integer or a float; never a string or a boolean)."""


def _integral(value):
    """`4.0` -> `4` (JSON Schema counts an integral number as an integer); others as given."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Count = Annotated[int, Strict(), BeforeValidator(_integral)]
"""A JSON integer (`4` or `4.0`; never `"4"`, `4.5` or a boolean)."""
PositiveCount = Annotated[int, Strict(), Ge(1), BeforeValidator(_integral)]
ParamCount = Annotated[
    int, Strict(), Ge(SEED_RANGE[0]), Le(SEED_RANGE[1]), BeforeValidator(_integral)
]
"""An integer policy parameter: one every JSON parser reads exactly (as seeds)."""
NonNegativeCount = Annotated[int, Strict(), Ge(0), BeforeValidator(_integral)]
Seed = Annotated[int, Strict(), Ge(SEED_RANGE[0]), Le(SEED_RANGE[1]), BeforeValidator(_integral)]
SessionId = Annotated[
    str,
    StringConstraints(min_length=1, max_length=SESSION_ID_CHARS),
    AfterValidator(_valid_unicode),
]
PolicyName = Literal[
    tuple(POLICIES)
    + tuple(name + RECALL_SUFFIX for name, cls in POLICIES.items() if cls.takes_budget)
]
"""A policy by name, or a budgeted one with its cold tier and recall (`h2o+recall`)."""
StopText = Annotated[str, StringConstraints(min_length=1), AfterValidator(_valid_unicode)]
"""A stop string: non-empty."""
MAX_STOP = 4
"""Stop strings one request may give (OpenAI's limit)."""


def _at_most_max_stop(stops: list[str]) -> list[str]:
    """`stops` unchanged, or an error saying the limit when there are more than `MAX_STOP`."""
    if len(stops) > MAX_STOP:
        raise PydanticCustomError(
            "too_long",
            "at most {limit} stop strings (OpenAI's limit), got {count}",
            {"limit": MAX_STOP, "count": len(stops)},
        )
    return stops


Stop = Annotated[
    Annotated[StopText, Tag("str")]
    | Annotated[
        list[StopText],
        AfterValidator(_at_most_max_stop),
        WithJsonSchema(
            {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP}
        ),
        Tag("list"),
    ],
    Discriminator(lambda value: "list" if isinstance(value, list) else "str"),
]
"""`stop`: one string, or a list of at most `MAX_STOP` (read by its JSON type, so a list too
long is refused as that, not as "not a string")."""
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
"""A token id as `logit_bias` keys it: JSON keys are text (`"1234"`)."""
MAX_LOGIT_BIAS = 1024
"""Tokens one request's `logit_bias` may name."""


def _admits_null(schema: dict) -> bool:
    """Whether a JSON schema admits `null` (its type, or one of its `anyOf`/`oneOf` branches)."""
    branches = [schema, *schema.get("anyOf", []), *schema.get("oneOf", [])]
    return any(branch.get("type") == "null" for branch in branches)


def _nullable_optional_fields(schema: dict, model: type[BaseModel]) -> None:
    """Mark every optional property of a `RequestBody`'s JSON schema nullable (`anyOf` with
    `null`; its title, description and default stay outside)."""
    required = set(schema.get("required", []))
    properties = schema.get("properties", {})
    for name, prop in properties.items():
        if name in required or _admits_null(prop):
            continue
        meta = {key: prop.pop(key) for key in ("title", "description", "default") if key in prop}
        properties[name] = {"anyOf": [prop, {"type": "null"}], **meta}


class RequestBody(BaseModel):
    """A request body in which an optional field's `null` means its default, as OpenAI reads
    every field it documents as nullable (`"temperature": null` is the default temperature,
    `"stream": null` no stream); the JSON schema shows those fields nullable. A required
    field's `null` is refused as missing."""

    model_config = ConfigDict(json_schema_extra=_nullable_optional_fields)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """The body without its optional fields that are null (so they take their defaults);
        anything but a JSON object as it is."""
        if not isinstance(data, dict):
            return data
        optional = {name for name, info in cls.model_fields.items() if not info.is_required()}
        return {
            key: value for key, value in data.items() if value is not None or key not in optional
        }


class TextPart(BaseModel):
    """A text part of a message's content (OpenAI's `{"type": "text", "text": ...}`)."""

    type: Literal["text"]
    text: Text


class ImagePart(BaseModel):
    """An image part of a user message (OpenAI's `{"type": "image_url", "image_url": {"url":
    ...}}`). The model reads text only: a request holding one is a 400, or, on a server
    started with `--drop-image-parts`, the part is dropped and counted
    (`KVStats.image_parts_dropped`)."""

    type: Literal["image_url"]
    image_url: dict[str, Any]


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


ToolName = Annotated[str, StringConstraints(strict=True, pattern=TOOL_NAME_PATTERN)]
"""A function's name (`tool_calls.TOOL_NAME_PATTERN`)."""
CallId = Annotated[
    str, StringConstraints(strict=True, min_length=1, max_length=64), AfterValidator(_valid_unicode)
]
"""A tool call's id."""
MAX_TOOLS = 128
"""Tools one request may offer."""


class FunctionCallBody(BaseModel):
    """The function of a tool call: its name and its arguments as JSON text."""

    name: ToolName
    arguments: Text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError("arguments must be a JSON object (text)") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object (text)")
        return arguments


class ToolCallBody(BaseModel):
    """One tool call, as an assistant message carries it (OpenAI's `tool_calls` item)."""

    id: CallId
    type: Literal["function"] = "function"
    function: FunctionCallBody

    @classmethod
    def of(cls, call: ToolCall) -> ToolCallBody:
        """The body of a call the model made."""
        return cls(id=call.id, function=FunctionCallBody(name=call.name, arguments=call.arguments))

    def call(self) -> ToolCall:
        """The call for rendering into the conversation."""
        return ToolCall(self.id, self.function.name, self.function.arguments)


class MessageFields(BaseModel):
    """What every message has: text content (a string or a list of text parts, joined),
    OpenAI's `name` of its author, and `pin: true` (an agent_kv extension), which pins the
    message's tokens: never evicted or quantized.

    `name` goes to the chat template (`agent_kv.runtime.chat.rendering`); on a message of a
    role whose name the template does not render it is a 400, and on a tool message it must
    be the name of the call the message answers (`api.chat_request.check_names`)."""

    content: Text | list[ContentPart]
    name: Text | None = None
    pin: StrictBool = False

    def as_dict(self) -> dict:
        """`{"role", "content", "pin", "tool_calls", "tool_call_id"}` with the content as one
        string and the calls as `ToolCall`s (`agent_kv.runtime.chat.rendering`), and `name`
        when the message has one."""
        message = {
            "role": self.role,
            "content": self.text,
            "pin": self.pin,
            "tool_calls": [call.call() for call in getattr(self, "tool_calls", None) or []],
            "tool_call_id": getattr(self, "tool_call_id", None),
        }
        return message if self.name is None else {**message, "name": self.name}

    @property
    def text(self) -> str:
        """The content as one string ("" for none)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_parts(self) -> list[int]:
        """Indices of the content's image parts (none for text content)."""
        if isinstance(self.content, str) or self.content is None:
            return []
        return [i for i, part in enumerate(self.content) if isinstance(part, ImagePart)]


class SystemMessage(MessageFields):
    """A system message; the `developer` role is read as `system`."""

    role: Literal["system", "developer"]

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role


class UserMessage(MessageFields):
    """A user message."""

    role: Literal["user"]


class AssistantTurn(MessageFields):
    """An earlier reply: its text, and the `tool_calls` it made (content may then be null or
    absent, read as empty)."""

    role: Literal["assistant"]
    content: Text | list[ContentPart] | None = None
    tool_calls: list[ToolCallBody] | None = None


class ToolResult(MessageFields):
    """A tool's result; `tool_call_id` names the call it answers, which must be a call of an
    earlier assistant message (without it the message is an observation of role `tool`)."""

    role: Literal["tool"]
    tool_call_id: CallId | None = None


def _message_kind(message) -> str | None:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return MESSAGE_KINDS.get(role) if isinstance(role, str) else None


MESSAGE_KINDS = {
    "system": "System",
    "developer": "System",
    "user": "User",
    "assistant": "Assistant",
    "tool": "Tool",
}
"""A message's role -> its kind (the tag of `ChatMessage`'s union)."""


class CallResult(ToolResult):
    """A tool's result on the OpenAI route, which names the call it answers (OpenAI requires
    `tool_call_id`)."""

    tool_call_id: CallId


def _message_union(tool_result: type[ToolResult]) -> Any:
    """The union of the message kinds, by role, with `tool_result` for role `tool`."""
    return Annotated[
        Annotated[SystemMessage, Tag("System")]
        | Annotated[UserMessage, Tag("User")]
        | Annotated[AssistantTurn, Tag("Assistant")]
        | Annotated[tool_result, Tag("Tool")],
        Discriminator(
            _message_kind,
            custom_error_type="invalid_role",
            custom_error_message="role must be one of system, developer, user, assistant, tool",
        ),
    ]


ChatMessage = _message_union(ToolResult)
"""One message of a conversation, by its role."""
OpenAIChatMessage = _message_union(CallResult)
"""One message of an OpenAI-route conversation: a tool message names its call."""


class FunctionBody(BaseModel):
    """A function tool: its name, description and the JSON Schema of its arguments."""

    name: ToolName
    description: Text = ""
    parameters: dict[str, Any] = {}
    strict: StrictBool | None = None
    """Accepted; calls are always decoded under the schema, as with `strict: true`."""


class ToolBody(BaseModel):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionBody


class NamedFunction(BaseModel):
    """The function a `tool_choice` names."""

    name: ToolName


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the reply calls it."""

    type: Literal["function"]
    function: NamedFunction


class JSONSchemaBody(BaseModel):
    """`response_format.json_schema`: the schema the reply validates against."""

    model_config = ConfigDict(populate_by_name=True)

    name: ToolName
    description: Text = ""
    schema_: dict[str, Any] = Field(default={}, alias="schema")
    strict: StrictBool | None = None
    """Accepted; the reply is always decoded under the schema, as with `strict: true`."""


class TextFormat(BaseModel):
    """`response_format` of plain text (the default)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    """`response_format`: any JSON object."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]


class JSONSchemaFormat(BaseModel):
    """`response_format`: JSON valid against a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    json_schema: JSONSchemaBody


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]


class ReplyFields(RequestBody):
    """The tool and format fields both chat endpoints take (OpenAI's): what the reply may
    be. Calls and schema'd replies are decoded under a grammar (`ReplySpec.grammar`), so
    they always parse and validate."""

    tools: list[ToolBody] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: `auto` with tools, `none` without."""
    parallel_tool_calls: StrictBool = True
    response_format: ResponseFormat | None = None


class StreamOptions(BaseModel):
    """`stream_options`: whether the stream ends with a usage chunk."""

    include_usage: StrictBool = False


class SamplingFields(RequestBody):
    """The conversation and sampling fields both chat endpoints take: OpenAI's, and the
    `top_k`, `min_p` and `repetition_penalty` of vLLM and llama.cpp
    (`agent_kv.runtime.replies.sampling`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveCount | None = None
    temperature: Number = Field(default=0.0, ge=0.0, le=2.0)
    top_p: Number = Field(default=1.0, gt=0.0, le=1.0)
    stop: Stop | None = None
    """At most `MAX_STOP` strings (OpenAI's limit); they end free text, never a tool call or
    a JSON reply (`ReplySpec.scope_stop`)."""
    seed: Seed | None = None
    frequency_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    """Subtracted from a token's logit once per time the reply has generated it."""
    presence_penalty: Number = Field(default=0.0, ge=-2.0, le=2.0)
    """Subtracted from the logit of every token the reply has generated."""
    logit_bias: dict[TokenIdKey, Number] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    """Token id (as a JSON key) -> value in [-100, 100] added to its logit; an id outside the
    model's vocabulary is a 400."""
    top_k: Count = Field(default=0, ge=-1)
    """Sample from the `top_k` most likely tokens only; 0 or -1 for every token."""
    min_p: Number = Field(default=0.0, ge=0.0, le=1.0)
    """Sample only tokens at least `min_p` times as likely as the most likely one."""
    repetition_penalty: Number = Field(default=1.0, gt=0.0)
    """Divides the positive logits (multiplies the negative ones) of every token of the prompt
    and the reply so far; 1 for none."""


Role = Literal["system", "user", "assistant", "tool"]


class PinRulesBody(BaseModel):
    """`pin` of a `/chat` request: the pin rules of this turn (`PinRules`)."""

    model_config = ConfigDict(extra="forbid")

    roles: list[Role] = ["system"]
    latest_observations: NonNegativeCount = 1
    observation_roles: list[Role] = ["tool"]
    patterns: list[Text] = []
    """RE2 patterns; more than `agent_kv.runtime.chat.pin_rules.MAX_PATTERNS`, one over
    `pin_rules.MAX_PATTERN_CHARS` characters or one RE2 cannot compile is a 422."""
    tool_names: list[ToolName] = Field(default=[], max_length=MAX_TOOLS)
    """Tools whose results are always pinned."""
    tool_calls: StrictBool = False
    """Pin every assistant message that calls tools."""


class NoOpFields(BaseModel):
    """OpenAI's request fields that change nothing the model writes, accepted with no effect
    (docs/server.md, "OpenAI fields"): the one list of them."""

    store: StrictBool | None = None
    metadata: dict[Text, Text] | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    safety_identifier: Text | None = None


UNSUPPORTED_FIELDS: dict[str, list] = {
    "functions": [[]],
    "function_call": ["none"],
    "logprobs": [False],
    "top_logprobs": [0],
    "audio": [],
    "modalities": [["text"]],
    "prediction": [],
    "reasoning_effort": [],
    "verbosity": ["medium"],
    "web_search_options": [],
}
"""OpenAI's request fields that would change the reply and this server does not implement ->
the values, besides null, that ask for nothing beyond plain text: the one list of them.
Those are accepted with no effect, any other value is a 400 saying unsupported
(`api.chat_request.refuse_unsupported`). `functions` and `function_call` are OpenAI's
deprecated forms of `tools` and `tool_choice`."""

JSON_TYPES = {bool: "boolean", int: "integer", str: "string", list: "array", dict: "object"}
"""The JSON Schema type of a Python value read from JSON, by its class."""


def _accepted_only(accepted: list) -> dict:
    """The JSON schema of a field of `UNSUPPORTED_FIELDS` that accepts the values `accepted`
    (of one JSON type) besides null."""
    if not accepted:
        return {"type": "null"}
    return {"type": JSON_TYPES[type(accepted[0])], "enum": accepted}


UnsupportedFields = create_model(
    "UnsupportedFields",
    __doc__="The fields of `UNSUPPORTED_FIELDS`: any JSON value is read (so that the 400 says "
    "unsupported), and the JSON schema lists the values accepted.",
    **{
        name: (Annotated[Any, WithJsonSchema(_accepted_only(accepted))], None)
        for name, accepted in UNSUPPORTED_FIELDS.items()
    },
)


class ChatCompletionRequest(SamplingFields, ReplyFields, NoOpFields, UnsupportedFields):
    """`POST /v1/chat/completions` body (docs/server.md, "OpenAI fields"): closed, so any other
    field is a 400 "Unrecognized request argument supplied", as OpenAI answers it."""

    model_config = ConfigDict(extra="forbid")

    messages: list[OpenAIChatMessage] = Field(min_length=1)
    model: Text | None = None
    max_completion_tokens: PositiveCount | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[Count, Field(json_schema_extra={"enum": [1]})] = 1
    """Only 1: other values are a 400 saying so."""
    user: SessionId | None = None
    pin: PinRulesBody | None = None
    """agent_kv's pin rules for this turn, as `/chat` takes them."""


PolicyText = Annotated[
    str, StringConstraints(strict=True, max_length=64), AfterValidator(_valid_unicode)
]


class PolicyOverride(BaseModel):
    """`policy` of a `/chat` request: a policy for this turn only (`make_policy`)."""

    model_config = ConfigDict(extra="forbid")

    name: PolicyName
    budget: PositiveCount | None = None
    params: dict[Text, ParamCount | Number | PolicyText] = {}
    """Numbers, or short names such as ARKV's `quantized: "int8"`; `make_policy` checks each
    against its field (a 422 names the parameter)."""
    recall: dict[Text, ParamCount | PolicyText] | None = None
    """The cold tier's settings (`ColdConfig`: `page_tokens`, `pages`, `queries`, `every`,
    `cap_bytes` as bytes or a size such as `"64MB"`, `fmt`, `score`); present, even empty,
    it wraps the policy in recall as a `+recall` name does. A 422 names a bad setting."""


class NativeChatRequest(SamplingFields, ReplyFields):
    """`POST /chat` body: the conversation, sampling, and agent_kv's own controls."""

    model_config = ConfigDict(extra="forbid")

    session_id: SessionId | None = None
    pin: PinRulesBody | None = None
    policy: PolicyOverride | None = None


class TokenizeText(RequestBody):
    """`POST /tokenize` of plain text."""

    model_config = ConfigDict(extra="forbid")

    content: Text
    add_special: StrictBool = False
    """Add the tokenizer's special tokens (BOS), as llama.cpp's `add_special`."""


class TokenizeChat(RequestBody):
    """`POST /tokenize` of a conversation, rendered with the chat template, the `tools`
    offered and the generation prompt, as a chat turn would prefill it."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolBody] | None = Field(default=None, max_length=MAX_TOOLS)


TokenizeRequest = Annotated[
    Annotated[TokenizeText, Tag("TokenizeText")] | Annotated[TokenizeChat, Tag("TokenizeChat")],
    Discriminator(
        lambda body: (
            "TokenizeChat" if isinstance(body, dict) and "messages" in body else "TokenizeText"
        )
    ),
]
"""`POST /tokenize` body: `messages` (with `tools`), else `content`."""
