"""Bundled web-task suites as VisualWebArena-format JSON files, one folder per suite."""
