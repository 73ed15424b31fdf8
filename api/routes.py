"""The API's route handlers, one named function each; `api.app.create_app` registers them with
each route's path and documented error statuses. A handler finds what the server serves (the
`ChatService`, the model id, the metrics) in the app's `ServerState`, through `Server`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Annotated

from fastapi import Depends, Header, Request, Response
from fastapi.concurrency import run_in_threadpool

from agent_kv.errors import ConfigError, GrammarError
from agent_kv.runtime.replies.tool_calls import ReplySpec
from agent_kv.serving.chat_service import ChatService
from agent_kv.serving.session_store import SessionBusyError
from api.chat_request import (
    check_names,
    header_text,
    image_parts,
    pin_rules,
    policy_override,
    refuse_unsupported,
    sampling_params,
)
from api.errors import APIError
from api.metrics import ServerMetrics
from api.request_log import note_turn
from api.response_bodies import completion_body, native_reply, set_session_header
from api.response_schemas import (
    ChatCompletion,
    DeletedSession,
    Health,
    ModelCard,
    ModelList,
    NativeChatResponse,
    SessionInfo,
    SessionList,
    TokenizeResponse,
)
from api.schemas import (
    SESSION_ID_CHARS,
    ChatCompletionRequest,
    NativeChatRequest,
    TokenizeChat,
    TokenizeRequest,
)
from api.streaming import stream_reply
from api.tool_fields import check_tool_results, reply_spec
from api.turns import admit, run_watched


@dataclass(frozen=True)
class ServerState:
    """What one app serves, kept in `app.state.server`.

    Attributes:
        service: runs the chat turns.
        model_name: the id `/v1/models` and replies give.
        metrics: the app's Prometheus registry.
        drop_image_parts: drop messages' image parts, unread, instead of a 400.
    """

    service: ChatService
    model_name: str
    metrics: ServerMetrics
    drop_image_parts: bool = False


def server_state(request: Request) -> ServerState:
    """The `ServerState` of the app serving `request`."""
    return request.app.state.server


Server = Annotated[ServerState, Depends(server_state)]
SessionHeader = Annotated[
    str | None, Header(min_length=1, max_length=SESSION_ID_CHARS, description="Session id")
]


async def health(server: Server) -> Health:
    """Liveness: the model id and the default policy (served without the API key)."""
    policy = server.service.engine.policy.name
    return Health(status="ok", model=server.model_name, policy=policy)


async def models(server: Server) -> ModelList:
    """The one model served."""
    return ModelList(data=[ModelCard(id=server.model_name, created=0, owned_by="agent_kv")])


async def prometheus(server: Server) -> Response:
    """Prometheus metrics in the text exposition format."""
    return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")


async def list_sessions(server: Server) -> SessionList:
    """Every session known, in memory or on disk, least recently used first."""
    summaries = await run_in_threadpool(server.service.sessions.describe)
    return SessionList(data=[SessionInfo.model_validate(asdict(s)) for s in summaries])


async def delete_session(session_id: str, server: Server) -> DeletedSession:
    """Forget a session, in memory and on disk."""
    try:
        deleted = await run_in_threadpool(server.service.sessions.drop, session_id)
    except SessionBusyError as err:
        raise APIError(409, str(err), "session_id", "session_busy") from None
    if not deleted:
        raise APIError(404, f"no session {session_id!r}", "session_id", "not_found")
    return DeletedSession(id=session_id, deleted=True)


async def tokenize(request: TokenizeRequest, server: Server) -> TokenizeResponse:
    """Token ids of plain text, or of a conversation as a chat turn would prefill it."""
    tokens = await run_in_threadpool(_token_ids, server.service, request)
    limit = server.service.engine.model.config.max_position_embeddings
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=limit)


async def chat_completions(
    request: ChatCompletionRequest,
    raw: Request,
    response: Response,
    server: Server,
    x_session_id: SessionHeader = None,
) -> ChatCompletion:
    """OpenAI's chat completion, plain or streamed, with the cache's figures in `kv`."""
    service, metrics, model_name = server.service, server.metrics, server.model_name
    engine = service.engine
    refuse_unsupported(request)
    params = sampling_params(request, engine.model.config.vocab_size, request.max_completion_tokens)
    check_tool_results(request.messages)
    check_names(request.messages, engine.tokenizer)
    images = image_parts(request.messages, server.drop_image_parts, metrics)
    messages = [m.as_dict() for m in request.messages]
    rules = None if request.pin is None else pin_rules(request)
    reply = await run_in_threadpool(reply_spec, request, engine, model_name)
    session_id = header_text(x_session_id) or request.user
    admission = admit(service)
    turn_args = {"session_id": session_id, "rules": rules, "reply": reply}
    if request.stream:
        return await stream_reply(
            service, metrics, raw, admission, messages, params, turn_args, request,
            model_name, images,
        )  # fmt: skip
    turn = await run_watched(raw, admission, metrics, service, messages, params, **turn_args)
    note_turn(raw, turn)
    set_session_header(response.headers, turn.kv.session_id)
    return completion_body(model_name, turn, images)


async def chat(request: NativeChatRequest, raw: Request, server: Server) -> NativeChatResponse:
    """One turn with agent_kv's controls: session, pin rules and a policy for the turn."""
    service, metrics = server.service, server.metrics
    engine = service.engine
    params = sampling_params(request, engine.model.config.vocab_size)
    check_tool_results(request.messages)
    check_names(request.messages, engine.tokenizer)
    images = image_parts(request.messages, server.drop_image_parts, metrics)
    messages = [m.as_dict() for m in request.messages]
    rules = None if request.pin is None else pin_rules(request)
    policy = None if request.policy is None else policy_override(request, service)
    reply = await run_in_threadpool(reply_spec, request, engine, server.model_name)
    admission = admit(service)
    turn = await run_watched(
        raw, admission, metrics, service, messages, params, session_id=request.session_id,
        rules=rules, policy=policy, reply=reply,
    )  # fmt: skip
    note_turn(raw, turn)
    return native_reply(turn, images)


def _token_ids(service: ChatService, request: TokenizeRequest) -> list[int]:
    """The request's token ids: its text's, or its conversation's as a chat turn would
    prefill it (the tools rendered as a chat completion renders them); a 400 for a name the
    template cannot render, tools offered twice, or a conversation the template refuses."""
    if isinstance(request, TokenizeChat):
        check_names(request.messages, service.engine.tokenizer)
        tools = request.model_dump(include={"tools"})["tools"]
        try:
            offered = ReplySpec.from_openai(tools=tools).tools
        except GrammarError as err:
            raise APIError(400, str(err), "tools", "invalid_value") from None
        try:
            return service.render([m.as_dict() for m in request.messages], offered).token_ids
        except ConfigError as err:
            raise APIError(400, str(err), "messages", "invalid_value") from None
    tokenizer = service.engine.tokenizer
    return tokenizer(request.content, add_special_tokens=request.add_special)["input_ids"]
