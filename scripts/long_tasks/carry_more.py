"""Long-horizon tasks 561-600: more carry tasks, fitted to the default model like 541-560, with
more kinds of fact, distances from 4K to 24K tokens, and tasks with and without distractors.

Each task answers with one fact read once: a name (a listing's seller, a post's author, a
product's reviewer), a price (a listing's, a product's, an order's total), a count (a post's
points, a user's karma, a listing's comments, a product's reviews), an id (an order's
number), a date (a listing's, a post's, an order's) or a location (a listing's city, an
order's shipping city). Around that reading the agent works on items of one site: it adds
products to the shop's cart, buys products one order each, or posts a comment on forum posts
or classifieds listings; some items come before the fact and the rest after it, so the fact
is read 1 to 10 items before the answer (4K-25K tokens). A task on two sites opens them in two
tabs, the work's in the first: the agent reads the fact in the second tab and closes it, so
no later page is that site's. The scripted run forces the note's key after `stop [`
(`answer_prefix`), as in `carry.py`.

`distractors` says whether a page after the fact, up to the answer, shows another fact of
its kind (`kinds.shown`): the tasks without (561-585) carry a price to the forum (which shows
none), a location or an id to pages that name no city or order, a date to shop pages of
products without reviews; the tasks with (586-600) carry a fact through pages of its own kind
(a seller through more listings, a post's points through more posts, an order's number through
new orders). Every page that takes writes shows a name and a count, so names and counts are
carried with distractors only (`kinds.py`). The build checks both ways on replay, and that the
fact itself never shows again. `carry.alternate_splits` assigns the splits. Answers are
computed from the sites' seed-0 data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from envs.sites.classifieds.data import SELLERS, generate_comments
from envs.sites.common.web import money_cents, site_date
from envs.sites.forum.data import USERNAMES
from envs.sites.shopping.data import generate_orders
from scripts.long_tasks.carry import COMMENTS as FORUM_COMMENTS
from scripts.long_tasks.carry import alternate_splits
from scripts.long_tasks.classifieds import HOME as CLASSIFIEDS
from scripts.long_tasks.classifieds import LISTINGS, listing_check, open_listing
from scripts.long_tasks.classifieds import pick as pick_listings
from scripts.long_tasks.classifieds import posted as listing_posted
from scripts.long_tasks.classifieds import price as listing_price
from scripts.long_tasks.cross import tabs
from scripts.long_tasks.forum import KARMA, POSTS, comments_check, open_post, score
from scripts.long_tasks.forum import pick as pick_posts
from scripts.long_tasks.forum import posted as post_posted
from scripts.long_tasks.kinds import Kind
from scripts.long_tasks.script import (
    Script,
    Start,
    comment_action,
    element,
    long_task,
    one_of,
    search_action,
)
from scripts.long_tasks.shopping import (
    _ROWS,
    ADD_TO_CART,
    ORDERS,
    PRODUCTS,
    cart_check,
    dollars,
    order_total,
    product_link,
)
from scripts.long_tasks.shopping import pick as pick_products
from scripts.long_tasks.shopping import price as product_price

FORUM = Start(["forum"], "__FORUM__/", require_login=True)
"""The forum's home page, signed in (to comment)."""
SHOP = Start(["shopping"], "__SHOPPING__/", require_login=True)
"""The shop's home page, signed in (to use the cart and the orders)."""
MY_ORDERS = "click [link 'My orders']"
"""The action opening the account's order history from any signed-in shop page."""
LISTING_COMMENTS = Counter(c["listing_id"] for c in generate_comments(len(LISTINGS), 0))
"""Each listing's number of comments (by listing id), as its page counts them."""
NO_REVIEWS = [t for t in pick_products(count=100) if not PRODUCTS[t]["reviews"]]
"""The shop's products without reviews (their pages show no date), outside the initial cart."""
NEW_ORDER = max(order["id"] for order in generate_orders(_ROWS, 0)) + 1
"""The number the shop gives the first order placed in a task (every account's orders)."""


