"""Shopping site in the spirit of VisualWebArena: categories, search, products with reviews,
a cart, checkout and order history behind a login."""

from envs.sites.shopping.app import create_app
from envs.sites.shopping.data import build_template_db

__all__ = ["build_template_db", "create_app"]
