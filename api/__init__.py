"""The HTTP API: an OpenAI-compatible chat endpoint over the agent_kv engine (`api.app`)."""
