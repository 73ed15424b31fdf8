"""`ChatAgentKV`: agent_kv as a LangChain chat model, in-process or through a running server.

In-process (`ChatAgentKV(service=ChatService(engine))` or `ChatAgentKV.local()`), every call
is one `ChatService.run` turn. Against a server (`ChatAgentKV(base_url=...)` or
`$AGENT_KV_BASE_URL`), every call is one `POST /v1/chat/completions`, streamed as server-sent
events when streaming. Either way the turn runs in the session `session_id` names (None: the
anonymous session the conversation continues), so only what the session's cache lacks is
prefilled: the part read from the cache is `usage_metadata["input_token_details"]
["cache_read"]`, and the cache's figures are `response_metadata["kv"]` (`KVReport`).

Per call, `stop` and the keyword arguments `max_tokens`, `temperature`, `top_p`, `seed`,
`frequency_penalty`, `presence_penalty`, `logit_bias`, `session_id` and `pin` override the
fields (e.g. `model.bind(session_id="episode-2")`);
`model` is sent as the request's model (the server serves one model; in-process it is ignored).
A message with `additional_kwargs["pin"]` true has its tokens pinned (never evicted or
quantized); `pin` sets the turn's pin rules, as the API's `pin` does (e.g.
`{"tool_names": ["search"], "tool_calls": True}` keeps every result of the tool `search`
and every call the model makes, which a LangGraph `ToolNode`'s messages cannot flag).

`bind_tools` and `with_structured_output` set OpenAI's `tools`, `tool_choice`,
`parallel_tool_calls` and `response_format` on every call (`REPLY_KWARGS`): in-process they
become the turn's `ReplySpec`, against a server the request's fields. Calls come back as
`AIMessage.tool_calls` (and `tool_call_chunks` when streamed), decoded under the tools'
schemas (`agent_kv.runtime.tool_calls`).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict
from operator import itemgetter
from typing import Any

import httpx
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils import secret_from_env
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from agent_kv.errors import AgentKVError, ConfigError
from agent_kv.runtime.pin_rules import PinRules
from agent_kv.runtime.sampling import SamplingParams
from agent_kv.runtime.tool_calls import ReplySpec, ToolCall, ToolCallStream
from agent_kv.serving.chat_service import ChatService, ChatTurn

BASE_URL_ENV = "AGENT_KV_BASE_URL"
"""Read for `base_url` when neither `service` nor `base_url` is given."""
TOOL_CALL_BLOCKS = ("tool_call", "tool_use")
"""Content blocks of an `AIMessage` that repeat its `tool_calls` (LangChain's and Anthropic's)."""
API_KEY_ENV = "AGENT_KV_API_KEY"
"""Read for `api_key` when it is not given (the same variable `agent-kv serve` reads)."""
COMPLETIONS = "/v1/chat/completions"
ROLES = (
    (SystemMessage, "system"),
    (HumanMessage, "user"),
    (AIMessage, "assistant"),
    (ToolMessage, "tool"),
)
"""LangChain message classes (their chunks included) and the chat roles they become."""
IDENTIFYING = (
    "model_name",
    "base_url",
    "session_id",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "stop",
    "pin",
)
"""The fields that tell one configured model from another (caching, tracing)."""
REPLY_KWARGS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")
"""Call keyword arguments (set by `bind_tools`, `with_structured_output` or `bind`) that say
what the reply may be, as OpenAI's request fields."""


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