def date_reference(shown: str) -> dict[str, list[str]]:
    """A date as the sites show it (`Feb 28, 2024`), written either way or in ISO form."""
    month, day, year = shown.replace(",", "").split()
    months = "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split()
    number = months.index(month) + 1
    longer = "January February March April May June July August September October November December"
    alternatives = [shown, f"{longer.split()[number - 1]} {day}, {year}"]
    alternatives.append(f"{year}-{number:02d}-{int(day):02d}")
    return {"must_include": [" |OR| ".join(dict.fromkeys(alternatives))]}


def amount_reference(dollars_shown: str) -> dict[str, list[str]]:
    """A whole-dollar price as the classifieds show it (`$8,900`), with or without the comma."""
    shown = dollars_shown[1:]
    return {"must_include": [" |OR| ".join(dict.fromkeys([shown, shown.replace(",", "")]))]}


@dataclass(frozen=True)
class Reading:
    """The fact a task carries: what it is, how the agent reaches it, how it is scored.

    Attributes:
        kind: what the fact is (`kinds.KINDS`).
        goal: the goal's words for reading it, e.g. "find out the price of the listing 'Blue
            road bike'".
        answer_goal: what the goal asks for at the end, e.g. "the price of 'Blue road bike'".
        key: the note's key, e.g. "Blue road bike price" (the task's `answer_prefix`).
        value: the fact as the note and the answer write it.
        text: the fact as its page shows it (`envs.tasks.Fact.text`).
        reference: the answer's reference (`must_include`, `must_exclude`).
        read: the actions from any page of its site to the page that shows it.
        site: where its site starts (signed in where the site has accounts).
        site_name: how the goal names its site, e.g. "the classifieds site".
    """

    kind: Kind
    goal: str
    answer_goal: str
    key: str
    value: str
    text: str
    reference: dict[str, list[str]]
    read: Callable[[Script], None]
    site: Start
    site_name: str


def listing_fact(title: str, kind: Kind) -> Reading:
    """A classifieds listing's price, seller, location, posting date or comment count."""
    row = LISTINGS[title]

    def read(script: Script) -> None:
        open_listing(script, title)

    count = LISTING_COMMENTS[row["id"]]
    cities = sorted({other["location"].split(",")[0] for other in LISTINGS.values()})
    facts = {  # goal, answer goal, key, value, text, reference
        "price": (
            f"find out the price of the listing '{title}'",
            f"the price of '{title}'",
            "price",
            listing_price(title),
            listing_price(title),
            amount_reference(listing_price(title)),
        ),
        "name": (
            f"find out who sells the listing '{title}'",
            f"the seller of '{title}'",
            "seller",
            row["seller"],
            row["seller"],
            one_of(row["seller"], SELLERS),
        ),
        "location": (
            f"find out where the listing '{title}' is located",
            f"the location of '{title}'",
            "location",
            row["location"],
            row["location"],
            one_of(row["location"].split(",")[0], cities),
        ),
        "date": (
            f"find out the date the listing '{title}' was posted",
            f"the date '{title}' was posted",
            "posted",
            listing_posted(title),
            listing_posted(title),
            date_reference(listing_posted(title)),
        ),
        "count": (
            f"find out how many comments the listing '{title}' has",
            f"the number of comments on '{title}'",
            "comments",
            str(count),
            f"Comments ({count})",
            {"must_include": [str(count)]},
        ),
    }
    goal, answer, key, value, text, reference = facts[kind]
    return Reading(
        kind,
        goal,
        answer,
        f"{title} {key}",
        value,
        text,
        reference,
        read,
        CLASSIFIEDS,
        "the classifieds site",
    )


