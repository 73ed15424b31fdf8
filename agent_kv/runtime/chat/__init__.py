"""Chats over a sequence: rendering through the model's chat template, where each message lies
in the rendered chat, pin rules as token spans, a chat met with the history its cache holds,
`ChatSession` (the session object of the agent and the server) and the append-only
`Conversation`."""
