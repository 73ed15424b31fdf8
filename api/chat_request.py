"""A chat request read as a turn takes it (`read_turn`), each error an `APIError` naming the
field: its sampling parameters, pin rules and policy override, the OpenAI fields this server
refuses, its messages' names (rendered by the chat template, else refused), its image parts
(refused, or dropped and counted), its tools and reply format (`api.tool_fields`), and the
session id of its header."""

from __future__ import annotations

import json
from dataclasses import dataclass

from agent_kv.errors import ConfigError
from agent_kv.kv.policies import Policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.chat.pin_rules import PinRules
from agent_kv.runtime.chat.rendering import template_takes_names
from agent_kv.runtime.engine.policy_setup import policy_from_spec
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_calls import ReplySpec
from agent_kv.serving.chat_service import ChatService
from api.errors import APIError
from api.metrics import ServerMetrics
from api.schemas import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    NativeChatRequest,
    SamplingFields,
)
from api.tool_fields import check_tool_results, reply_spec

DEFAULT_MAX_TOKENS = 256
"""The reply's token cap when a request sets none."""


@dataclass(frozen=True)
class TurnRequest:
    """A chat request read as its turn takes it (`ChatService.run`'s arguments).

    Attributes:
        messages: the conversation, `{"role", "content"}` dicts.
        params: the sampling parameters.
        rules: the turn's pin rules, or None for the service's.
        reply: the tools offered, the tool choice and the reply format.
        images: image parts dropped (with `drop_image_parts`).
        policy: the turn's policy (`/chat`'s override), or None for the engine's.
    """

    messages: list[dict]
    params: SamplingParams
    rules: PinRules | None
    reply: ReplySpec
    images: int
    policy: Policy | None = None


def read_turn(
    request: ChatCompletionRequest | NativeChatRequest,
    service: ChatService,
    model_name: str,
    drop_image_parts: bool,
    metrics: ServerMetrics,
    max_tokens: int | None = None,
) -> TurnRequest:
    """Read `request` as its turn takes it, field by field in this order: sampling
    parameters (`max_tokens` overrides the request's), tool results, names, image parts, pin
    rules, `/chat`'s policy override, tools and reply format (building the reply's grammar).
    Run it off the event loop: the grammar and the names' template check take time.

    Raises:
        APIError: the first field that cannot be taken (400, or 422 for pin rules and a
            policy that cannot be applied).
    """
    engine = service.engine
    params = sampling_params(request, engine.model.config.vocab_size, max_tokens)
    check_tool_results(request.messages)
    check_names(request.messages, engine.tokenizer)
    images = image_parts(request.messages, drop_image_parts, metrics)
    messages = [message.as_dict() for message in request.messages]
    rules = None if request.pin is None else pin_rules(request)
    policy = None
    if isinstance(request, NativeChatRequest) and request.policy is not None:
        policy = policy_override(request, service)
    reply = reply_spec(request, engine, model_name)
    return TurnRequest(messages, params, rules, reply, images, policy)


def refuse_unsupported(request: ChatCompletionRequest) -> None:
    """A 400 for `n > 1` and the OpenAI features this server does not implement (a field of
    `UNSUPPORTED_FIELDS` not null and not one of its accepted values, compared as JSON, so
    `0` is not `false`)."""
    if request.n != 1:
        raise APIError(400, "only n=1 is supported", "n", "unsupported")
    for field, accepted in UNSUPPORTED_FIELDS.items():
        value = getattr(request, field)
        if value is not None and json.dumps(value) not in map(json.dumps, accepted):
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
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
    )
    try:
        params.validate(vocab_size)
    except ConfigError as err:
        field = str(err).split(" ", 1)[0]
        param = field if field in SamplingFields.model_fields else None
        raise APIError(400, str(err), param, "invalid_value") from None
    return params


def check_names(messages: list[ChatMessage], tokenizer) -> None:
    """Each message's `name` can be rendered as given: a tool message's names the function of
    the call it answers (its `tool_call_id`, checked to answer an earlier call by
    `check_tool_results`), and another's is one the chat template renders for its role
    (`template_takes_names`), since a name the model never sees would be dropped silently.

    Raises:
        APIError: 400 naming `messages.N.name`: a tool message's name that is not its call's
            function (`invalid_value`), or a name the template does not render
            (`unsupported`).
    """
    called: dict[str, str] = {}
    for i, message in enumerate(messages):
        for call in getattr(message, "tool_calls", None) or []:
            called[call.id] = call.function.name
        if message.name is None:
            continue
        answers = getattr(message, "tool_call_id", None)
        if answers is not None:
            if message.name != called.get(answers):
                raise APIError(
                    400,
                    f"messages[{i}].name {message.name!r} is not the name of the function its "
                    f"tool_call_id {answers!r} called ({called.get(answers)!r})",
                    f"messages.{i}.name",
                    "invalid_value",
                )
        elif not template_takes_names(tokenizer, message.role):
            raise APIError(
                400,
                f"messages[{i}].name: this model's chat template does not render the name of "
                f"a message of role {message.role}, so the model could not read it; leave it "
                "out or put it in the content",
                f"messages.{i}.name",
                "unsupported",
            )


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
