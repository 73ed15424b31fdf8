"""The web environment: bundled local sites, browser env, observations, actions, evaluators."""