class ChatAgentKV(BaseChatModel):
    """A chat model whose KV cache agent_kv manages per session (see the module docstring).

    Args:
        service: run turns in-process on this `ChatService`.
        base_url: or send them to the server at this root URL (e.g. "http://127.0.0.1:8000");
            `$AGENT_KV_BASE_URL` when neither is given.
        session_id: the session (agent episode) turns run in; None lets the service match an
            anonymous session by prefix.
        model_name: (alias `model`) the model's name in traces and in `response_metadata`
            (a server reports its own there).
        max_tokens, temperature, top_p, seed, frequency_penalty, presence_penalty,
            logit_bias, stop: sampling (`SamplingParams`; the penalties and the bias as
            OpenAI defines them, `logit_bias` keyed by token id).
        api_key: the server's API key (`agent-kv serve --api-key`), sent as
            `Authorization: Bearer`; `$AGENT_KV_API_KEY` when not given (server mode).
        timeout: seconds an HTTP request may take (server mode).
        max_retries: retries of a failed connection (server mode).
        streaming: whether `invoke` streams, so token callbacks fire.
        pin: the pin rules of every turn, as the API's `pin` (`PinRules.from_fields`); None:
            the service's or the server's own.

    Raises:
        pydantic.ValidationError: neither or both of `service` and `base_url`, or pin rules
            that cannot apply (also on other invalid field values).
    """

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True)

    service: ChatService | None = Field(default=None, exclude=True)
    base_url: str | None = None
    session_id: str | None = None
    model_name: str = Field(default="agent-kv", alias="model")
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | None = None
    api_key: SecretStr | None = Field(
        default_factory=secret_from_env(API_KEY_ENV, default=None), exclude=True
    )
    timeout: float | None = 600.0
    max_retries: int = 2
    streaming: bool = False
    pin: dict[str, Any] | None = None

    @field_validator("pin")
    @classmethod
    def _valid_pin(cls, pin: dict | None) -> dict | None:
        if pin is not None:
            _pin_rules(pin)
        return pin

    @model_validator(mode="before")
    @classmethod
    def _one_backend(cls, values: dict) -> dict:
        if values.get("service") is None and values.get("base_url") is None:
            values = {**values, "base_url": os.environ.get(BASE_URL_ENV)}
        if (values.get("service") is None) == (values.get("base_url") is None):
            raise ValueError(
                "ChatAgentKV needs one backend: service= (in-process) or base_url= (a running "
                f"server; also read from ${BASE_URL_ENV}), not both"
            )
        return values

    @classmethod
    def local(
        cls,
        model_path: str | os.PathLike | None = None,
        policy: str = "conf-kv",
        budget: int | None = None,
        weights: str | None = None,
        **fields: Any,
    ) -> ChatAgentKV:
        """An in-process model over a freshly loaded model (torch's CPU threads set as
        `load_model` sets them: `$AGENT_KV_THREADS`, default 1).

        Args:
            model_path: a bundled model's name, a Hugging Face model directory or a `.gguf`
                file; None for the default bundled model (`load_model`).
            policy: the KV policy's name (`agent_kv.kv.policies.POLICIES`).
            budget: unpinned tokens per layer (`PolicySpec.checked`); None for the policy's
                default.
            weights: the weight format (`agent_kv.runtime.weight_formats`); None for the
                default.
            **fields: further fields (`session_id`, `max_tokens`, ...).

        Raises:
            ConfigError: an unknown policy, an invalid budget, weight format or
                `$AGENT_KV_THREADS` (before the model loads).
            ModelNotFoundError: the model cannot be loaded.
        """
        from agent_kv.kv.policy_spec import PolicySpec
        from agent_kv.runtime.engine import Engine, policy_from_spec
        from agent_kv.runtime.model_loading import load_model
        from agent_kv.runtime.weight_formats import DEFAULT_WEIGHTS

        spec = PolicySpec.checked(policy, budget)
        loaded = load_model(model_path, weights or DEFAULT_WEIGHTS)
        engine = Engine(loaded.model, loaded.tokenizer, policy_from_spec(spec, loaded.model))
        return cls(service=ChatService(engine), model_name=loaded.name, **fields)

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """True: server-mode models serialise (an in-process one holds a live model)."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        """Where `langchain_core.load` finds the class."""
        return ["agent_kv", "serving", "langchain_chat"]

    def to_json(self):
        """The serialised model; "not implemented" for an in-process one."""
        return self.to_json_not_implemented() if self.service is not None else super().to_json()

    @property
    def _llm_type(self) -> str:
        return "agent-kv"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in IDENTIFYING}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop or self.stop, **kwargs)
        params["ls_provider"] = "agent_kv"
        return params

    def bind_tools(
        self,
        tools: Sequence[dict | type | Callable | Any],
        *,
        tool_choice: str | bool | dict | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """The model with `tools` offered on every call (OpenAI's `tools`), each a pydantic
        model, a function, a LangChain tool or an OpenAI tool dict
        (`convert_to_openai_tool`).

        Args:
            tool_choice: "auto" (text or calls), "none", "required" or "any" (calls only),
                True (the one tool), or a tool's name (calls of it); None: "auto".
            parallel_tool_calls: False allows one call per reply.
            strict: accepted; calls are always decoded under their schemas.

        Raises:
            ValueError: a `tool_choice` naming no offered tool, or True with several tools.
        """
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        fields: dict[str, Any] = {"tools": formatted}
        choice = _tool_choice(tool_choice, [tool["function"]["name"] for tool in formatted])
        if choice is not None:
            fields["tool_choice"] = choice
        if parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**fields, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type,
        *,
        method: str = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """The model answering with `schema` (a pydantic model, a JSON Schema dict or an
        OpenAI tool dict): parsed into the model, or a dict.

        Args:
            method: "function_calling" (the reply is a call of a tool whose parameters are
                the schema, `tool_choice` naming it), "json_schema" (`response_format`
                `json_schema`) or "json_mode" (`response_format` `json_object`; the schema
                then only parses).
            include_raw: return `{"raw": AIMessage, "parsed": ..., "parsing_error": ...}`.
            strict: accepted; the reply is always decoded under the schema.

        Callbacks see the schema and method as `ls_structured_output_format`, as with
        LangChain's own models.

        Raises:
            ValueError: an unknown method.
        """
        pydantic_schema = isinstance(schema, type) and is_basemodel_subclass(schema)
        traced = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            model = self.bind_tools([schema], tool_choice=name, parallel_tool_calls=False, **traced)
            if pydantic_schema:
                parser = PydanticToolsParser(tools=[schema], first_tool_only=True)
            else:
                parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                json_schema = convert_to_json_schema(schema)
                name = _tool_name(json_schema.get("title") or "response")
                body = {"name": name, "schema": json_schema}
                format_ = {"type": "json_schema", "json_schema": body}
            else:
                format_ = {"type": "json_object"}
            model = self.bind(response_format=format_, **traced)
            if pydantic_schema:
                parser = PydanticOutputParser(pydantic_object=schema)
            else:
                parser = JsonOutputParser()
        else:
            raise ValueError(
                f"method must be function_calling, json_schema or json_mode, got {method!r}"
            )
        if not include_raw:
            return model | parser
        parsed = RunnablePassthrough.assign(
            parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
        )
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=model) | parsed.with_fallbacks(
            [unparsed], exception_key="parsing_error"
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """One turn; the keyword arguments override fields (module docstring).

        Raises:
            ValueError: a message this model cannot send (another role, non-text content).
            ConfigError, ContextOverflowError, QueueFullError, QueueTimeoutError: in-process,
                as `ChatService.run` raises them.
            ServerError: the server answered with an error.
            httpx.HTTPError: the server could not be reached or timed out.
        """
        params = self._params(stop, kwargs)
        if self.service is not None:
            message = _turn_message(self._run(messages, params, kwargs), self.model_name)
        else:
            with self._client() as client:
                response = client.post(COMPLETIONS, **self._request(messages, params, kwargs))
            message = _completion_message(_checked(response).json())
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        """`_generate` without blocking the event loop (in-process, the turn runs in a worker
        thread). Raises as `_generate`."""
        params = self._params(stop, kwargs)
        if self.service is not None:
            turn = await asyncio.to_thread(self._run, messages, params, kwargs)
            message = _turn_message(turn, self.model_name)
        else:
            async with self._async_client() as client:
                request = self._request(messages, params, kwargs)
                response = await client.post(COMPLETIONS, **request)
            message = _completion_message(_checked(response).json())
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        """One turn as text chunks as the reply grows, with the finish reason and the usage in
        the last chunks. Raises as `_generate`."""
        params = self._params(stop, kwargs)
        stream = self._local_stream if self.service is not None else self._server_stream
        for chunk in stream(messages, params, kwargs):
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """`_stream` without blocking the event loop. Raises as `_generate`."""
        params = self._params(stop, kwargs)
        stream = self._alocal_stream if self.service is not None else self._aserver_stream
        async for chunk in stream(messages, params, kwargs):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _params(self, stop: list[str] | None, kwargs: dict) -> SamplingParams:
        """The sampling parameters of one call: the fields, overridden by the call's."""
        return SamplingParams(
            max_new_tokens=kwargs.get("max_tokens", self.max_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p),
            seed=kwargs.get("seed", self.seed),
            frequency_penalty=kwargs.get("frequency_penalty", self.frequency_penalty),
            presence_penalty=kwargs.get("presence_penalty", self.presence_penalty),
            logit_bias=dict(kwargs.get("logit_bias", self.logit_bias) or {}),
            stop=list(stop if stop is not None else self.stop or []),
        )

    def _run(
        self,
        messages: list[BaseMessage],
        params: SamplingParams,
        kwargs: dict,
        on_text: Callable[[str], None] | None = None,
        reply: ReplySpec | None = None,
    ) -> ChatTurn:
        """One in-process turn (`reply`: the call's `_reply_spec`, built here when None)."""
        session_id = kwargs.get("session_id", self.session_id)
        pin = kwargs.get("pin", self.pin)
        return self.service.run(
            _dicts(messages),
            params,
            session_id=session_id,
            rules=None if pin is None else _pin_rules(pin),
            on_text=on_text,
            reply=reply or _reply_spec(kwargs),
        )

    def _run_into(self, messages, params, kwargs, put: Callable[[tuple], None]) -> None:
        """One in-process turn reported to `put` as ("text", piece) and ("call", index,
        `ToolCall`) events (`ToolCallStream`), then ("done", turn) or ("error", exception)."""
        try:
            spec = _reply_spec(kwargs)
            splitter = ToolCallStream(spec)

            def on_text(text: str) -> None:
                for event in splitter.feed(text):
                    put(event)

            turn = self._run(messages, params, kwargs, on_text, spec)
            for event in splitter.finish():
                put(event)
            put(("done", turn))
        except BaseException as err:  # re-raised where the events are read
            put(("error", err))

    def _local_stream(self, messages, params, kwargs) -> Iterator[ChatGenerationChunk]:
        events: queue.Queue = queue.Queue()
        threading.Thread(target=self._run_into, args=(messages, params, kwargs, events.put)).start()
        while True:
            chunk = _event_chunk(events.get(), self.model_name)
            yield chunk
            if chunk.message.chunk_position == "last":
                return

    async def _alocal_stream(self, messages, params, kwargs) -> AsyncIterator[ChatGenerationChunk]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(event: tuple) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        worker = loop.run_in_executor(None, self._run_into, messages, params, kwargs, put)
        while True:
            chunk = _event_chunk(await events.get(), self.model_name)
            yield chunk
            if chunk.message.chunk_position == "last":
                break
        await worker

    def _request(self, messages, params: SamplingParams, kwargs: dict, stream=False) -> dict:
        """The keyword arguments of the HTTP request for one call: its JSON body and headers."""
        body = {
            "model": kwargs.get("model", self.model_name),
            "messages": _wire(_dicts(messages)),
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
        if (pin := kwargs.get("pin", self.pin)) is not None:
            _pin_rules(pin)  # a call's own rules fail here, as the field's do
            body["pin"] = pin
        if stream:
            body["stream_options"] = {"include_usage": True}
        session_id = kwargs.get("session_id", self.session_id)
        return {"json": body, "headers": {} if session_id is None else {"X-Session-Id": session_id}}

    def _client_options(self) -> dict:
        """What both HTTP clients share: the server, the timeout, and the API key as a
        bearer token when there is one."""
        headers = {}
        if self.api_key is not None:
            headers["Authorization"] = f"Bearer {self.api_key.get_secret_value()}"
        return {"base_url": self.base_url, "timeout": self.timeout, "headers": headers}

    def _client(self) -> httpx.Client:
        transport = httpx.HTTPTransport(retries=self.max_retries)
        return httpx.Client(transport=transport, **self._client_options())

    def _async_client(self) -> httpx.AsyncClient:
        transport = httpx.AsyncHTTPTransport(retries=self.max_retries)
        return httpx.AsyncClient(transport=transport, **self._client_options())

    def _server_stream(self, messages, params, kwargs) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, params, kwargs, stream=True)
        with self._client() as client, client.stream("POST", COMPLETIONS, **request) as response:
            if response.is_error:
                response.read()
            for line in _checked(response).iter_lines():
                if (chunk := _sse_chunk(line)) is not None:
                    yield chunk

    async def _aserver_stream(self, messages, params, kwargs) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, params, kwargs, stream=True)
        async with (
            self._async_client() as client,
            client.stream("POST", COMPLETIONS, **request) as response,
        ):
            if response.is_error:
                await response.aread()
            async for line in _checked(response).aiter_lines():
                if (chunk := _sse_chunk(line)) is not None:
                    yield chunk


