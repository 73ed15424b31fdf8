"""Seeded data of the classifieds site and the template database built from it.

`build_template_db(path, seed=0)` writes a SQLite file with four tables:

- `categories(id, slug, name)`
- `sellers(id, name, member_since)`
- `listings(id, category_id, seller_id, title, price, description, location, posted, colour)`
  (`price` in whole US dollars, `posted` an ISO date, `colour` names the image colour)
- `comments(id, listing_id, author, body, posted)`

Everything is drawn from `random.Random(seed)` and fixed dates, so the same seed gives the same
rows on every machine; the bundled tasks' reference answers depend on seed 0.
"""

import datetime as dt
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from envs.sites.common import seeding

SITE_TODAY = dt.date(2024, 4, 1)
"""The site's notion of "today": new comments carry this date, so pages stay deterministic."""

CATEGORIES: list[tuple[str, str, int]] = [
    ("bikes", "Bikes", 24),
    ("electronics", "Electronics", 26),
    ("furniture", "Furniture", 22),
    ("cars", "Cars", 18),
    ("books", "Books", 20),
    ("clothing", "Clothing", 20),
]
"""(slug, display name, number of listings)."""

COLOURS = seeding.COLOURS
"""Colour words used in titles and images, with their RGB values."""

# (noun, lowest price, highest price) per category; books and cars use their own title parts.
_NOUNS: dict[str, list[tuple[str, int, int]]] = {
    "bikes": [
        ("road bike", 90, 900),
        ("mountain bike", 120, 1200),
        ("BMX bike", 60, 300),
        ("cruiser bike", 80, 400),
        ("kids bike", 25, 120),
        ("folding bike", 100, 600),
        ("electric bike", 400, 2000),
        ("bike helmet", 15, 70),
        ("tandem bike", 200, 900),
    ],
    "electronics": [
        ("laptop", 150, 1400),
        ("tablet", 60, 600),
        ("smartphone", 80, 900),
        ("headphones", 20, 250),
        ("bluetooth speaker", 15, 200),
        ("digital camera", 60, 800),
        ("game console", 90, 450),
        ("computer monitor", 50, 400),
        ("mechanical keyboard", 25, 180),
        ("smartwatch", 40, 350),
    ],
    "furniture": [
        ("sofa", 80, 900),
        ("armchair", 40, 350),
        ("dining table", 60, 700),
        ("bookshelf", 20, 200),
        ("desk", 30, 400),
        ("office chair", 25, 300),
        ("coffee table", 20, 250),
        ("dresser", 40, 400),
        ("floor lamp", 10, 120),
    ],
    "clothing": [
        ("winter coat", 30, 250),
        ("rain jacket", 20, 150),
        ("denim jacket", 15, 90),
        ("sneakers", 15, 120),
        ("hiking boots", 30, 180),
        ("wool sweater", 15, 90),
        ("summer dress", 15, 100),
        ("leather belt", 10, 60),
    ],
}
_CAR_MODELS: list[tuple[str, str]] = [
    ("Toyota", "Corolla"),
    ("Honda", "Civic"),
    ("Ford", "Focus"),
    ("Subaru", "Outback"),
    ("Volkswagen", "Golf"),
    ("Mazda", "CX-5"),
    ("Toyota", "RAV4"),
    ("Honda", "Accord"),
    ("Ford", "F-150"),
    ("Hyundai", "Elantra"),
]
_BOOK_KINDS: list[tuple[str, int, int]] = [
    ("cookbook", 5, 35),
    ("calculus textbook", 15, 90),
    ("poetry collection", 4, 25),
    ("travel guide", 5, 30),
    ("mystery novel set", 8, 45),
    ("history of Rome", 6, 40),
    ("sci-fi paperback set", 8, 50),
    ("children's picture book", 3, 20),
    ("programming handbook", 10, 70),
]
_BOOK_ADJECTIVES = ["Hardcover", "Vintage", "Signed", "Illustrated", "Paperback", "Annotated"]