def post_fact(title: str, kind: Kind) -> Reading:
    """A forum post's points, author or posting date."""
    post = POSTS[title]

    def read(script: Script) -> None:
        open_post(script, title)

    facts = {  # goal, answer goal, key, text (the value too), reference
        "count": (
            f"find out how many points the forum post '{title}' has",
            f"the points of '{title}'",
            "points",
            score(title),
            {"must_include": [str(post["score"])]},
        ),
        "name": (
            f"find out who wrote the forum post '{title}'",
            f"the username of the author of '{title}'",
            "author",
            post["author"],
            one_of(post["author"], USERNAMES),
        ),
        "date": (
            f"find out the date the forum post '{title}' was posted",
            f"the date '{title}' was posted",
            "posted",
            post_posted(title),
            date_reference(post_posted(title)),
        ),
    }
    goal, answer, key, text, reference = facts[kind]
    return Reading(
        kind, goal, answer, f"{title} {key}", text, text, reference, read, FORUM, "the forum"
    )


def karma_fact(title: str) -> Reading:
    """The karma of a forum post's author, read on the author's page (reached from the
    post)."""
    author = POSTS[title]["author"]

    def read(script: Script) -> None:
        open_post(script, title)
        script.act(f"click {element('link', author)}")

    return Reading(
        "count",
        f"find out the karma of the author of the forum post '{title}' (on their user page)",
        f"the karma of the author of '{title}'",
        f"{author} karma",
        str(KARMA[author]),
        f"Karma: {KARMA[author]}",
        {"must_include": [str(KARMA[author])]},
        read,
        FORUM,
        "the forum",
    )


def open_product(script: Script, title: str, note: str | None = None) -> None:
    """Search the shop for `title` and open its page (two actions); `note` goes with the
    first (the search leaves the page the note is about)."""
    script.act(search_action(title), note=note)
    script.act(f"click {product_link(title)}")


def product_fact(title: str, kind: Kind) -> Reading:
    """A shop product's price, number of reviews, or the author of its one review."""
    reviews = PRODUCTS[title]["reviews"]

    def read(script: Script) -> None:
        open_product(script, title)

    if kind == "price":
        goal = f"find out the price of the product '{title}'"
        answer, key, value = f"the price of '{title}'", "price", product_price(title)
        text, reference = value, {"must_include": [dollars(PRODUCTS[title]["price"])]}
    elif kind == "count":
        goal = f"find out how many reviews the product '{title}' has"
        answer, key, value = f"the number of reviews of '{title}'", "reviews", str(len(reviews))
        text, reference = f"Reviews ({len(reviews)})", {"must_include": [str(len(reviews))]}
    else:
        if len(reviews) != 1:
            raise ValueError(f"{title!r} has {len(reviews)} reviews, not one")
        reviewers = sorted({r["author"] for row in PRODUCTS.values() for r in row["reviews"]})
        goal = f"find out who wrote the one review of the product '{title}'"
        answer, key = f"the name of the reviewer of '{title}'", "reviewer"
        value = text = reviews[0]["author"]
        reference = one_of(value, reviewers)
    return Reading(
        kind, goal, answer, f"{title} {key}", value, text, reference, read, SHOP, "the shop"
    )


