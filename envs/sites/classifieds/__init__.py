"""Classifieds site in the spirit of VisualWebArena: categories, search, listings, comments."""

from envs.sites.classifieds.app import create_app
from envs.sites.classifieds.data import build_template_db

__all__ = ["build_template_db", "create_app"]
