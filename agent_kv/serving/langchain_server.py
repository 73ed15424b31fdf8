"""A `ChatAgentKV` turn sent to a running server: one `POST /v1/chat/completions`
(`completion_request`), answered whole (`ServerClient.complete`) or streamed as server-sent
events (`ServerClient.stream`), read back as LangChain's reply; an error the server answers
with is a `ServerError`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.outputs import ChatGenerationChunk

from agent_kv.errors import AgentKVError
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_calls import ToolCall
from agent_kv.serving.langchain_messages import (
    call_chunk,
    call_fields,
    usage_metadata,
    wire_messages,
)
from agent_kv.serving.langchain_tools import REPLY_KWARGS

COMPLETIONS = "/v1/chat/completions"


class ServerError(AgentKVError):
    """The server answered with an error: an OpenAI-shaped error body, or an error event in a
    stream that had begun.

    Attributes:
        status_code: the HTTP status (200 for an error event mid-stream).
        message: the server's message.
        code: the server's error code (e.g. "invalid_value"), if any.
        param: the request parameter at fault, if any.
    """

    def __init__(
        self, status_code: int, message: str, code: str | None = None, param: str | None = None
    ):
        super().__init__(f"agent_kv server error {status_code}: {message}")
        self.status_code, self.message, self.code, self.param = status_code, message, code, param


def completion_request(
    dicts: list[dict],
    params: SamplingParams,
    kwargs: dict,
    *,
    model: str,
    pin: dict[str, Any] | None,
    session_id: str | None,
    stream: bool = False,
) -> dict:
    """The keyword arguments of the HTTP request for one call: its JSON body and headers.

    Args:
        dicts: the messages (`chat_dicts`), sent in OpenAI's shape (`wire_messages`).
        params: the call's sampling parameters (`max_tokens` is `max_new_tokens`).
        kwargs: the call's keyword arguments; those of `REPLY_KWARGS` that are set are sent.
        model: the request's model.
        pin: the turn's pin rules (already checked), or None for the server's own.
        session_id: sent as `X-Session-Id`; None sends no header.
        stream: ask for server-sent events, the usage in the last one.
    """
    body = {
        "model": model,
        "messages": wire_messages(dicts),
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
        "logit_bias": {str(token): bias for token, bias in params.logit_bias.items()},
        "stop": params.stop,
        "stream": stream,
    }
    body |= {key: kwargs[key] for key in REPLY_KWARGS if kwargs.get(key) is not None}
    if pin is not None:
        body["pin"] = pin
    if stream:
        body["stream_options"] = {"include_usage": True}
    return {"json": body, "headers": {} if session_id is None else {"X-Session-Id": session_id}}


@dataclass(frozen=True)
class ServerClient:
    """Sends requests (`completion_request`) to the server at `base_url`, one HTTP client per
    call.

    Attributes:
        base_url: the server's root URL (e.g. "http://127.0.0.1:8000").
        timeout: seconds a request may take (None: no limit).
        max_retries: retries of a failed connection.
        api_key: sent as `Authorization: Bearer`, or None for no key.
    """

    base_url: str
    timeout: float | None
    max_retries: int
    api_key: str | None = field(repr=False)

    def complete(self, request: dict) -> AIMessage:
        """The reply to one request, whole.

        Raises:
            ServerError: the server answered with an error.
            httpx.HTTPError: the server could not be reached or timed out.
        """
        with self._client() as client:
            response = client.post(COMPLETIONS, **request)
        return completion_message(checked_response(response).json())

    async def acomplete(self, request: dict) -> AIMessage:
        """`complete` without blocking the event loop. Raises as `complete`."""
        async with self._async_client() as client:
            response = await client.post(COMPLETIONS, **request)
        return completion_message(checked_response(response).json())

    def stream(self, request: dict) -> Iterator[ChatGenerationChunk]:
        """The chunks of one streamed request (`sse_chunk`). Raises as `complete`, and
        `ServerError` for an error event mid-stream."""
        with self._client() as client, client.stream("POST", COMPLETIONS, **request) as response:
            if response.is_error:
                response.read()
            for line in checked_response(response).iter_lines():
                if (chunk := sse_chunk(line)) is not None:
                    yield chunk

    async def astream(self, request: dict) -> AsyncIterator[ChatGenerationChunk]:
        """`stream` without blocking the event loop. Raises as `stream`."""
        async with (
            self._async_client() as client,
            client.stream("POST", COMPLETIONS, **request) as response,
        ):
            if response.is_error:
                await response.aread()
            async for line in checked_response(response).aiter_lines():
                if (chunk := sse_chunk(line)) is not None:
                    yield chunk

    def _options(self) -> dict:
        """What both HTTP clients share: the server, the timeout, and the API key as a
        bearer token when there is one."""
        headers = {}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return {"base_url": self.base_url, "timeout": self.timeout, "headers": headers}

    def _client(self) -> httpx.Client:
        transport = httpx.HTTPTransport(retries=self.max_retries)
        return httpx.Client(transport=transport, **self._options())

    def _async_client(self) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(retries=self.max_retries)
        return httpx.AsyncClient(transport=transport, **self._options())


def checked_response(response: httpx.Response) -> httpx.Response:
    """`response`, unless it is an error (its body read): then raise `ServerError`."""
    if response.is_error:
        try:
            error = dict(response.json()["error"])
        except (ValueError, KeyError, TypeError):
            error = {"message": response.text}
        message = error.get("message") or response.reason_phrase
        raise ServerError(response.status_code, message, error.get("code"), error.get("param"))
    return response


def completion_message(body: dict) -> AIMessage:
    """The reply of a `/v1/chat/completions` response body."""
    choice, usage = body["choices"][0], body["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    calls = [
        ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in choice["message"].get("tool_calls") or []
    ]
    return AIMessage(
        content=choice["message"]["content"] or "",
        **call_fields(calls),
        usage_metadata=usage_metadata(usage["prompt_tokens"], usage["completion_tokens"], cached),
        response_metadata={
            "finish_reason": choice["finish_reason"],
            "model_name": body["model"],
            "kv": body["kv"],
        },
    )


def sse_chunk(line: str) -> ChatGenerationChunk | None:
    """The chunk of one line of a streamed response; None for a line without one.

    Raises:
        ServerError: an error event.
    """
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    event = json.loads(line.removeprefix("data: "))
    if "error" in event:
        error = event["error"]
        raise ServerError(200, error["message"], error.get("code"), error.get("param"))
    if event.get("usage"):
        usage = event["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        metadata = usage_metadata(usage["prompt_tokens"], usage["completion_tokens"], cached)
        message = AIMessageChunk(content="", usage_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message)
    choice = event["choices"][0]
    if choice["delta"].get("tool_calls"):
        call = choice["delta"]["tool_calls"][0]
        function = call["function"]
        return call_chunk(
            call["index"], ToolCall(call["id"], function["name"], function["arguments"])
        )
    content = choice["delta"].get("content") or ""
    if choice["finish_reason"]:
        metadata = {"finish_reason": choice["finish_reason"], "model_name": event["model"]}
        metadata["kv"] = event["kv"]
        return ChatGenerationChunk(
            message=AIMessageChunk(content=content, response_metadata=metadata)
        )
    return ChatGenerationChunk(message=AIMessageChunk(content=content)) if content else None