def order_fact(number: int, kind: Kind) -> Reading:
    """One of the account's past orders: its number (the order named by the date it was
    placed), the date it was placed, its total, or the city it was shipped to (on its own
    page; the rest on the order history)."""
    order = ORDERS[number]
    placed = site_date(order["placed"].isoformat())

    def read(script: Script) -> None:
        script.act(MY_ORDERS)
        if kind == "location":
            script.act(f"click [link 'Order #{number}']")

    cities = sorted({other["ship_city"] for other in ORDERS.values()})
    others = [str(other) for other in ORDERS if other != number]
    facts = {
        "id": (
            f"find out the number of your order placed on {placed}",
            f"the number of your order placed on {placed}",
            f"{placed} order number",
            str(number),
            f"Order #{number}",
            {"must_include": [str(number)], "must_exclude": others},
        ),
        "date": (
            f"find out the date your order #{number} was placed",
            f"the date your order #{number} was placed",
            f"Order {number} placed",
            placed,
            placed,
            date_reference(placed),
        ),
        "price": (
            f"find out the total of your order #{number}",
            f"the total of your order #{number}",
            f"Order {number} total",
            money_cents(order_total(number)),
            money_cents(order_total(number)),
            {"must_include": [dollars(order_total(number))]},
        ),
        "location": (
            f"find out the city your order #{number} was shipped to",
            f"the city your order #{number} was shipped to",
            f"Order {number} city",
            order["ship_city"],
            order["ship_city"],
            one_of(order["ship_city"], cities),
        ),
    }
    goal, answer, key, value, text, reference = facts[kind]
    return Reading(kind, goal, answer, key, value, text, reference, read, SHOP, "the shop")


@dataclass(frozen=True)
class Work:
    """What the agent does on each item of one site, around the reading.

    Attributes:
        site: where the work's site starts.
        site_name: how the goal names it, e.g. "the forum".
        goal: the goal's words for the work, e.g. "post the comment 'Thanks' on each of these
            forum posts".
        noun: what the items are, e.g. "posts".
        act: the actions on one item (`act(script, item, note)`; `note` goes with the first).
        checks: the `program_html` checks of the work on `items`.
        done: what the task's comment calls an item done, e.g. "comments on the forum".
    """

    site: Start
    site_name: str
    goal: str
    noun: str
    act: Callable[[Script, str, str | None], None]
    checks: Callable[[list[str]], list[dict[str, Any]]]
    done: str


def cart_work() -> Work:
    """Add one of each product to the shop's cart (three actions each)."""

    def add(script: Script, title: str, note: str | None) -> None:
        open_product(script, title, note)
        script.act(ADD_TO_CART)

    return Work(
        SHOP,
        "the shop",
        "add one of each of these products to your cart in the shop",
        "products",
        add,
        lambda items: [cart_check([items[0], items[-1]])],
        "products added to the cart",
    )


def purchase_work() -> Work:
    """Buy each product in an order of its own: add it to the cart, go to the checkout and
    place the order (five actions each; the first order also holds the initial cart). Each
    order's page shows its new number."""

    def buy(script: Script, title: str, note: str | None) -> None:
        open_product(script, title, note)
        script.act(ADD_TO_CART)
        script.act("click [link 'Proceed to checkout']")
        script.act("click [button 'Place order']")

    def checks(items: list[str]) -> list[dict[str, Any]]:
        last = NEW_ORDER + len(items) - 1
        return [
            {
                "url": f"__SHOPPING__/orders/{number}",
                "locator": "document.querySelector('#order-details').innerText",
                "required_contents": {"must_include": [title]},
            }
            for number, title in ((NEW_ORDER, items[0]), (last, items[-1]))
        ]

    return Work(
        SHOP,
        "the shop",
        "buy each of these products in the shop, each in an order of its own (add it to your "
        "cart, go to the checkout and place the order with the address it suggests)",
        "products",
        buy,
        checks,
        "orders placed",
    )


@dataclass(frozen=True)
class CommentSite:
    """What differs between commenting on forum posts and on classifieds listings: the site,
    how an item is opened and checked, and the goal's and comment's words (`Work`'s)."""

    site: Start
    opener: Callable[[Script, str, str | None], None]
    check: Callable[[str, dict[str, list[str]]], dict[str, Any]]
    site_name: str
    items: str
    noun: str
    done: str


FORUM_POSTS = CommentSite(
    FORUM, open_post, comments_check, "the forum", "forum posts", "posts", "comments on the forum"
)
CLASSIFIEDS_LISTINGS = CommentSite(
    CLASSIFIEDS,
    open_listing,
    listing_check,
    "the classifieds site",
    "classifieds listings",
    "listings",
    "comments on the classifieds",
)


