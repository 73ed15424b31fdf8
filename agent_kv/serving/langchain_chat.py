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
`parallel_tool_calls` and `response_format` on every call (`langchain_tools.REPLY_KWARGS`):
in-process they become the turn's `ReplySpec`, against a server the request's fields. Calls
come back as `AIMessage.tool_calls` (and `tool_call_chunks` when streamed), decoded under the
tools' schemas (`agent_kv.runtime.replies.tool_calls`).

The model's parts: `langchain_messages` converts messages both ways, `langchain_local` runs
an in-process turn, `langchain_server` sends one to a server (its errors are
`langchain_server.ServerError`), and `langchain_tools` binds tools and structured output.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from functools import partial
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.utils import secret_from_env
from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from agent_kv.errors import ConfigError
from agent_kv.runtime.chat.pin_rules import PinRules
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_calls import ReplySpec
from agent_kv.serving.chat_service import ChatService, ChatTurn
from agent_kv.serving.langchain_local import alocal_stream, local_stream, turn_message
from agent_kv.serving.langchain_messages import chat_dicts
from agent_kv.serving.langchain_server import ServerClient, completion_request
from agent_kv.serving.langchain_tools import reply_spec, structured_output, tool_fields

BASE_URL_ENV = "AGENT_KV_BASE_URL"
"""Read for `base_url` when neither `service` nor `base_url` is given."""
API_KEY_ENV = "AGENT_KV_API_KEY"
"""Read for `api_key` when it is not given (the same variable `agent-kv serve` reads)."""
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
            weights: the weight format (`agent_kv.runtime.models.weight_formats`); None for the
                default.
            **fields: further fields (`session_id`, `max_tokens`, ...).

        Raises:
            ConfigError: an unknown policy, an invalid budget, weight format or
                `$AGENT_KV_THREADS` (before the model loads).
            ModelNotFoundError: the model cannot be loaded.
        """
        from agent_kv.kv.policy_spec import PolicySpec
        from agent_kv.runtime.engine.engine import Engine
        from agent_kv.runtime.engine.policy_setup import policy_from_spec
        from agent_kv.runtime.models.model_loading import load_model
        from agent_kv.runtime.models.weight_formats import DEFAULT_WEIGHTS

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
        return self.bind(**tool_fields(tools, tool_choice, parallel_tool_calls), **kwargs)

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
        return structured_output(self, schema, method, include_raw)

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
            ServerError: the server answered with an error (`langchain_server`).
            httpx.HTTPError: the server could not be reached or timed out.
        """
        params = self._params(stop, kwargs)
        if self.service is not None:
            message = turn_message(self._run(messages, params, kwargs), self.model_name)
        else:
            message = self._server().complete(self._request(messages, params, kwargs))
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
            message = turn_message(turn, self.model_name)
        else:
            message = await self._server().acomplete(self._request(messages, params, kwargs))
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
        if self.service is not None:
            run = partial(self._run, messages, params, kwargs)
            stream = local_stream(run, kwargs, self.model_name, self.service.engine)
        else:
            stream = self._server().stream(self._request(messages, params, kwargs, stream=True))
        for chunk in stream:
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
        if self.service is not None:
            run = partial(self._run, messages, params, kwargs)
            stream = alocal_stream(run, kwargs, self.model_name, self.service.engine)
        else:
            stream = self._server().astream(self._request(messages, params, kwargs, stream=True))
        async for chunk in stream:
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
        """One in-process turn (`reply`: the call's `reply_spec`, built here when None)."""
        session_id = kwargs.get("session_id", self.session_id)
        pin = kwargs.get("pin", self.pin)
        return self.service.run(
            chat_dicts(messages),
            params,
            session_id=session_id,
            rules=None if pin is None else _pin_rules(pin),
            on_text=on_text,
            reply=reply or reply_spec(kwargs),
        )

    def _request(self, messages, params: SamplingParams, kwargs: dict, stream=False) -> dict:
        """The keyword arguments of the HTTP request for one call (`completion_request`),
        the call's keyword arguments overriding the fields."""
        dicts = chat_dicts(messages)
        if (pin := kwargs.get("pin", self.pin)) is not None:
            _pin_rules(pin)  # a call's own rules fail here, as the field's do
        return completion_request(
            dicts,
            params,
            kwargs,
            model=kwargs.get("model", self.model_name),
            pin=pin,
            session_id=kwargs.get("session_id", self.session_id),
            stream=stream,
        )

    def _server(self) -> ServerClient:
        """The HTTP side of server mode, as the fields set it now."""
        api_key = None if self.api_key is None else self.api_key.get_secret_value()
        return ServerClient(self.base_url, self.timeout, self.max_retries, api_key)


def _pin_rules(pin: Any) -> PinRules:
    """`pin` (the field, or a call's) as checked rules.

    Raises:
        ConfigError: `pin` is not a dict, or `PinRules.from_fields` refuses it.
    """
    if not isinstance(pin, dict):
        raise ConfigError(f"pin must be a dict of pin rules, got {type(pin).__name__}")
    return PinRules.from_fields(**pin)
