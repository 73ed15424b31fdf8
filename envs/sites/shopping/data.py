"""Seeded data of the shopping site and the template database built from it.

`build_template_db(path, seed=0)` writes a SQLite file with these tables:

- `categories(id, slug, name)`
- `products(id, category_id, title, brand, price, description, colour, added, rating,
  review_count)` (`price` in cents, `added` an ISO date, `colour` names the image colour,
  `rating` the mean review rating rounded to one decimal or NULL without reviews)
- `reviews(id, product_id, author, rating, title, body, posted)`
- `users(id, username, password, name, address, city, zip)` (the first is
  `envs.sites.common.accounts.TEST_ACCOUNT`; `address`, `city` and `zip` prefill the checkout form)
- `cart_items(user_id, product_id, quantity)`
- `orders(id, user_id, placed, status, ship_name, ship_address, ship_city, ship_zip, total)`
  and `order_items(id, order_id, product_id, title, price, quantity)` (prices in cents, copied
  at purchase time)

Everything is drawn from `random.Random(seed)` and fixed dates, so the same seed gives the same
rows on every machine; the bundled tasks' reference answers depend on seed 0.
"""

import datetime as dt
import random
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path

from envs.sites.common import seeding
from envs.sites.common.accounts import TEST_ACCOUNT

SITE_TODAY = dt.date(2024, 4, 1)
"""The site's notion of "today": new orders carry this date, so pages stay deterministic."""

FIRST_ORDER_ID = 1001
"""Order numbers start here (shown as "Order #1001")."""

CATEGORIES: list[tuple[str, str, int]] = [
    ("electronics", "Electronics", 24),
    ("home-kitchen", "Home and Kitchen", 14),
    ("books", "Books", 12),
    ("toys-games", "Toys and Games", 10),
    ("sports-outdoors", "Sports and Outdoors", 12),
    ("clothing", "Clothing", 12),
    ("beauty", "Beauty", 8),
    ("grocery", "Grocery", 8),
]
"""(slug, display name, number of products)."""

COLOURS = {name: rgb for name, rgb in seeding.COLOURS.items() if name != "Silver"}
"""Colour names used in descriptions, clothing titles and images, with their RGB values."""

