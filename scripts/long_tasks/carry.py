"""Long-horizon tasks 541-560: one fact read at the start on one site, carried through many
write actions on another, and asked for at the end.

Each task opens two sites in two tabs. The agent first opens one item on the first site and
reads one fact there (a listing's location or seller, a forum post's points, a product's
price), writes it down, and sends the first tab home, so that no later page shows the fact
again (not even the tab's title). Then, in the second tab, it writes on item after item (an
"Add to cart" on each of 6 shop products, or the same comment on each of 6 forum posts) and
finally answers with the fact, some 15-20K tokens after it read it. The scripted run forces
the note's key after `stop [` (the task's `answer_prefix`, e.g. `Black wool sweater
location:`), so what the model decodes is the fact alone.

The pages in between never show a fact of the same kind: the shop's pages name no city, no
seller and no forum points; the forum's pages show no dollar price and no listing's seller.
That is what fits these tasks to the default model: it recalls a fact many pages back when
nothing in between competes with it, while a seller read before ten more listings, each with
its own seller, is lost to the last one (tasks/README.md, "The long-horizon suite";
`distractor_probe.py`). Answers are computed from the sites' seed-0 data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scripts.long_tasks.classifieds import HOME as CLASSIFIEDS
from scripts.long_tasks.classifieds import LISTINGS, open_listing
from scripts.long_tasks.cross import tabs
from scripts.long_tasks.forum import HOME as FORUM
from scripts.long_tasks.forum import POSTS, comments_check, open_post, score
from scripts.long_tasks.forum import pick as pick_posts
from scripts.long_tasks.script import Script, comment_action, long_task, named, one_of
from scripts.long_tasks.shopping import ADD_TO_CART, PRODUCTS, cart_check, dollars, open_product
from scripts.long_tasks.shopping import HOME as SHOPPING
from scripts.long_tasks.shopping import pick as pick_products
from scripts.long_tasks.shopping import price as shop_price


@dataclass(frozen=True)
class Carried:
    """The fact a task carries: what it is, how the agent finds it, how it is scored.

    Attributes:
        site_goal: the goal's first sentence after the tabs, e.g. "First find out who sells
            the listing 'Blue cruiser bike'."
        answer_goal: what the goal asks for at the end, e.g. "the seller of 'Blue cruiser
            bike'".
        key: the note's key, e.g. "Blue cruiser bike seller".
        value: the fact as its page shows it, e.g. "Emma Wilson".
        reference: the answer's reference (`must_include`, `must_exclude`).
        open_item: opens the item on the first site (`open_listing`, `open_post`,
            `open_product`).
        item: the item's title.
        home: the `goto` target that sends the first tab home.
    """

    site_goal: str
    answer_goal: str
    key: str
    value: str
    reference: dict[str, list[str]]
    open_item: Callable[[Script, str, str | None], None]
    item: str
    home: str


def listing_location(title: str) -> Carried:
    """The city and state a classifieds listing is located in."""
    location = LISTINGS[title]["location"]
    cities = sorted({row["location"].split(",")[0] for row in LISTINGS.values()})
    return Carried(
        f"First find out where the listing '{title}' is located.",
        f"the location of '{title}'",
        f"{title} location",
        location,
        one_of(location.split(",")[0], cities),
        open_listing,
        title,
        "__CLASSIFIEDS__/",
    )


def listing_seller(title: str) -> Carried:
    """Who sells a classifieds listing."""
    seller = LISTINGS[title]["seller"]
    return Carried(
        f"First find out who sells the listing '{title}'.",
        f"the seller of '{title}'",
        f"{title} seller",
        seller,
        one_of(seller, sorted({row["seller"] for row in LISTINGS.values()})),
        open_listing,
        title,
        "__CLASSIFIEDS__/",
    )


def post_points(title: str) -> Carried:
    """How many points a forum post has (not who wrote it: every shop page names the
    signed-in account, `Signed in as Avery Agent`, and the author was lost to it)."""
    return Carried(
        f"First find out how many points the forum post '{title}' has.",
        f"the points of '{title}'",
        f"{title} points",
        score(title),
        {"must_include": [str(POSTS[title]["score"])]},
        open_post,
        title,
        "__FORUM__/",
    )


def product_price(title: str) -> Carried:
    """What a shop product costs."""
    return Carried(
        f"First find out the price of the product '{title}' in the shop.",
        f"the price of '{title}'",
        f"{title} price",
        shop_price(title),
        {"must_include": [dollars(PRODUCTS[title]["price"])]},
        lambda script, item, note: open_product(script, item, note),
        title,
        "__SHOPPING__/",
    )


def read_and_leave(script: Script, carried: Carried) -> None:
    """Open the carried fact's item, read the fact, send the first tab home with the note,
    and switch to the second tab (four actions)."""
    carried.open_item(script, carried.item, None)
    script.fact(carried.value)
    script.act(f"goto [{carried.home}]", note=f"{carried.key}: {carried.value}")
    script.act("tab_focus [1]")


def carry_to_cart(task_id: int, carried: Carried, first_site: str, products: list[str]) -> dict:
    """Read `carried` on the first site, then add one of each of `products` to the shop's
    cart (three actions each), then answer with the fact."""
    script = Script()
    read_and_leave(script, carried)
    for product in products:
        open_product(script, product)
        script.act(ADD_TO_CART)
    script.stop(f"{carried.key}: {carried.value}")
    first = {"classifieds": "The classifieds site", "forum": "The forum"}[first_site]
    intent = (
        f"{first} is open in the first tab and the shop in the second. {carried.site_goal} "
        f"Then, in the shop, add one of each of these products to your cart: "
        f"{named(products)}. When done, answer with {carried.answer_goal}."
    )
    start = {"classifieds": CLASSIFIEDS, "forum": FORUM}[first_site]
    task = long_task(
        task_id,
        tabs(start, SHOPPING, require_login=True),
        intent,
        script,
        carried.reference,
        f"{carried.key}: {carried.value}; then {len(products)} products added to the cart.",
        program_html=[cart_check([products[0], products[-1]])],
    )
    return {**task, "answer_prefix": f"{carried.key}:"}


def carry_to_comments(
    task_id: int, carried: Carried, first_site: str, posts: list[str], text: str
) -> dict:
    """Read `carried` on the first site, then post the comment `text` on each forum post of
    `posts` (three actions each), then answer with the fact."""
    script = Script()
    read_and_leave(script, carried)
    for post in posts:
        open_post(script, post)
        script.act(comment_action(text))
    script.stop(f"{carried.key}: {carried.value}")
    first = {"classifieds": "The classifieds site", "shopping": "The shop"}[first_site]
    intent = (
        f"{first} is open in the first tab and the forum in the second. {carried.site_goal} "
        f"Then, on the forum, post the comment '{text}' on each of these posts: "
        f"{named(posts)}. When done, answer with {carried.answer_goal}."
    )
    start = {"classifieds": CLASSIFIEDS, "shopping": SHOPPING}[first_site]
    task = long_task(
        task_id,
        tabs(start, FORUM, require_login=True),
        intent,
        script,
        carried.reference,
        f"{carried.key}: {carried.value}; then {len(posts)} comments on the forum.",
        program_html=[
            comments_check(post, {"must_include": [text]}) for post in (posts[0], posts[-1])
        ],
    )
    return {**task, "answer_prefix": f"{carried.key}:"}


def scored(forum: str) -> str:
    """The first post of /f/`forum` after its first six with at least 10 points (two digits
    at least: an answer of 0 or -1 is too easy to hit by chance)."""
    return next(title for title in pick_posts(forum, 30, skip=6) if POSTS[title]["score"] >= 10)


COMMENTS = (
    "Thanks, this was useful.",
    "Bookmarked for later.",
    "Good point, I agree.",
    "Following this thread.",
    "Same here, thanks for sharing.",
)
"""The comment each forum-writing task posts (one per task)."""


def tasks() -> list[dict[str, Any]]:
    """Tasks 541-560: five of each pairing (a listing's location or a post's points carried
    to the cart, a listing's seller or a product's price carried to forum comments)."""
    listings = list(LISTINGS)
    products = pick_products(count=100)
    forums = ["bikes", "cooking", "books", "music", "science"]
    built = []
    for n in range(5):
        built.append(
            carry_to_cart(
                541 + n,
                listing_location(listings[7 + 11 * n]),
                "classifieds",
                products[6 * n : 6 * n + 6],
            )
        )
        built.append(
            carry_to_comments(
                546 + n,
                listing_seller(listings[3 + 13 * n]),
                "classifieds",
                pick_posts(forums[n], 6, skip=2),
                COMMENTS[n],
            )
        )
        built.append(
            carry_to_cart(
                551 + n,
                post_points(scored(forums[(n + 2) % 5])),
                "forum",
                products[40 + 6 * n : 40 + 6 * n + 6],
            )
        )
        built.append(
            carry_to_comments(
                556 + n,
                product_price(products[95 - n]),
                "shopping",
                pick_posts(forums[(n + 1) % 5], 6, skip=3),
                COMMENTS[(n + 3) % 5],
            )
        )
    return sorted(built, key=lambda task: task["task_id"])
