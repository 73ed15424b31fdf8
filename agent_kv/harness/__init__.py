"""The web-agent harness: the agent loop over a browser episode, policy x budget sweeps
with reference-action replay, and the HTML trace view. Imports `agent_kv.runtime`,
`agent_kv.kv` and the web environments (`envs`)."""
