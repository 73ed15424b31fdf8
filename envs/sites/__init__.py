"""Bundled local websites served by `envs.server` (one sub-package per site)."""