def _pin_rules(pin: Any) -> PinRules:
    """`pin` (the field, or a call's) as checked rules.

    Raises:
        ConfigError: `pin` is not a dict, or `PinRules.from_fields` refuses it.
    """
    if not isinstance(pin, dict):
        raise ConfigError(f"pin must be a dict of pin rules, got {type(pin).__name__}")
    return PinRules.from_fields(**pin)


def _reply_spec(kwargs: dict) -> ReplySpec:
    """The call's `ReplySpec` from its `REPLY_KWARGS`.

    Raises:
        GrammarError: fields a spec cannot take (`ReplySpec.from_openai`).
    """
    return ReplySpec.from_openai(**{key: kwargs.get(key) for key in REPLY_KWARGS})


def _dicts(messages: list[BaseMessage]) -> list[dict]:
    """`{"role", "content", "pin", "tool_calls", "tool_call_id"}` dicts of LangChain messages
    (`agent_kv.runtime.chat_rendering`): an `AIMessage`'s `tool_calls` as `ToolCall`s (their
    arguments as generated when `additional_kwargs["tool_calls"]` holds them, else as JSON);
    a `ToolMessage`'s `tool_call_id` when it answers an earlier call (otherwise the message
    is a plain observation of role tool). Content is text blocks; an `AIMessage` may also
    carry blocks that repeat its `tool_calls` (`TOOL_CALL_BLOCKS`).

    Raises:
        ValueError: a role other than system, user, assistant and tool, or other content.
    """
    dicts, called = [], set()
    for message in messages:
        if isinstance(message, ChatMessage):
            role = message.role
        else:
            role = next((role for cls, role in ROLES if isinstance(message, cls)), None)
        if role not in {"system", "user", "assistant", "tool"}:
            raise ValueError(
                f"cannot send a {type(message).__name__} with role {role!r}: the roles are "
                "system, user, assistant and tool"
            )
        if any(not _is_text(block, message) for block in _blocks(message)):
            raise ValueError(f"a {role} message has non-text content: only text is supported")
        pin = bool(message.additional_kwargs.get("pin", False))
        entry = {"role": role, "content": message.text, "pin": pin}
        calls = _calls(message) if isinstance(message, AIMessage) else []
        if calls:
            entry["tool_calls"] = calls
            called.update(call.id for call in calls)
        if isinstance(message, ToolMessage) and message.tool_call_id in called:
            entry["tool_call_id"] = message.tool_call_id
        dicts.append(entry)
    return dicts