SELLERS: list[str] = [
    "Maria Lopez",
    "James Chen",
    "Aisha Khan",
    "Tom Becker",
    "Sofia Rossi",
    "David Kim",
    "Emma Wilson",
    "Lucas Martin",
    "Priya Patel",
    "Noah Brown",
    "Olivia Garcia",
    "Ben Okafor",
]
LOCATIONS: list[str] = [
    "Pittsburgh, PA",
    "Columbus, OH",
    "Buffalo, NY",
    "Cleveland, OH",
    "Erie, PA",
    "Rochester, NY",
    "Akron, OH",
    "Harrisburg, PA",
]
_CONDITIONS = [
    "Like new, used only a few times.",
    "Good condition with minor signs of wear.",
    "Well used but fully working.",
    "Brand new, still in the original box.",
    "Some scratches, see the photo.",
]
_EXTRAS = [
    "Pickup only, cash preferred.",
    "Can deliver within 10 miles.",
    "Price is firm.",
    "Open to reasonable offers.",
    "Moving sale, must go this week.",
    "Smoke-free and pet-free home.",
]
_COMMENTERS = ["Alex", "Jordan", "Sam", "Taylor", "Riley", "Casey", "Morgan", "Jamie"]
_COMMENT_BODIES = [
    "Is this still available?",
    "Would you take less for it?",
    "Can you send more photos?",
    "Where exactly can I pick it up?",
    "Does it come with the original receipt?",
    "I can pick it up this weekend.",
    "How old is it?",
]

ANCHOR_LISTING = {
    "category": "bikes",
    "title": "Blue road bike",
    "price": 120,
    "seller": "Maria Lopez",
    "location": "Pittsburgh, PA",
    "posted": dt.date(2024, 3, 28),
    "colour": "Blue",
    "description": "Lightweight aluminium frame, 21 gears, new tyres. Good condition with minor "
    "signs of wear. Pickup only, cash preferred.",
}
"""Listing 1, fixed by hand: the bundled easy task 1 asks for its price."""

SCHEMA = """
CREATE TABLE categories (
    id INTEGER PRIMARY KEY, slug TEXT NOT NULL UNIQUE, name TEXT NOT NULL
);
CREATE TABLE sellers (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, member_since TEXT NOT NULL
);
CREATE TABLE listings (
    id INTEGER PRIMARY KEY,
    category_id INTEGER NOT NULL REFERENCES categories(id),
    seller_id INTEGER NOT NULL REFERENCES sellers(id),
    title TEXT NOT NULL UNIQUE,
    price INTEGER NOT NULL,
    description TEXT NOT NULL,
    location TEXT NOT NULL,
    posted TEXT NOT NULL,
    colour TEXT NOT NULL
);
CREATE TABLE comments (
    id INTEGER PRIMARY KEY,
    listing_id INTEGER NOT NULL REFERENCES listings(id),
    author TEXT NOT NULL,
    body TEXT NOT NULL,
    posted TEXT NOT NULL
);
CREATE INDEX listings_category ON listings(category_id);
CREATE INDEX comments_listing ON comments(listing_id);
"""


@dataclass(frozen=True)
class _Listing:
    category: str
    title: str
    price: int
    seller: str
    location: str
    posted: dt.date
    colour: str
    description: str


def _nice_price(rng: random.Random, low: int, high: int) -> int:
    """A price in [low, high] rounded like people do: to 5, 10 or 100 dollars."""
    price = rng.randint(low, high)
    step = 5 if price < 200 else 10 if price < 1000 else 100
    return max(step, round(price / step) * step)


