"""Serving chat turns to clients: sessions by id under a KV byte cap (`SessionStore`), pin
rules, the `ChatService` every front end goes through, and the LangChain chat model. The
HTTP API (`api/`) sits on top of it. Imports `agent_kv.runtime` and `agent_kv.kv`."""