def _blocks(message: BaseMessage) -> list[str | dict]:
    """The message's content blocks (none for string content)."""
    return [] if isinstance(message.content, str) else message.content


def _is_text(block: str | dict, message: BaseMessage) -> bool:
    """Whether a content block is text, or (on an `AIMessage`) a tool-call block, such as
    Anthropic's `tool_use`, that repeats one of the message's `tool_calls`."""
    if isinstance(block, str) or block.get("type") == "text":
        return True
    calls = message.tool_calls if isinstance(message, AIMessage) else []
    return block.get("type") in TOOL_CALL_BLOCKS and block.get("id") in {c["id"] for c in calls}


def _calls(message: AIMessage) -> list[ToolCall]:
    """The message's tool calls, arguments as the model generated them where known."""
    raw = {
        call.get("id"): (call.get("function") or {}).get("arguments")
        for call in message.additional_kwargs.get("tool_calls") or []
    }
    return [
        ToolCall(
            call["id"] or ToolCall.new_id(),
            call["name"],
            raw.get(call["id"]) or json.dumps(call["args"], ensure_ascii=False),
        )
        for call in message.tool_calls
    ]


def _wire(dicts: list[dict]) -> list[dict]:
    """`_dicts` as `/v1/chat/completions` messages (calls in OpenAI's shape)."""
    out = []
    for entry in dicts:
        wired = {key: value for key, value in entry.items() if key != "tool_calls"}
        if entry.get("tool_calls"):
            wired["tool_calls"] = [_openai_call(call) for call in entry["tool_calls"]]
        out.append(wired)
    return out