# Per category: brands, and (noun, lowest, highest price in whole dollars). Titles are
# "<brand> <noun>" ("<brand> <colour> <noun>" for clothing, the book title for books).
_BRANDS: dict[str, list[str]] = {
    "electronics": ["Sonara", "Voltix", "Pixelon", "Nordtek", "Auralis"],
    "home-kitchen": ["Hearthly", "Kitchora", "Casa Verde", "Ironwood"],
    "books": ["Northwind Press", "Bluebell Books", "Harbor House"],
    "toys-games": ["Playfield", "Tinkerly", "Wonderbox"],
    "sports-outdoors": ["Trailpeak", "Summit Gear", "Stride"],
    "clothing": ["Urban Thread", "Loomcraft", "Northline"],
    "beauty": ["Glowen", "Purely", "Velvetine"],
    "grocery": ["Harvest Lane", "Old Mill", "Sunny Acres"],
}
_NOUNS: dict[str, list[tuple[str, int, int]]] = {
    "electronics": [
        ("wireless headphones", 25, 250),
        ("bluetooth speaker", 15, 180),
        ("USB-C charger", 8, 45),
        ("smartwatch", 40, 300),
        ("laptop stand", 15, 80),
        ("webcam", 20, 120),
        ("mechanical keyboard", 30, 160),
        ("wireless mouse", 10, 70),
        ("e-reader", 60, 220),
        ("portable SSD", 40, 200),
        ("power bank", 12, 70),
        ("tablet", 80, 600),
    ],
    "home-kitchen": [
        ("French press", 12, 50),
        ("cast iron skillet", 15, 70),
        ("blender", 25, 200),
        ("toaster", 18, 90),
        ("coffee grinder", 15, 120),
        ("cutting board", 8, 45),
        ("tea kettle", 12, 70),
        ("stand mixer", 80, 400),
        ("bath towel set", 15, 60),
        ("table lamp", 15, 90),
    ],
    "books": [
        ("The Quiet Orchard", 8, 25),
        ("Rivers of Glass", 9, 28),
        ("A Field Guide to Mushrooms", 12, 35),
        ("Learning Python Step by Step", 20, 55),
        ("The Baker Street Cookbook", 14, 40),
        ("Midnight in Lisbon", 8, 22),
        ("Stars Over Kyoto", 9, 24),
        ("Pocket Atlas of the World", 10, 30),
        ("Gardening for Beginners", 10, 28),
        ("The Last Lighthouse", 8, 22),
        ("Mountain Trails of Colorado", 12, 32),
        ("The Art of Bread", 15, 38),
        ("Small Boats, Big Seas", 9, 26),
        ("A Short History of Maps", 12, 34),
    ],
    "toys-games": [
        ("building blocks set", 15, 90),
        ("jigsaw puzzle", 8, 30),
        ("board game", 15, 60),
        ("plush bear", 8, 35),
        ("remote control car", 20, 120),
        ("card game", 5, 20),
        ("kite", 8, 40),
        ("chess set", 15, 90),
        ("art supply set", 10, 50),
    ],
    "sports-outdoors": [
        ("yoga mat", 12, 70),
        ("water bottle", 8, 40),
        ("camping tent", 60, 350),
        ("hiking backpack", 35, 180),
        ("dumbbell set", 30, 200),
        ("tennis racket", 25, 180),
        ("sleeping bag", 30, 200),
        ("jump rope", 5, 25),
        ("bike lock", 12, 60),
    ],
    "clothing": [
        ("cotton t-shirt", 8, 30),
        ("hooded sweatshirt", 20, 70),
        ("rain jacket", 35, 160),
        ("wool socks", 6, 25),
        ("denim jeans", 25, 90),
        ("baseball cap", 8, 30),
        ("fleece vest", 20, 80),
        ("winter gloves", 10, 45),
    ],
    "beauty": [
        ("face moisturizer", 10, 60),
        ("lip balm", 3, 12),
        ("shampoo", 5, 25),
        ("sunscreen SPF 50", 8, 30),
        ("hand cream", 5, 25),
        ("hair dryer", 25, 150),
        ("nail polish set", 8, 30),
    ],
    "grocery": [
        ("ground coffee", 8, 25),
        ("green tea", 4, 15),
        ("olive oil", 8, 30),
        ("dark chocolate bar", 2, 8),
        ("wildflower honey", 6, 20),
        ("maple syrup", 8, 25),
        ("almond butter", 6, 18),
        ("pasta sauce", 3, 10),
    ],
}
_FEATURES: dict[str, list[str]] = {
    "electronics": [
        "Two-year warranty.",
        "Battery lasts all day.",
        "Works with phones and laptops.",
    ],
    "home-kitchen": ["Dishwasher safe.", "Easy to clean.", "Fits small kitchens."],
    "books": ["Paperback edition.", "Hardcover edition.", "Includes colour illustrations."],
    "toys-games": ["For ages 6 and up.", "For ages 3 and up.", "Great for family nights."],
    "sports-outdoors": ["Lightweight and durable.", "Water resistant.", "Made for daily use."],
    "clothing": ["Machine washable.", "Regular fit.", "Made from recycled fabric."],
    "beauty": ["Fragrance free.", "Dermatologist tested.", "Cruelty free."],
    "grocery": ["Organic.", "Fair trade.", "Made in small batches."],
}
_REVIEWERS = ["Jordan", "Sam", "Taylor", "Riley", "Casey", "Morgan", "Jamie", "Chris", "Dana"]
_REVIEW_TEXT: dict[int, list[tuple[str, str]]] = {
    5: [
        ("Love it", "Exactly what I wanted, great quality."),
        ("Excellent", "Works perfectly, would buy again."),
        ("Five stars", "Better than expected for the price."),
    ],
    4: [
        ("Very good", "Good quality, only small issues."),
        ("Works well", "Does the job, arrived quickly."),
    ],
    3: [
        ("It is okay", "Average quality for the price."),
        ("Average", "Not bad, not great."),
    ],
    2: [("Disappointing", "Lower quality than I hoped.")],
    1: [
        ("Broke quickly", "Stopped working after a week."),
        ("Do not buy", "Poor quality, I returned it."),
    ],
}