def comment_work(where: CommentSite, text: str) -> Work:
    """Post the comment `text` on each item of `where` (`FORUM_POSTS` or
    `CLASSIFIEDS_LISTINGS`), three actions each."""

    def comment(script: Script, title: str, note: str | None) -> None:
        where.opener(script, title, note)
        script.act(comment_action(text))

    return Work(
        where.site,
        where.site_name,
        f"post the comment '{text}' on each of these {where.items}",
        where.noun,
        comment,
        lambda items: [where.check(t, {"must_include": [text]}) for t in (items[0], items[-1])],
        where.done,
    )


def listed(items: list[str]) -> str:
    """'A', 'B' and 'C' ('A' alone)."""
    quoted = [f"'{item}'" for item in items]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + f" and {quoted[-1]}"


def carry(
    task_id: int,
    reading: Reading,
    work: Work,
    items: tuple[list[str], list[str]],
    distractors: bool,
) -> dict[str, Any]:
    """Do the work on the items before the fact, read the fact (in the second tab, then close
    it, when its site is not the work's), do the work on the items after it, and answer with
    the fact (`answer_prefix`: the note's key)."""
    before, after = items
    two_sites = reading.site.sites != work.site.sites
    script = Script()
    for item in before:
        work.act(script, item, None)
    if two_sites:
        script.act("tab_focus [1]")
    reading.read(script)
    script.fact(reading.text, reading.kind)
    note: str | None = f"{reading.key}: {reading.value}"
    if two_sites:
        script.act("close_tab", note=note)
        note = None
    for item in after:
        work.act(script, item, note)
        note = None
    script.stop(f"{reading.key}: {reading.value}")
    read = reading.goal
    opening = ""
    if two_sites:
        opening = (
            f"{work.site_name[0].upper()}{work.site_name[1:]} is open in the first tab and "
            f"{reading.site_name} in the second. "
        )
        read = f"in the second tab, {reading.goal}, then close that tab"
    if before:
        these = f"these {work.noun}" if len(after) > 1 else f"this {work.noun[:-1]}"
        body = (
            f"First, {work.goal}: {listed(before)}. Then, {read}. Then do the same with "
            f"{these}: {listed(after)}."
        )
    else:
        body = f"First, {read}. Then, {work.goal}: {listed(after)}."
    start = tabs(work.site, reading.site, require_login=True) if two_sites else work.site
    task = long_task(
        task_id,
        start,
        f"{opening}{body} When done, answer with {reading.answer_goal}.",
        script,
        reading.reference,
        f"{reading.key}: {reading.value}; {len(before)} {work.done} before it, "
        f"{len(after)} after it.",
        program_html=work.checks(before + after),
    )
    return {**task, "answer_prefix": f"{reading.key}:", "distractors": distractors}


def split(items: list[str], before: int, after: int) -> tuple[list[str], list[str]]:
    """The first `before` of `items`, then the next `after`.

    Raises:
        ValueError: too few items.
    """
    if len(items) < before + after:
        raise ValueError(f"{before + after} items needed, {len(items)} given")
    return items[:before], items[before : before + after]


def other_sellers(title: str, category: str, count: int) -> list[str]:
    """`count` listings of `category` sold by someone other than `title`'s seller."""
    seller = LISTINGS[title]["seller"]
    return [t for t in pick_listings(category, 30) if LISTINGS[t]["seller"] != seller][:count]


def unreviewed_by(title: str, count: int, skip: int = 0) -> list[str]:
    """`count` products, after `skip`, with no review by `title`'s one reviewer."""
    name = PRODUCTS[title]["reviews"][0]["author"]
    products = [t for t in pick_products(count=100) if t != title][skip:]
    return [t for t in products if all(r["author"] != name for r in PRODUCTS[t]["reviews"])][:count]