def _openai_call(call: ToolCall) -> dict:
    """A call in OpenAI's shape (`tool_calls` item)."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


def _tool_choice(choice: str | bool | dict | None, names: list[str]) -> str | dict | None:
    """`bind_tools`' `tool_choice` as OpenAI's.

    Raises:
        ValueError: a name not offered, or True with other than one tool.
    """
    if choice is None or choice in ("auto", "none", "required") or isinstance(choice, dict):
        return choice
    if choice == "any":
        return "required"
    if choice is True:
        if len(names) != 1:
            raise ValueError(f"tool_choice=True needs exactly one tool, got {len(names)}")
        choice = names[0]
    if choice not in names:
        raise ValueError(f"tool_choice {choice!r} is not one of the tools: {', '.join(names)}")
    return {"type": "function", "function": {"name": choice}}


def _tool_name(title: str) -> str:
    """`title` as a schema name OpenAI takes (letters, digits, `_`, `-`; at most 64)."""
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in title)[:64] or "response"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageMetadata:
    return UsageMetadata(
        input_tokens=prompt_tokens,
        output_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        input_token_details={"cache_read": cached_tokens},
    )


def _turn_fields(turn: ChatTurn, model_name: str) -> dict:
    """The usage and response metadata of an in-process turn."""
    usage = _usage(turn.prompt_tokens, len(turn.reply.token_ids), turn.sync.reused_tokens)
    metadata = {"finish_reason": turn.finish_reason, "model_name": model_name}
    return {"usage_metadata": usage, "response_metadata": {**metadata, "kv": asdict(turn.kv)}}


def _turn_message(turn: ChatTurn, model_name: str) -> AIMessage:
    return AIMessage(
        content=turn.content, **_call_fields(turn.tool_calls), **_turn_fields(turn, model_name)
    )


def _call_fields(calls: list[ToolCall]) -> dict:
    """`tool_calls` (arguments parsed) and the raw OpenAI-shaped calls in
    `additional_kwargs`, which keep the arguments as generated."""
    if not calls:
        return {}
    parsed = [tool_call(name=c.name, args=json.loads(c.arguments), id=c.id) for c in calls]
    raw = {"tool_calls": [_openai_call(call) for call in calls]}
    return {"tool_calls": parsed, "additional_kwargs": raw}


def _call_chunk(index: int, call: ToolCall) -> ChatGenerationChunk:
    """A streamed call: one `tool_call_chunks` entry with the whole arguments."""
    piece = tool_call_chunk(name=call.name, args=call.arguments, id=call.id, index=index)
    return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[piece]))


def _event_chunk(event: tuple, model_name: str) -> ChatGenerationChunk:
    """The chunk of an in-process streaming event (`_run_into`); raises an "error" one."""
    kind, *rest = event
    if kind == "error":
        raise rest[0]
    if kind == "text":
        return ChatGenerationChunk(message=AIMessageChunk(content=rest[0]))
    if kind == "call":
        return _call_chunk(*rest)
    fields = _turn_fields(rest[0], model_name)
    return ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last", **fields))


def _checked(response: httpx.Response) -> httpx.Response:
    """`response`, unless it is an error (its body read): then raise `ServerError`."""
    if response.is_error:
        try:
            error = dict(response.json()["error"])
        except (ValueError, KeyError, TypeError):
            error = {"message": response.text}
        message = error.get("message") or response.reason_phrase
        raise ServerError(response.status_code, message, error.get("code"), error.get("param"))
    return response


def _completion_message(body: dict) -> AIMessage:
    """The reply of a `/v1/chat/completions` response body."""
    choice, usage = body["choices"][0], body["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    calls = [
        ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in choice["message"].get("tool_calls") or []
    ]
    return AIMessage(
        content=choice["message"]["content"] or "",
        **_call_fields(calls),
        usage_metadata=_usage(usage["prompt_tokens"], usage["completion_tokens"], cached),
        response_metadata={
            "finish_reason": choice["finish_reason"],
            "model_name": body["model"],
            "kv": body["kv"],
        },
    )


def _sse_chunk(line: str) -> ChatGenerationChunk | None:
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
        metadata = _usage(usage["prompt_tokens"], usage["completion_tokens"], cached)
        message = AIMessageChunk(content="", usage_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message)
    choice = event["choices"][0]
    if choice["delta"].get("tool_calls"):
        call = choice["delta"]["tool_calls"][0]
        function = call["function"]
        return _call_chunk(
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
