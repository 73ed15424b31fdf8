"""A chat request read as a turn takes it, each error an `APIError` naming the field: its
sampling parameters, pin rules and policy override, the OpenAI fields this server refuses,
its image parts (refused, or dropped and counted), and the session id of its header."""

from __future__ import annotations

from agent_kv.errors import ConfigError
from agent_kv.kv.policies import Policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.pin_rules import PinRules
from agent_kv.runtime.policy_setup import policy_from_spec
from agent_kv.runtime.sampling import SamplingParams
from agent_kv.serving.chat_service import ChatService
from api.errors import APIError
from api.metrics import ServerMetrics
from api.schemas import ChatCompletionRequest, ChatMessage, NativeChatRequest, SamplingFields

DEFAULT_MAX_TOKENS = 256
"""The reply's token cap when a request sets none."""
UNSUPPORTED_FIELDS = (
    "functions", "function_call", "logprobs", "top_logprobs", "audio", "modalities",
    "prediction", "reasoning_effort", "verbosity", "web_search_options",
)  # fmt: skip
"""OpenAI request fields that change the reply and this server does not implement, refused
with a 400 unless empty or one of `NO_OP_VALUES` (`functions` and `function_call` are
OpenAI's deprecated forms of `tools` and `tool_choice`). OpenAI's fields that change nothing
the model writes (`store`, `metadata`, `service_tier`, `prompt_cache_key`,
`safety_identifier`) are accepted and have no effect."""
NO_OP_VALUES = {"function_call": ["none"], "modalities": [["text"]], "verbosity": ["medium"]}
"""Values of unsupported fields that ask for nothing beyond plain text, so are accepted."""


def refuse_unsupported(request: ChatCompletionRequest) -> None:
    """A 400 for `n > 1` and the OpenAI features this server does not implement."""
    if request.n != 1:
        raise APIError(400, "only n=1 is supported", "n", "unsupported")
    extra = request.model_extra or {}
    for field in UNSUPPORTED_FIELDS:
        value = extra.get(field)
        if value and value not in NO_OP_VALUES.get(field, []):
            hint = " (use tools and tool_choice)" if field.startswith("function") else ""
            raise APIError(
                400, f"{field} is not supported by this server{hint}", field, "unsupported"
            )


def sampling_params(
    request: SamplingFields, vocab_size: int, max_tokens: int | None = None
) -> SamplingParams:
    """The request's sampling parameters; a 400 for invalid ones (naming the field), a
    `logit_bias` token outside the model's `vocab_size` included."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = SamplingParams(
        max_new_tokens=max_tokens or request.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=stop,
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        logit_bias={int(token): bias for token, bias in (request.logit_bias or {}).items()},
    )
    try:
        params.validate(vocab_size)
    except ConfigError as err:
        field = str(err).split(" ", 1)[0]
        param = field if field in SamplingFields.model_fields else None
        raise APIError(400, str(err), param, "invalid_value") from None
    return params


def pin_rules(request: NativeChatRequest | ChatCompletionRequest) -> PinRules:
    """The request's pin rules; a 422 for rules that cannot be applied."""
    try:
        return PinRules.from_fields(**request.pin.model_dump())
    except ConfigError as err:
        raise APIError(422, str(err), "pin.patterns", "unprocessable") from None


def policy_override(request: NativeChatRequest, service: ChatService) -> Policy:
    """The request's policy override (`PolicySpec.checked`, built for the engine's model); a
    422 for one that cannot be built or cannot run on the server's store."""
    spec = request.policy
    engine = service.engine
    try:
        checked = PolicySpec.checked(
            spec.name,
            spec.budget,
            params=spec.params,
            int8=engine.store_options["int8"],
            recall=spec.recall,
        )
        return policy_from_spec(checked, engine.model)
    except ConfigError as err:
        raise APIError(422, str(err), "policy", "unprocessable") from None


def image_parts(messages: list[ChatMessage], drop: bool, metrics: ServerMetrics) -> int:
    """The image parts of `messages`, which the model cannot read: with `drop`, how many
    (counted in `metrics`; `ChatMessage.text` leaves them out); else a 400.

    Raises:
        APIError: 400 naming the first image part, when not `drop`.
    """
    found = [(i, j) for i, message in enumerate(messages) for j in message.image_parts()]
    if found and not drop:
        i, j = found[0]
        raise APIError(
            400,
            f"messages[{i}].content[{j}] is an image: the model reads text only, and image "
            "parts are not supported (a server started with --drop-image-parts drops them "
            "unread)",
            f"messages.{i}.content.{j}",
            "unsupported",
        )
    metrics.image_parts_dropped.inc(len(found))
    return len(found)


def header_text(value: str | None) -> str | None:
    """A header value as the client wrote it: HTTP hands header bytes over as Latin-1, so a
    UTF-8 session id is read back as UTF-8 (and so names the same session as in a body)."""
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value