def other_counts(title: str, skip: int) -> list[str]:
    """The products, after `skip`, whose number of reviews is not `title`'s."""
    count = len(PRODUCTS[title]["reviews"])
    products = [t for t in pick_products(count=100) if len(PRODUCTS[t]["reviews"]) != count]
    return products[skip:]


COMMENTS = (
    *FORUM_COMMENTS,
    "Can you hold it until Friday?",
    "Is the price negotiable?",
    "Could you send more photos?",
)
"""The comments the tasks post (forum posts: the first five; listings: the last three)."""


def without() -> list[dict[str, Any]]:
    """Tasks 561-585: no page after the fact shows a fact of its kind. Within each kind the
    fact is read 1 to 10 items before the answer, earlier as the ids rise."""
    listings = list(LISTINGS)
    products = pick_products(count=100)
    posts = {forum: pick_posts(forum, 12) for forum in ("bikes", "books", "cooking", "music")}
    cart = cart_work()
    forum = partial(comment_work, FORUM_POSTS)
    classifieds = partial(comment_work, CLASSIFIEDS_LISTINGS)
    return [
        # a price, carried to the forum (which shows no price)
        carry(561, listing_fact(listings[5], "price"), forum(COMMENTS[0]),
              split(posts["bikes"], 4, 1), False),
        carry(562, product_fact(products[10], "price"), forum(COMMENTS[1]),
              split(posts["books"], 3, 2), False),
        carry(563, listing_fact(listings[21], "price"), forum(COMMENTS[2]),
              split(posts["cooking"], 1, 4), False),
        carry(564, order_fact(1001, "price"), forum(COMMENTS[3]),
              split(posts["music"], 0, 5), False),
        carry(565, product_fact(products[33], "price"), forum(COMMENTS[4]),
              split(posts["bikes"], 0, 6), False),
        carry(566, listing_fact(listings[40], "price"), forum(COMMENTS[0]),
              split(posts["cooking"], 0, 8), False),
        # a location, carried to the cart or the forum (which name no city)
        carry(567, order_fact(1002, "location"), cart,
              split(products[20:], 3, 2), False),
        carry(568, listing_fact(listings[12], "location"), cart,
              split(products[30:], 3, 2), False),
        carry(569, listing_fact(listings[27], "location"), forum(COMMENTS[1]),
              split(posts["books"], 1, 4), False),
        carry(570, order_fact(1004, "location"), cart,
              split(products[40:], 1, 5), False),
        carry(571, listing_fact(listings[50], "location"), cart,
              split(products[50:], 0, 7), False),
        carry(572, listing_fact(listings[63], "location"), forum(COMMENTS[2]),
              split(posts["music"], 0, 8), False),
        # an order's number, carried to the cart, the forum or the classifieds (no order there)
        carry(573, order_fact(1002, "id"), cart,
              split(products[0:], 3, 2), False),
        carry(574, order_fact(1001, "id"), forum(COMMENTS[3]),
              split(posts["cooking"], 3, 2), False),
        carry(575, order_fact(1003, "id"), classifieds(COMMENTS[5]),
              split(pick_listings("bikes", 12), 3, 4), False),
        carry(576, order_fact(1004, "id"), cart,
              split(products[60:], 2, 4), False),
        carry(577, order_fact(1005, "id"), forum(COMMENTS[4]),
              split(posts["bikes"], 0, 6), False),
        carry(578, order_fact(1002, "id"), classifieds(COMMENTS[6]),
              split(pick_listings("furniture", 12), 0, 10), False),
        carry(579, order_fact(1008, "id"), cart,
              split(products[70:], 0, 9), False),
        # a date, carried to the cart with products without reviews (whose pages show none)
        carry(580, order_fact(1003, "date"), cart,
              split(NO_REVIEWS, 3, 2), False),
        carry(581, listing_fact(listings[8], "date"), cart,
              split(NO_REVIEWS[1:], 3, 2), False),
        carry(582, post_fact(posts["music"][3], "date"), cart,
              split(NO_REVIEWS[2:], 1, 4), False),
        carry(583, order_fact(1008, "date"), cart,
              split(NO_REVIEWS[3:], 1, 5), False),
        carry(584, listing_fact(listings[33], "date"), cart,
              split(NO_REVIEWS[4:], 0, 7), False),
        carry(585, post_fact(posts["books"][5], "date"), cart,
              split(NO_REVIEWS, 0, 9), False),
    ]  # fmt: skip


