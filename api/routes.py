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
from api.chat_request import check_names, header_text, read_turn, refuse_unsupported
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
    refuse_unsupported(request)
    turn_request = await run_in_threadpool(
        read_turn, request, service, model_name, server.drop_image_parts, metrics,
        request.max_completion_tokens,
    )  # fmt: skip
    session_id = header_text(x_session_id) or request.user
    admission = admit(service)
    turn_args = {"session_id": session_id, "rules": turn_request.rules, "reply": turn_request.reply}
    messages, params, images = turn_request.messages, turn_request.params, turn_request.images
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
    turn_request = await run_in_threadpool(
        read_turn, request, service, server.model_name, server.drop_image_parts, metrics
    )
    admission = admit(service)
    turn = await run_watched(
        raw, admission, metrics, service, turn_request.messages, turn_request.params,
        session_id=request.session_id, rules=turn_request.rules, policy=turn_request.policy,
        reply=turn_request.reply,
    )  # fmt: skip
    note_turn(raw, turn)
    return native_reply(turn, turn_request.images)


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
