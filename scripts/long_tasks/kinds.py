"""The kinds of fact the fitted carry tasks (541-600) carry, and how to tell whether a page
shows a fact of a kind.

A carry task answers with one fact read many pages earlier; its `distractors` field says
whether a page between the fact and the answer shows another fact of the same kind (the
default model loses a noted fact to later facts of its kind: tasks/README.md, "The
long-horizon suite"). "Shows a fact of the kind" is decided on the page's text as the agent
sees it, by `shown`:

- `name`: a person's name or username any site shows: a classifieds seller or commenter, a
  forum user (the signed-in `agent` included), a shop reviewer, the shop's account holder
  (`Signed in as Avery Agent`, on every signed-in shop page) or an order's recipient.
- `price`: a dollar amount (`$7.95`, `$8,900`).
- `count`: a count of things: `12 points`, `Comments (2)`, `Reviews (3)`, `(3 reviews)`,
  `9 comments`, `Karma: 417`, `quantity 2`, `Cart (3)`, a category's `Bikes (24)`,
  `26 posts`, `Showing 1-20 of 24 listings`, `Page 1 of 2`.
- `id`: an order number (`Order #1003`), the only identifier the sites show in their text
  (item ids appear only in URLs, and element ids `[123]` on every page of every task, so
  neither counts).
- `date`: a date as the sites write it (`Mar 28, 2024`).
- `location`: a city the sites name: a listing's location (`Pittsburgh, PA`) or an order's
  shipping city (`Erie 16501`).

Every page of every site that a task can write on shows a name and a count (the signed-in
account, a seller, forum users; `Cart (N)`, points, a listing's `Comments (N)`), so the
tasks that carry a name or a count all have distractors.
"""

from __future__ import annotations

import re
from typing import Literal

from envs.sites.classifieds.data import LOCATIONS, SELLERS, generate_comments
from envs.sites.common.accounts import TEST_ACCOUNT
from envs.sites.forum.data import USERNAMES
from envs.sites.shopping.data import ACCOUNT_PROFILE, OTHER_USERS, generate_orders
from scripts.long_tasks.classifieds import LISTINGS
from scripts.long_tasks.shopping import _ROWS, PRODUCTS

Kind = Literal["name", "price", "count", "id", "date", "location"]
KINDS: tuple[Kind, ...] = ("name", "price", "count", "id", "date", "location")
"""The kinds of carried fact (envs.tasks.Fact.kind)."""

_ORDERS = generate_orders(_ROWS, 0)
NAMES = sorted(
    {*SELLERS, "Guest", TEST_ACCOUNT["username"], ACCOUNT_PROFILE["name"], *USERNAMES}
    | {comment["author"] for comment in generate_comments(len(LISTINGS), 0)}
    | {review["author"] for row in PRODUCTS.values() for review in row["reviews"]}
    | {order["ship_name"] for order in _ORDERS}
    | {user[2] for user in OTHER_USERS}
)
"""Every person's name or username the sites show ("Guest": a classifieds comment without a
name)."""
CITIES = sorted(
    {location.split(",")[0] for location in LOCATIONS}
    | {order["ship_city"] for order in _ORDERS}
    | {ACCOUNT_PROFILE["city"]}
)
"""Every city the sites show."""


def _words(words: list[str]) -> re.Pattern[str]:
    """Any of `words` as a whole word (case-sensitive)."""
    alternatives = "|".join(re.escape(word) for word in sorted(words, key=len, reverse=True))
    return re.compile(rf"(?<![\w]){'(?:' + alternatives + ')'}(?![\w])")


_COUNTED = "points?|comments?|reviews?|posts?|listings?|products?"
PATTERNS: dict[Kind, re.Pattern[str]] = {
    "name": _words(NAMES),
    "price": re.compile(r"\$\d"),
    "count": re.compile(
        rf"-?\b\d+ (?:{_COUNTED})\b"
        r"|\(\d+(?: reviews?)?\)"
        r"|Karma: -?\d+"
        r"|\bquantity \d+"
        r"|\bPage \d+ of \d+"
    ),
    "id": re.compile(r"#\d+"),
    "date": re.compile(r"\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{1,2}, \d{4}\b"),
    "location": _words(CITIES),
}
"""How each kind of fact appears in a page's text (module docstring)."""


def shown(kind: Kind, text: str) -> list[str]:
    """The facts of `kind` that the page text `text` shows (each match, in order)."""
    return [match.group(0) for match in PATTERNS[kind].finditer(text)]
