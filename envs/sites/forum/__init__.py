"""Forum site in the spirit of WebArena's Postmill forum: forums, posts, comments, votes, users."""

from envs.sites.forum.app import create_app
from envs.sites.forum.data import build_template_db

__all__ = ["build_template_db", "create_app"]
