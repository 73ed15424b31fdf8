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

The pages in between never show the fact itself again, and the work pages were meant to show
no fact of its kind: the default model recalls a fact many pages back when nothing in between
competes with it, while a seller read before ten more listings, each with its own seller, is
lost to the last one (tasks/README.md, "The long-horizon suite"; `distractor_probe.py`). By the
kinds of `kinds.py` every task here has distractors all the same (`distractors` true): the
home page the first tab is sent to shows eight listings' locations (541-545) or eight
products' prices (556-560), though no work page does, and on four tasks one of those is
the fact's very value (`SHOWN_AGAIN`); the forum's pages name its users (546-550), and the
shop's pages show counts, `Cart (N)` and review counts (551-555).
`carry_more.py` (561-600) adds tasks without, and `alternate_splits` splits both families into
calibration and held-out halves. Answers are computed from the sites' seed-0 data.
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
from scripts.long_tasks.kinds import KINDS, Kind
from scripts.long_tasks.script import Script, Start, comment_action, long_task, named, one_of
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
        site: where the first site starts (its home page, where the first tab is sent back).
        site_name: how the goal names the first site, e.g. "The classifieds site".
        kind: what the fact is (`kinds.KINDS`).
    """

    site_goal: str
    answer_goal: str
    key: str
    value: str
    reference: dict[str, list[str]]
    open_item: Callable[[Script, str, str | None], None]
    item: str
    site: Start
    site_name: str
    kind: Kind


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
        CLASSIFIEDS,
        "The classifieds site",
        "location",
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
        CLASSIFIEDS,
        "The classifieds site",
        "name",
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
        FORUM,
        "The forum",
        "count",
    )


def product_price(title: str) -> Carried:
    """What a shop product costs."""
    return Carried(
        f"First find out the price of the product '{title}' in the shop.",
        f"the price of '{title}'",
        f"{title} price",
        shop_price(title),
        {"must_include": [dollars(PRODUCTS[title]["price"])]},
        open_product,
        title,
        SHOPPING,
        "The shop",
        "price",
    )


def read_and_leave(script: Script, carried: Carried) -> None:
    """Open the carried fact's item, read the fact, send the first tab home with the note,
    and switch to the second tab (four actions)."""
    carried.open_item(script, carried.item, None)
    script.fact(carried.value, carried.kind)
    script.act(f"goto [{carried.site.url}]", note=f"{carried.key}: {carried.value}")
    script.act("tab_focus [1]")


def carry_task(
    task_id: int,
    carried: Carried,
    second: tuple[Start, str],
    work: tuple[str, Callable[[Script, str], None], list[str], str],
    checks: list[dict[str, Any]],
) -> dict:
    """Read `carried` on the first site, then do the work on each item of the second site,
    then answer with the fact (`answer_prefix`: the note's key).

    Args:
        second: where the second site starts and how the goal names it ("the shop").
        work: the goal's sentence for the work ("add one of each of these products to your
            cart"), the actions on one item (`act(script, item)`), the items, and what the
            task's comment calls them done ("products added to the cart").
        checks: the `program_html` checks of the work.
    """
    (start, name), (goal, act, items, done) = second, work
    script = Script()
    read_and_leave(script, carried)
    for item in items:
        act(script, item)
    script.stop(f"{carried.key}: {carried.value}")
    intent = (
        f"{carried.site_name} is open in the first tab and {name} in the second. "
        f"{carried.site_goal} Then, {goal}: {named(items)}. "
        f"When done, answer with {carried.answer_goal}."
    )
    task = long_task(
        task_id,
        tabs(carried.site, start, require_login=True),
        intent,
        script,
        carried.reference,
        f"{carried.key}: {carried.value}; then {len(items)} {done}.",
        program_html=checks,
    )
    return {**task, "answer_prefix": f"{carried.key}:", "distractors": True}


def carry_to_cart(task_id: int, carried: Carried, products: list[str]) -> dict:
    """Read `carried` on the first site, then add one of each of `products` to the shop's
    cart (three actions each), then answer with the fact."""

    def add(script: Script, product: str) -> None:
        open_product(script, product)
        script.act(ADD_TO_CART)

    goal = "in the shop, add one of each of these products to your cart"
    checks = [cart_check([products[0], products[-1]])]
    work = (goal, add, products, "products added to the cart")
    return carry_task(task_id, carried, (SHOPPING, "the shop"), work, checks)


def carry_to_comments(task_id: int, carried: Carried, posts: list[str], text: str) -> dict:
    """Read `carried` on the first site, then post the comment `text` on each forum post of
    `posts` (three actions each), then answer with the fact."""

    def comment(script: Script, post: str) -> None:
        open_post(script, post)
        script.act(comment_action(text))

    goal = f"on the forum, post the comment '{text}' on each of these posts"
    checks = [comments_check(post, {"must_include": [text]}) for post in (posts[0], posts[-1])]
    work = (goal, comment, posts, "comments on the forum")
    return carry_task(task_id, carried, (FORUM, "the forum"), work, checks)


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


SHOWN_AGAIN = {543: 4, 544: 4, 545: 4, 558: 4}
"""Task -> the one page after the fact that shows the fact's text again: the home page the
first tab is sent to lists another listing in the same city (543-545: `Columbus, OH`,
`Columbus, OH`, `Pittsburgh, PA`) or another product at the same price (558: `$23.95`). The
fact's own item does not show again; the build and the replay test allow the text there
only (the reference actions of these tasks are kept as built)."""
SPLITS = ("calibration", "held-out")


def alternate_splits(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`tasks` (one family's), each with its `split`: ordered by group (without distractors
    first), the carried fact's kind (`kinds.KINDS` order) and task id, they are calibration,
    held-out, calibration, ... in turn; so each half holds half of every group and kind of the
    family (to one task). Uses nothing but the tasks themselves (no results)."""

    def order(task: dict[str, Any]) -> tuple[bool, int, int]:
        (fact,) = task["facts"]
        return task["distractors"], KINDS.index(fact["kind"]), task["task_id"]

    ordered = sorted(tasks, key=order)
    splits = {task["task_id"]: SPLITS[i % 2] for i, task in enumerate(ordered)}
    return [{**task, "split": splits[task["task_id"]]} for task in tasks]


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
                products[6 * n : 6 * n + 6],
            )
        )
        built.append(
            carry_to_comments(
                546 + n,
                listing_seller(listings[3 + 13 * n]),
                pick_posts(forums[n], 6, skip=2),
                COMMENTS[n],
            )
        )
        built.append(
            carry_to_cart(
                551 + n,
                post_points(scored(forums[(n + 2) % 5])),
                products[40 + 6 * n : 40 + 6 * n + 6],
            )
        )
        built.append(
            carry_to_comments(
                556 + n,
                product_price(products[95 - n]),
                pick_posts(forums[(n + 1) % 5], 6, skip=3),
                COMMENTS[(n + 3) % 5],
            )
        )
    return alternate_splits(sorted(built, key=lambda task: task["task_id"]))
