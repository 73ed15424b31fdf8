"""Errors a user can act on. Their messages are one line that names the fix."""


class AgentKVError(Exception):
    """Base class: the CLI prints the message alone (no traceback) and exits non-zero."""


class ModelNotFoundError(AgentKVError):
    """The model path or the default model's package is missing."""


class ConfigError(AgentKVError, ValueError):
    """A policy or engine setting is invalid; raised before any model call."""


class ContextOverflowError(AgentKVError):
    """A forward call would place a token past the model's trained context."""


class TurnCancelled(AgentKVError):
    """A turn was stopped before it finished because its caller went away (a client
    disconnected); the session keeps every token fed so far."""


class QueueTimeoutError(AgentKVError):
    """A turn waited longer than its deadline for the model (a place in the running batch)
    or for room under the KV cap."""


class KVCapacityError(AgentKVError):
    """A turn could hold more KV bytes than the session store's cap allows, even with every
    idle session out of memory."""


class GrammarError(ConfigError):
    """A constrained-decoding grammar (Lark, JSON schema or regex) cannot be built from what
    the request gave (a token fed outside a grammar is a `GrammarStateError`)."""


class ToolFormatError(ConfigError):
    """A model's chat template writes tool calls in a layout agent_kv does not read, so no
    tool can be offered to it."""


class GrammarStateError(AgentKVError):
    """A token outside the reply's grammar was fed in the middle of decoding: the server's
    fault (a mask and its matcher disagree), never the request's."""