ACCOUNT_PROFILE = {
    "name": "Avery Agent",
    "address": "4200 Fifth Avenue",
    "city": "Pittsburgh",
    "zip": "15213",
}
"""Name and default shipping address of the test account (prefilled at checkout)."""
OTHER_USERS: list[tuple[str, str, str, str, str, str]] = [
    ("sam", "sam-password", "Sam Shopper", "12 Elm Street", "Columbus", "43004"),
]
"""(username, password, name, address, city, zip) of accounts other than the test account."""
_SHIP_TO: list[tuple[str, str, str, str]] = [
    ("Avery Agent", "4200 Fifth Avenue", "Pittsburgh", "15213"),
    ("Avery Agent", "77 Market Street", "Philadelphia", "19106"),
    ("Jo Agent", "9 Lake Road", "Erie", "16501"),
]
"""Shipping addresses used by the test account's past orders."""
N_ACCOUNT_ORDERS = 6
"""Past orders of the test account (other accounts get two each)."""

SCHEMA = """
CREATE TABLE categories (
    id INTEGER PRIMARY KEY, slug TEXT NOT NULL UNIQUE, name TEXT NOT NULL
);
CREATE TABLE products (
    id INTEGER PRIMARY KEY,
    category_id INTEGER NOT NULL REFERENCES categories(id),
    title TEXT NOT NULL UNIQUE,
    brand TEXT NOT NULL,
    price INTEGER NOT NULL,
    description TEXT NOT NULL,
    colour TEXT NOT NULL,
    added TEXT NOT NULL,
    rating REAL,
    review_count INTEGER NOT NULL
);
CREATE TABLE reviews (
    id INTEGER PRIMARY KEY,
    product_id INTEGER NOT NULL REFERENCES products(id),
    author TEXT NOT NULL,
    rating INTEGER NOT NULL,
    title TEXT NOT NULL,
    body TEXT NOT NULL,
    posted TEXT NOT NULL
);
CREATE TABLE users (
    id INTEGER PRIMARY KEY,
    username TEXT NOT NULL UNIQUE,
    password TEXT NOT NULL,
    name TEXT NOT NULL,
    address TEXT NOT NULL,
    city TEXT NOT NULL,
    zip TEXT NOT NULL
);
CREATE TABLE cart_items (
    user_id INTEGER NOT NULL REFERENCES users(id),
    product_id INTEGER NOT NULL REFERENCES products(id),
    quantity INTEGER NOT NULL,
    PRIMARY KEY (user_id, product_id)
);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY,
    user_id INTEGER NOT NULL REFERENCES users(id),
    placed TEXT NOT NULL,
    status TEXT NOT NULL,
    ship_name TEXT NOT NULL,
    ship_address TEXT NOT NULL,
    ship_city TEXT NOT NULL,
    ship_zip TEXT NOT NULL,
    total INTEGER NOT NULL
);
CREATE TABLE order_items (
    id INTEGER PRIMARY KEY,
    order_id INTEGER NOT NULL REFERENCES orders(id),
    product_id INTEGER NOT NULL REFERENCES products(id),
    title TEXT NOT NULL,
    price INTEGER NOT NULL,
    quantity INTEGER NOT NULL
);
CREATE INDEX products_category ON products(category_id);
CREATE INDEX reviews_product ON reviews(product_id);
CREATE INDEX orders_user ON orders(user_id);
CREATE INDEX order_items_order ON order_items(order_id);
"""


@dataclass(frozen=True)
class _Product:
    category: str
    title: str
    brand: str
    price: int
    description: str
    colour: str
    added: dt.date


def _shop_price(rng: random.Random, low: int, high: int) -> int:
    """A price in cents from about `low` to `high` dollars, ending in .99, .49, .95 or .00."""
    dollars = rng.randint(low, high)
    cents = rng.choice([99, 99, 49, 95, 0])
    return max(99, dollars * 100 - 100 + cents if cents else dollars * 100)