def _draw_listing(rng: random.Random, category: str) -> _Listing:
    """One random listing of `category` (its title may collide; the caller redraws)."""
    colour = rng.choice(list(COLOURS))
    if category == "cars":
        make, model = rng.choice(_CAR_MODELS)
        year = rng.randint(2006, 2020)
        title = f"{year} {make} {model}"
        price = _nice_price(rng, 2500 + (year - 2006) * 600, 6000 + (year - 2006) * 1200)
        first = f"{colour} {make} {model}, {rng.randint(4, 19) * 10000:,} miles."
    elif category == "books":
        kind, low, high = rng.choice(_BOOK_KINDS)
        title = f"{rng.choice(_BOOK_ADJECTIVES)} {kind}"
        price = _nice_price(rng, low, high)
        first = f"{title}, {rng.randint(120, 900)} pages."
    else:
        noun, low, high = rng.choice(_NOUNS[category])
        title = f"{colour} {noun}"
        price = _nice_price(rng, low, high)
        first = f"{colour} {noun} for sale."
    description = " ".join([first, rng.choice(_CONDITIONS), rng.choice(_EXTRAS)])
    return _Listing(
        category=category,
        title=title,
        price=price,
        seller=rng.choice(SELLERS),
        location=rng.choice(LOCATIONS),
        posted=SITE_TODAY - dt.timedelta(days=rng.randint(1, 90)),
        colour=colour,
        description=description,
    )


def generate_listings(seed: int = 0) -> list[dict]:
    """All listings in id order (id = position + 1) as dicts of `_Listing` fields.

    Listing 1 is `ANCHOR_LISTING`; titles are unique. Deterministic in `seed`.
    """
    rng = random.Random(seed)
    listings = seeding.draw_unique(rng, CATEGORIES, _draw_listing, [_Listing(**ANCHOR_LISTING)])
    order = list(range(1, len(listings)))
    rng.shuffle(order)
    shuffled = [listings[0]] + [listings[i] for i in order]
    return [asdict(item) for item in shuffled]


def generate_comments(n_listings: int, seed: int = 0) -> list[dict]:
    """Seeded comments: about a third of the listings get one to three comments."""
    rng = random.Random(seed + 1)
    comments = []
    for listing_id in range(1, n_listings + 1):
        if rng.random() >= 0.33:
            continue
        for _ in range(rng.randint(1, 3)):
            comments.append(
                {
                    "listing_id": listing_id,
                    "author": rng.choice(_COMMENTERS),
                    "body": rng.choice(_COMMENT_BODIES),
                    "posted": SITE_TODAY - dt.timedelta(days=rng.randint(0, 20)),
                }
            )
    comments.sort(key=lambda c: (c["listing_id"], c["posted"]))
    return comments


def build_template_db(path: str | Path, seed: int = 0) -> Path:
    """Write the classifieds template database to `path` (replacing any file there).

    Returns the path. Deterministic in `seed`; takes a few milliseconds.
    """
    listings = generate_listings(seed)
    comments = generate_comments(len(listings), seed)
    with seeding.template_db(path, SCHEMA) as db:
        category_ids = seeding.insert_categories(db, CATEGORIES)
        seller_ids = {name: i for i, name in enumerate(SELLERS, start=1)}
        db.executemany(
            "INSERT INTO sellers (id, name, member_since) VALUES (?, ?, ?)",
            [(i, name, f"{2015 + i % 8}-0{1 + i % 9}-01") for name, i in seller_ids.items()],
        )
        db.executemany(
            "INSERT INTO listings (id, category_id, seller_id, title, price, description,"
            " location, posted, colour) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    i,
                    category_ids[item["category"]],
                    seller_ids[item["seller"]],
                    item["title"],
                    item["price"],
                    item["description"],
                    item["location"],
                    item["posted"].isoformat(),
                    item["colour"],
                )
                for i, item in enumerate(listings, start=1)
            ],
        )
        db.executemany(
            "INSERT INTO comments (listing_id, author, body, posted) VALUES (?, ?, ?, ?)",
            [(c["listing_id"], c["author"], c["body"], c["posted"].isoformat()) for c in comments],
        )
    return Path(path)
