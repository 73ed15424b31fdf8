"""Helpers of the sites' seeded data: the colour table, unique seeded draws and writing a
fresh template database."""

import random
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

COLOURS: dict[str, tuple[int, int, int]] = {
    "Red": (200, 40, 40),
    "Blue": (40, 80, 200),
    "Green": (40, 150, 70),
    "Black": (30, 30, 30),
    "White": (235, 235, 235),
    "Yellow": (230, 200, 40),
    "Orange": (235, 130, 30),
    "Purple": (120, 50, 160),
    "Silver": (170, 175, 180),
    "Grey": (110, 110, 115),
    "Brown": (120, 80, 45),
}
"""Colour words used in titles and images, with their RGB values (a site may use a subset;
the order is part of the seeded draws)."""


def colour_rgb(colours: dict[str, tuple[int, int, int]], name: str) -> tuple[int, int, int]:
    """The RGB value of colour `name` in `colours`; unknown names are grey."""
    return colours.get(name, colours["Grey"])


def draw_unique(
    rng: random.Random,
    categories: Iterable[tuple],
    draw: Callable[[random.Random, str], Any],
    items: Iterable = (),
) -> list:
    """`items` followed by seeded draws: for each category (slug first, count last in its
    tuple), `draw(rng, slug)` until that category holds `count` items, redrawing any whose
    `title` is taken. Items need `category` and `title` attributes."""
    items = list(items)
    titles = {item.title for item in items}
    for slug, *_, count in categories:
        made = sum(1 for item in items if item.category == slug)
        while made < count:
            item = draw(rng, slug)
            if item.title in titles:
                continue
            titles.add(item.title)
            items.append(item)
            made += 1
    return items


def insert_categories(db: sqlite3.Connection, categories: list[tuple]) -> dict[str, int]:
    """Insert `categories(id, slug, name)` rows (ids from 1) from (slug, name, ...) tuples;
    returns slug -> id."""
    db.executemany(
        "INSERT INTO categories (id, slug, name) VALUES (?, ?, ?)",
        [(i, slug, name) for i, (slug, name, *_) in enumerate(categories, start=1)],
    )
    return {slug: i for i, (slug, *_) in enumerate(categories, start=1)}


@contextmanager
def template_db(path: str | Path, schema: str) -> Iterator[sqlite3.Connection]:
    """A connection to a new SQLite file at `path` (parents created, any old file replaced)
    holding `schema`; committed and closed when the block ends without error.

    Raises:
        OSError: `path` cannot be written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    db = sqlite3.connect(path)
    try:
        with db:
            db.executescript(schema)
            yield db
    finally:
        db.close()