def _draw_product(rng: random.Random, category: str) -> _Product:
    """One random product of `category` (its title may collide; the caller redraws)."""
    brand = rng.choice(_BRANDS[category])
    noun, low, high = rng.choice(_NOUNS[category])
    colour = rng.choice(list(COLOURS))
    if category == "books":
        title, kind = noun, f"A book from {brand}."
    elif category == "clothing":
        title, kind = f"{brand} {colour.lower()} {noun}", f"A {colour.lower()} {noun}."
    else:
        title, kind = f"{brand} {noun}", f"A {noun} by {brand}."
    features = rng.sample(_FEATURES[category], 2)
    colour_line = "" if category in ("books", "clothing") else f" Colour: {colour.lower()}."
    return _Product(
        category=category,
        title=title,
        brand=brand,
        price=_shop_price(rng, low, high),
        description=" ".join([kind, *features]) + colour_line,
        colour=colour,
        added=SITE_TODAY - dt.timedelta(days=rng.randint(1, 180)),
    )


def generate_products(seed: int = 0) -> list[dict]:
    """All products in id order (id = position + 1) as dicts of `_Product` fields.

    Titles are unique; categories are interleaved by a seeded shuffle. Deterministic in `seed`.
    """
    rng = random.Random(seed)
    products = seeding.draw_unique(rng, CATEGORIES, _draw_product)
    rng.shuffle(products)
    return [asdict(item) for item in products]


def generate_reviews(n_products: int, seed: int = 0) -> list[dict]:
    """Seeded reviews: each product gets zero to seven, around a per-product quality."""
    rng = random.Random(seed + 1)
    reviews = []
    for product_id in range(1, n_products + 1):
        quality = rng.uniform(2.2, 5.2)
        for _ in range(rng.choice([0, 1, 2, 3, 3, 4, 5, 6, 7])):
            rating = min(5, max(1, round(rng.gauss(quality, 0.9))))
            title, body = rng.choice(_REVIEW_TEXT[rating])
            reviews.append(
                {
                    "product_id": product_id,
                    "author": rng.choice(_REVIEWERS),
                    "rating": rating,
                    "title": title,
                    "body": body,
                    "posted": SITE_TODAY - dt.timedelta(days=rng.randint(1, 120)),
                }
            )
    reviews.sort(key=lambda r: (r["product_id"], r["posted"]))
    return reviews


def generate_orders(products: list[dict], seed: int = 0) -> list[dict]:
    """Past orders, oldest first, with ids from FIRST_ORDER_ID.

    Each is {id, user_id, placed, status, ship_name, ship_address, ship_city, ship_zip, items}
    with items [(product_id, quantity)]; user 1 (the test account) has N_ACCOUNT_ORDERS of them,
    every other user two.
    """
    rng = random.Random(seed + 2)
    owners = [1] * N_ACCOUNT_ORDERS + [uid for uid in range(2, 2 + len(OTHER_USERS))] * 2
    rng.shuffle(owners)
    days = sorted(rng.sample(range(3, 100), len(owners)), reverse=True)
    orders = []
    for number, (user_id, days_ago) in enumerate(zip(owners, days, strict=True)):
        if user_id == 1:
            ship = rng.choice(_SHIP_TO)
        else:
            ship = OTHER_USERS[user_id - 2][2:]
        n_items = rng.randint(1, 4)
        picked = rng.sample(range(1, len(products) + 1), n_items)
        status = "Delivered" if days_ago > 10 else "Shipped"
        orders.append(
            {
                "id": FIRST_ORDER_ID + number,
                "user_id": user_id,
                "placed": SITE_TODAY - dt.timedelta(days=days_ago),
                "status": status,
                "ship_name": ship[0],
                "ship_address": ship[1],
                "ship_city": ship[2],
                "ship_zip": ship[3],
                "items": [(pid, rng.choice([1, 1, 1, 2, 3])) for pid in picked],
            }
        )
    return orders