def with_distractors() -> list[dict[str, Any]]:
    """Tasks 586-600: pages after the fact show other facts of its kind."""
    products = pick_products(count=100)
    reviewed_once = [t for t in products if len(PRODUCTS[t]["reviews"]) == 1]
    many_reviews = [t for t in products if len(PRODUCTS[t]["reviews"]) >= 6]
    bikes = pick_listings("bikes", 30)
    commented = [t for t in bikes if LISTING_COMMENTS[LISTINGS[t]["id"]] >= 2]
    quiet = [t for t in pick_listings("electronics", 30) if not LISTING_COMMENTS[LISTINGS[t]["id"]]]
    science, travel = pick_posts("science", 12), pick_posts("travel", 12)
    gaming, movies = pick_posts("gaming", 12), pick_posts("movies", 12)
    cart = cart_work()
    forum = partial(comment_work, FORUM_POSTS)
    classifieds = partial(comment_work, CLASSIFIEDS_LISTINGS)
    return [
        # a name: sellers on the listings, users on the forum, reviewers and the account in the shop
        carry(586, listing_fact(bikes[0], "name"), classifieds(COMMENTS[5]),
              split(other_sellers(bikes[0], "furniture", 7), 4, 3), True),
        carry(587, post_fact(science[0], "name"), forum(COMMENTS[0]),
              split(science[1:], 2, 3), True),
        carry(588, product_fact(reviewed_once[0], "name"), cart,
              split(unreviewed_by(reviewed_once[0], 5), 0, 5), True),
        carry(589, post_fact(travel[0], "name"), cart,
              split(products[10:], 0, 7), True),
        # a count: comments on the listings, points on the forum, review counts in the shop
        carry(590, listing_fact(commented[0], "count"), classifieds(COMMENTS[6]),
              split(quiet, 4, 3), True),
        carry(591, post_fact(gaming[0], "count"), forum(COMMENTS[1]),
              split(gaming[1:], 1, 4), True),
        carry(592, product_fact(many_reviews[0], "count"), cart,
              split(other_counts(many_reviews[0], 20), 0, 6), True),
        carry(593, karma_fact(movies[0]), forum(COMMENTS[2]),
              split(movies[1:], 0, 8), True),
        # a price: other listings' and products' prices
        carry(594, listing_fact(bikes[5], "price"), classifieds(COMMENTS[7]),
              split(pick_listings("clothing", 8), 3, 4), True),
        carry(595, product_fact(products[44], "price"), cart,
              split(products[45:], 1, 5), True),
        carry(596, order_fact(1004, "price"), cart,
              split(products[80:], 0, 7), True),
        # a date: other listings' and posts' dates
        carry(597, listing_fact(bikes[9], "date"), classifieds(COMMENTS[5]),
              split(pick_listings("books", 8), 2, 5), True),
        carry(598, post_fact(movies[8], "date"), forum(COMMENTS[3]),
              split(travel[1:], 0, 6), True),
        # an id: the new orders' numbers
        carry(599, order_fact(1005, "id"), purchase_work(),
              split(products[55:], 3, 1), True),
        carry(600, order_fact(1003, "id"), purchase_work(),
              split(products[65:], 0, 4), True),
    ]  # fmt: skip


def tasks() -> list[dict[str, Any]]:
    """Tasks 561-600, with their splits."""
    return alternate_splits(without() + with_distractors())