def build_template_db(path: str | Path, seed: int = 0) -> Path:
    """Write the shopping template database to `path` (replacing any file there).

    The test account (`envs.sites.common.accounts.TEST_ACCOUNT`) is user 1, with past orders
    and two items in its cart. Returns the path. Deterministic in `seed`; takes a few milliseconds.
    """

    products = generate_products(seed)
    reviews = generate_reviews(len(products), seed)
    orders = generate_orders(products, seed)
    with seeding.template_db(path, SCHEMA) as db:
        category_ids = seeding.insert_categories(db, CATEGORIES)
        _insert_products(db, products, reviews, category_ids)
        _insert_reviews(db, reviews)
        _insert_users(db)
        _insert_orders(db, orders, products)
        _insert_cart(db, len(products), seed)
    return Path(path)


def _insert_products(
    db: sqlite3.Connection, products: list[dict], reviews: list[dict], category_ids: dict[str, int]
) -> None:
    """Insert `products` (ids from 1, in order) with their mean rating (one decimal, None
    without reviews) and review count from `reviews`."""
    by_product: dict[int, list[int]] = {}
    for review in reviews:
        by_product.setdefault(review["product_id"], []).append(review["rating"])
    rows = []
    for i, item in enumerate(products, start=1):
        ratings = by_product.get(i, [])
        rating = round(sum(ratings) / len(ratings) + 1e-9, 1) if ratings else None
        rows.append(
            (
                i,
                category_ids[item["category"]],
                item["title"],
                item["brand"],
                item["price"],
                item["description"],
                item["colour"],
                item["added"].isoformat(),
                rating,
                len(ratings),
            )
        )
    db.executemany(
        "INSERT INTO products (id, category_id, title, brand, price, description, colour,"
        " added, rating, review_count) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )


def _insert_reviews(db: sqlite3.Connection, reviews: list[dict]) -> None:
    """Insert `reviews`, their dates as ISO text."""
    db.executemany(
        "INSERT INTO reviews (product_id, author, rating, title, body, posted)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        [
            (r["product_id"], r["author"], r["rating"], r["title"], r["body"], r["posted"])
            for r in ({**r, "posted": r["posted"].isoformat()} for r in reviews)
        ],
    )


def _insert_users(db: sqlite3.Connection) -> None:
    """Insert the test account as user 1 (with `ACCOUNT_PROFILE`), then `OTHER_USERS`."""
    profile = ACCOUNT_PROFILE
    users = [
        (TEST_ACCOUNT["username"], TEST_ACCOUNT["password"], *profile.values()),
        *OTHER_USERS,
    ]
    db.executemany(
        "INSERT INTO users (id, username, password, name, address, city, zip)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(i, *user) for i, user in enumerate(users, start=1)],
    )


def _insert_orders(db: sqlite3.Connection, orders: list[dict], products: list[dict]) -> None:
    """Insert `orders` (`generate_orders`) with their totals, and their items with each
    product's title and price."""
    for order in orders:
        total = sum(products[pid - 1]["price"] * qty for pid, qty in order["items"])
        db.execute(
            "INSERT INTO orders (id, user_id, placed, status, ship_name, ship_address,"
            " ship_city, ship_zip, total) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                order["id"],
                order["user_id"],
                order["placed"].isoformat(),
                order["status"],
                order["ship_name"],
                order["ship_address"],
                order["ship_city"],
                order["ship_zip"],
                total,
            ],
        )
        db.executemany(
            "INSERT INTO order_items (order_id, product_id, title, price, quantity)"
            " VALUES (?, ?, ?, ?, ?)",
            [
                (order["id"], pid, products[pid - 1]["title"], products[pid - 1]["price"], qty)
                for pid, qty in order["items"]
            ],
        )


def _insert_cart(db: sqlite3.Connection, n_products: int, seed: int) -> None:
    """Put two products drawn with `seed` in the test account's cart, one of the first and
    two of the second."""
    cart_rng = random.Random(seed + 3)
    cart = cart_rng.sample(range(1, n_products + 1), 2)
    db.executemany(
        "INSERT INTO cart_items (user_id, product_id, quantity) VALUES (1, ?, ?)",
        [(pid, qty) for pid, qty in zip(cart, (1, 2), strict=True)],
    )
