"""Long-horizon tasks 531-540 spanning two sites, open side by side in two tabs.

Each task pairs two of the three sites (classifieds and shopping, forum and shopping, forum
and classifieds; every pair at least three times) and switches between them with
`tab_focus`. Facts are read on many pages of one site and then compared with, or applied to,
the other: used listings against the cheapest new product of their kind in the shop, forum
threads about a kind of product against the shop's or the classifieds' items of that kind, the
cities of the shop orders against the listings' locations. Some tasks write in between (a
comment quoting a price read in the other tab, an "Add to cart", a comment naming the winner of
a comparison), and some carry a rule given once in the goal that decides every later action.
The write tasks start signed in (`require_login`). Answers are computed from the sites' seed-0
data.
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from envs.sites.common.web import money_cents
from envs.sites.forum.data import generate_comments, generate_posts
from envs.sites.shopping.data import (
    build_template_db,
    generate_orders,
    generate_products,
    generate_reviews,
)
from scripts.long_tasks.classifieds import LISTINGS, named, posted, price
from scripts.long_tasks.script import Script, element, long_task

CLASSIFIEDS, FORUM, SHOPPING = "__CLASSIFIEDS__/", "__FORUM__/", "__SHOPPING__/"

_ROWS = generate_products(0)
_REVIEWS = generate_reviews(len(_ROWS), 0)
PRODUCTS = {
    row["title"]: {
        **row,
        "id": i,
        "ratings": [review["rating"] for review in _REVIEWS if review["product_id"] == i],
    }
    for i, row in enumerate(_ROWS, 1)
}
"""The shop's products by title, with their id and their reviews' ratings."""
_POSTS = generate_posts(0)
_COUNTS = Counter(comment["post_id"] for comment in generate_comments(_POSTS, 0))
POSTS = {
    post["title"]: {**post, "id": i, "comments": _COUNTS[i]} for i, post in enumerate(_POSTS, 1)
}
"""The forum's posts by title (unique across forums), with their id and comment count."""
ORDERS = [order for order in generate_orders(_ROWS, 0) if order["user_id"] == 1]
"""The test account's past orders, oldest first."""


def _initial_cart() -> dict[str, int]:
    """The test account's cart as the shop starts it: title -> quantity (read from the
    template database `build_template_db` writes)."""
    titles = {row["id"]: title for title, row in PRODUCTS.items()}
    query = "SELECT product_id, quantity FROM cart_items WHERE user_id = 1"
    with tempfile.TemporaryDirectory() as folder:
        db = sqlite3.connect(build_template_db(Path(folder) / "shopping.db", 0))
        rows = db.execute(query).fetchall()
        db.close()
    return {titles[pid]: quantity for pid, quantity in rows}


CART = _initial_cart()
"""The test account's cart at the start of a task: title -> quantity."""


SHOP_KIND = {
    "e-readers": "e-reader",
    "cast iron pans": "cast iron skillet",
    "studio headphones": "headphones",
    "board games": "board game",
    "mechanical keyboards": "mechanical keyboard",
}
"""Forum topic -> the search that finds the shop's products of that kind."""
LISTING_KIND = {
    "e-bikes": "electric bike",
    "retro consoles": "game console",
    "studio headphones": "headphones",
    "mechanical keyboards": "mechanical keyboard",
    "poetry": "poetry collection",
}
"""Forum topic -> the search that finds the classifieds' listings of that kind."""
USED_KINDS = ["tablet", "bluetooth speaker", "smartwatch", "headphones", "mechanical keyboard"]
"""Kinds of electronics both the classifieds site and the shop have."""


def unique_best(values: dict[str, Any], best=max) -> str:
    """The key whose value is `best` (max or min), which no other key shares."""
    winner = best(values, key=values.get)
    assert sum(value == values[winner] for value in values.values()) == 1, values
    return winner


def _matches(query: str, *texts: str) -> bool:
    """Whether a site's search for `query` finds a row with these texts: every word of the
    query in one of them, ignoring case (`envs.sites.common.web.words_clause`)."""
    return all(any(word.lower() in text.lower() for text in texts) for word in query.split())


def shop_search(query: str) -> list[str]:
    """The titles a shop search for `query` finds, in the page's order (newest first)."""
    found = [t for t, row in PRODUCTS.items() if _matches(query, t, row["description"])]
    return sorted(found, key=lambda t: (PRODUCTS[t]["added"], PRODUCTS[t]["id"]), reverse=True)


def listing_search(query: str) -> list[str]:
    """The titles a classifieds search for `query` finds, in the page's order (newest first)."""
    found = [t for t, row in LISTINGS.items() if _matches(query, t, row["description"])]
    return sorted(found, key=lambda t: (LISTINGS[t]["posted"], LISTINGS[t]["id"]), reverse=True)


def cheapest_new(kind: str) -> str:
    """The title of the cheapest product a shop search for `kind` finds (no ties)."""
    return unique_best({t: PRODUCTS[t]["price"] for t in shop_search(kind)}, best=min)


def new_price(kind: str) -> str:
    """The price of the cheapest new product of `kind` in the shop, e.g. `$323.99`."""
    return shop_price(cheapest_new(kind))


def shop_price(title: str) -> str:
    """The product's price as the shop shows it, e.g. `$18.95`."""
    return money_cents(PRODUCTS[title]["price"])


def rating(title: str) -> float:
    """The product's rating: the mean of its reviews to one decimal (as `build_template_db`
    computes it); every product these tasks rate has reviews."""
    ratings = PRODUCTS[title]["ratings"]
    return round(sum(ratings) / len(ratings) + 1e-9, 1)


def stars(title: str) -> str:
    """The rating as the product page shows it, e.g. `4.2 out of 5 stars`."""
    return f"{rating(title):.1f} out of 5 stars"


def points(title: str) -> str:
    """The post's score as its page shows it: `1 point`, `32 points`."""
    value = POSTS[title]["score"]
    return f"{value} point" if abs(value) == 1 else f"{value} points"


def comment_count(title: str) -> str:
    """The post's comment count as its page's heading shows it, e.g. `Comments (6)`."""
    return f"Comments ({POSTS[title]['comments']})"


def post_url(title: str) -> str:
    """The post's page, with the site placeholder."""
    return f"__FORUM__/f/{POSTS[title]['forum']}/{POSTS[title]['id']}"


def topic(title: str, kinds: dict[str, str]) -> str:
    """The topic of `kinds` that the post `title` is about."""
    (found,) = [name for name in kinds if name in title]
    return found


def shop_kind(post: str) -> str:
    """The shop's kind of product the forum post `post` is about, e.g. `e-reader`."""
    return SHOP_KIND[topic(post, SHOP_KIND)]


def city_of(title: str) -> str:
    """The city of a listing's location, e.g. `Erie` for `Erie, PA`."""
    return LISTINGS[title]["location"].split(",")[0]


def used_kind(title: str) -> str:
    """The kind of a used electronics listing: its title without the colour."""
    return title.split(" ", 1)[1]


def search(query: str, note: str | None = None) -> tuple[str, str | None]:
    """`Script.act` arguments typing `query` into the current site's search box."""
    return f"type [textbox 'Search'] [{query}] [1]", note


def open_product(script: Script, title: str, note: str | None = None) -> None:
    """Search the shop for `title` and open its page (two actions); `note` goes with the
    first."""
    script.act(*search(title, note))
    script.act(f"click {element('link', f'{title} - {shop_price(title)}')}")


def find_listing(script: Script, title: str, note: str | None = None) -> None:
    """Search the classifieds for `title` and open the listing (two actions); `note` goes
    with the first."""
    script.act(*search(title, note))
    script.act(f"click {element('link', f'{title} - {price(title)}')}")


def open_post(script: Script, title: str, note: str | None = None) -> None:
    """Search the forum for `title` and open the post (two actions); `note` goes with the
    first."""
    script.act(*search(title, note))
    script.act(f"click {element('link', title)}")


def tabs(first: str, second: str) -> str:
    """A two-tab start URL: `first` active, `second` in tab 1."""
    return f"{first} |AND| {second}"


def cheaper_used(task_id: int, titles: list[str]) -> dict[str, Any]:
    """Shop first: the cheapest new product of each kind of USED_KINDS (one search each);
    then every listing of `titles` on the classifieds site; the answer counts the listings
    cheaper than the cheapest new product of their kind, read many pages earlier."""
    script, noted = Script(), None
    for kind in USED_KINDS:
        script.act(*search(kind, noted))
        noted = f"new {kind} from {script.fact(new_price(kind))}"
    script.act("tab_focus [1]", note=noted)
    noted = None
    for title in titles:
        find_listing(script, title, noted)
        noted = f"{title}: {script.fact(price(title))}"
    script.act("go_back", note=noted)
    cheaper = [
        t
        for t in titles
        if LISTINGS[t]["price"] * 100 < PRODUCTS[cheapest_new(used_kind(t))]["price"]
    ]
    script.stop(str(len(cheaper)))
    intent = (
        "The shop is open in the first tab and the classifieds site in the second. First, in "
        f"the shop, find the price of the cheapest new product of each of these kinds: "
        f"{', '.join(USED_KINDS[:-1])} and {USED_KINDS[-1]}. Then, on the classifieds site, "
        f"look up each of these used listings and note its price: {named(titles)}. Answer "
        "with how many of the listings cost less than the cheapest new product of their kind."
    )
    return long_task(
        task_id,
        ["shopping", "classifieds"],
        tabs(SHOPPING, CLASSIFIEDS),
        intent,
        script,
        {"must_include": [str(len(cheaper))]},
        "Cheapest new: "
        + ", ".join(f"{kind} {new_price(kind)}" for kind in USED_KINDS)
        + f". Used listings cheaper than new: {', '.join(cheaper)}.",
    )


def quote_new_price(task_id: int, titles: list[str]) -> dict[str, Any]:
    """For each listing of `titles`: its price on the classifieds site, the cheapest new
    product of its kind in the shop, and a comment on the listing quoting that new price (a
    fact carried from one tab to a write in the other); the answer is the listing that
    saves the most against new, from prices read many pages earlier."""
    script = Script()
    for title in titles:
        find_listing(script, title)
        shown = script.fact(price(title))
        kind = used_kind(title)
        script.act("tab_focus [1]", note=f"{title}: {shown}")
        script.act(*search(kind))
        new = script.fact(new_price(kind))
        script.act("tab_focus [0]", note=f"new {kind} from {new}")
        script.use(new)
        script.act(f"type [textbox 'Comment'] [{quote(new)}] [1]")
    saving = {
        t: PRODUCTS[cheapest_new(used_kind(t))]["price"] - LISTINGS[t]["price"] * 100
        for t in titles
    }
    best = unique_best(saving)
    script.stop(best)
    intent = (
        "The classifieds site is open in the first tab and the shop in the second. For each of "
        f"these used listings: {named(titles)}, find the cheapest new product of the same kind "
        "in the shop and post the comment 'New in the shop from $X.' on the listing, with X that "
        "product's price. Then answer with the title of the listing that saves the most money "
        "compared with buying its kind new."
    )
    checks = [
        {
            "url": f"__CLASSIFIEDS__/listing/{LISTINGS[title]['id']}",
            "locator": "",
            "required_contents": {"must_include": [quote(new_price(used_kind(title)))]},
        }
        for title in (titles[0], titles[-1])
    ]
    return long_task(
        task_id,
        ["classifieds", "shopping"],
        tabs(CLASSIFIEDS, SHOPPING),
        intent,
        script,
        {"must_include": [best], "must_exclude": [t for t in titles if t != best]},
        "Saving against the cheapest new one: "
        + ", ".join(f"{t} {money_cents(cents)}" for t, cents in saving.items() if cents > 0)
        + "; the others cost more than new.",
        program_html=checks,
    )


def quote(new: str) -> str:
    """The comment of `quote_new_price` for the new price `new`."""
    return f"New in the shop from {new}."


def order_city_listing(task_id: int, titles: list[str]) -> dict[str, Any]:
    """Shop first (signed in): the city each past order was shipped to, on each order's
    page; then every listing of `titles`; the answer is the most expensive listing located in
    the city most orders went to."""
    script, noted = Script(), None
    newest_first = sorted(ORDERS, key=lambda order: (order["placed"], order["id"]), reverse=True)
    for order in newest_first:
        number = f"Order #{order['id']}"
        script.act(f"click {element('link', number)}", note=noted)
        noted = f"{number}: {script.fact(order['ship_city'])}"
        if order is not newest_first[-1]:
            script.act(f"click {element('link', 'Back to my orders')}", note=noted)
            noted = None
    script.act("tab_focus [1]", note=noted)
    cities = Counter(order["ship_city"] for order in ORDERS)
    city = unique_best(dict(cities))
    noted = None
    for title in titles:
        find_listing(script, title, noted)
        noted = f"{title}: {script.fact(LISTINGS[title]['location'])}"
        if city_of(title) == city:
            noted += f", {script.fact(price(title))}"
    script.act("go_back", note=noted)
    local = {t: LISTINGS[t]["price"] for t in titles if city_of(t) == city}
    best = unique_best(local)
    script.stop(best)
    intent = (
        "Your shop account is open in the first tab and the classifieds site in the second. "
        "Open each of your past orders in the shop and note the city it was shipped to. Then, "
        f"on the classifieds site, look up each of these listings: {named(titles)}. Among the "
        "listings located in the city most of your orders were shipped to, which is the most "
        "expensive? Answer with its title."
    )
    return long_task(
        task_id,
        ["shopping", "classifieds"],
        tabs(f"{SHOPPING}orders", CLASSIFIEDS),
        intent,
        script,
        {"must_include": [best], "must_exclude": [t for t in titles if t != best]},
        f"Orders shipped to: {dict(cities)}. Listings in {city}: "
        + ", ".join(f"{t} {price(t)}" for t in local)
        + ".",
        require_login=True,
    )


def cart_rule(task_id: int, titles: list[str], limit: int) -> dict[str, Any]:
    """A rule given once decides every later action: for each listing of `titles` that costs
    more than `limit` dollars, add the cheapest new product of its kind to the shop's cart;
    the answer is the cart's total after the last one (shown on the cart page then)."""
    script, noted, added = Script(), None, []
    buys = [t for t in titles if LISTINGS[t]["price"] > limit]
    for title in titles:
        find_listing(script, title, noted)
        shown = script.fact(price(title))
        script.use(shown)
        if title not in buys:
            noted = f"{title}: {shown}, not over ${limit}, skip"
            continue
        kind, product = used_kind(title), cheapest_new(used_kind(title))
        script.act("tab_focus [1]", note=f"{title}: {shown}, over ${limit}, buy new")
        script.act(*search(kind))
        script.act(f"click {element('link', f'{product} - {shop_price(product)}')}")
        script.act(f"click {element('button', 'Add to cart')}")
        added.append(product)
        noted = f"added {product}"
        if title == buys[-1]:
            cents = sum(PRODUCTS[t]["price"] * n for t, n in CART.items())
            cents += sum(PRODUCTS[t]["price"] for t in added)
            total = script.fact(money_cents(cents))
            noted += f", cart total {total}"
        script.act("tab_focus [0]", note=noted)
        noted = None
    script.act("go_back", note=noted)
    script.stop(total)
    intent = (
        "The classifieds site is open in the first tab and the shop in the second. Look up each "
        f"of these used listings in turn: {named(titles)}. Whenever a listing costs more than "
        f"${limit}, add the cheapest new product of the same kind in the shop to your cart "
        "instead (one of it); leave the cart alone for the others. Answer with the cart's total "
        "after the last product you added."
    )
    skipped = sorted({cheapest_new(used_kind(t)) for t in titles} - set(added))
    checks = [
        {
            "url": "__SHOPPING__/cart",
            "locator": "document.querySelector('#cart-items').innerText",
            "required_contents": {"must_include": added, "must_exclude": skipped},
        }
    ]
    number = total.lstrip("$")
    return long_task(
        task_id,
        ["classifieds", "shopping"],
        tabs(CLASSIFIEDS, SHOPPING),
        intent,
        script,
        {"must_include": [f"{number} |OR| {number.replace(',', '')}"]},
        f"Over ${limit}: {', '.join(buys)}; added {', '.join(added)} to the cart "
        f"({', '.join(f'{n} {t}' for t, n in CART.items())} at the start): total {total}.",
        program_html=checks,
        require_login=True,
    )


def most_comments_best_rated(task_id: int, posts: list[str]) -> dict[str, Any]:
    """Forum first: the comment count of each post of `posts`; then, in the shop, every
    product of the kind the most-commented post is about; the answer is the best-rated."""
    script, noted = Script(), None
    for title in posts:
        open_post(script, title, noted)
        noted = f"{title}: {script.fact(comment_count(title))}"
    script.act("tab_focus [1]", note=noted)
    top = unique_best({t: POSTS[t]["comments"] for t in posts})
    kind = shop_kind(top)
    script.act(*search(kind))
    products = shop_search(kind)
    for product in products:
        script.act(f"click {element('link', f'{product} - {shop_price(product)}')}")
        script.act("go_back", note=f"{product}: {script.fact(stars(product))}")
    best = unique_best({p: rating(p) for p in products})
    script.stop(best)
    topics = ", ".join(SHOP_KIND)
    intent = (
        "The forum is open in the first tab and the shop in the second. Open each of these "
        f"forum posts and note how many comments it has: {named(posts)}. Each is about one of "
        f"these kinds of products: {topics}. Find the post with the most comments, then, in "
        "the shop, look at every product of its kind and answer with the title of the "
        "best-rated one."
    )
    return long_task(
        task_id,
        ["forum", "shopping"],
        tabs(FORUM, SHOPPING),
        intent,
        script,
        {"must_include": [best], "must_exclude": [p for p in products if p != best]},
        f"Most comments: {top} ({POSTS[top]['comments']}); shop {kind}: "
        + ", ".join(f"{p} {stars(p)}" for p in products)
        + ".",
    )


def best_rated_pick(task_id: int, products: list[str], post: str) -> dict[str, Any]:
    """Shop first: the rating of each product of `products`; then a forum comment naming the
    best-rated one on `post`, which is also the answer."""
    script, noted = Script(), None
    for product in products:
        open_product(script, product, noted)
        noted = f"{product}: {script.fact(stars(product))}"
    script.act("tab_focus [1]", note=noted)
    best = unique_best({p: rating(p) for p in products})
    open_post(script, post)
    for fact in script.facts:
        script.use(fact["text"])
    text = f"Best rated in the shop: {best}"
    script.act(f"type [textbox 'Comment'] [{text}] [1]")
    script.stop(best)
    intent = (
        "The shop is open in the first tab and the forum in the second. Look up each of these "
        f"products in the shop and note its rating: {named(products)}. Then, on the forum, post "
        f"the comment 'Best rated in the shop: X' on the post '{post}', with X the title of the "
        "best-rated of those products. Answer with that title."
    )
    checks = [
        {
            "url": post_url(post),
            "locator": "document.querySelector('ul.comments').innerText",
            "required_contents": {"must_include": [text]},
        }
    ]
    return long_task(
        task_id,
        ["shopping", "forum"],
        tabs(SHOPPING, FORUM),
        intent,
        script,
        {"must_include": [best], "must_exclude": [p for p in products if p != best]},
        f"Ratings: {', '.join(f'{p} {rating(p)}' for p in products)}.",
        program_html=checks,
        require_login=True,
    )


def quote_on_posts(task_id: int, posts: list[str]) -> dict[str, Any]:
    """For each forum post of `posts`: its points, the cheapest shop product of the kind it
    is about, and a comment on the post quoting that price; the answer is the post with the
    most points, read many pages earlier."""
    script = Script()
    for title in posts:
        open_post(script, title)
        shown = script.fact(points(title))
        kind = shop_kind(title)
        script.act("tab_focus [1]", note=f"{title}: {shown}")
        script.act(*search(kind))
        new = script.fact(new_price(kind))
        script.act("tab_focus [0]", note=f"new {kind} from {new}")
        script.use(new)
        script.act(f"type [textbox 'Comment'] [{shop_quote(new)}] [1]")
    best = unique_best({t: POSTS[t]["score"] for t in posts})
    script.stop(best)
    intent = (
        "The forum is open in the first tab and the shop in the second. Each of these forum "
        f"posts is about a kind of product the shop sells: {named(posts)}. For each post, note "
        "its points, find the cheapest product of its kind in the shop and post the comment "
        "'The shop sells one from $X.' on the post, with X that product's price. Then answer "
        "with the title of the post that has the most points."
    )
    checks = [
        {
            "url": post_url(title),
            "locator": "document.querySelector('ul.comments').innerText",
            "required_contents": {"must_include": [shop_quote(new_price(shop_kind(title)))]},
        }
        for title in (posts[0], posts[-1])
    ]
    return long_task(
        task_id,
        ["forum", "shopping"],
        tabs(FORUM, SHOPPING),
        intent,
        script,
        {"must_include": [best], "must_exclude": [t for t in posts if t != best]},
        f"Points: {', '.join(f'{t} {points(t)}' for t in posts)}.",
        program_html=checks,
        require_login=True,
    )


def shop_quote(new: str) -> str:
    """The comment of `quote_on_posts` for the price `new`."""
    return f"The shop sells one from {new}."


def top_post_cheapest_seller(task_id: int, posts: list[str]) -> dict[str, Any]:
    """Forum first: the points of each post of `posts`; then, on the classifieds site, every
    listing of the kind the top post is about; the answer is the seller of the cheapest."""
    script, noted = Script(), None
    for title in posts:
        open_post(script, title, noted)
        noted = f"{title}: {script.fact(points(title))}"
    script.act("tab_focus [1]", note=noted)
    top = unique_best({t: POSTS[t]["score"] for t in posts})
    kind = LISTING_KIND[topic(top, LISTING_KIND)]
    script.act(*search(kind))
    found = listing_search(kind)
    cheapest = unique_best({t: LISTINGS[t]["price"] for t in found}, best=min)
    for title in found:
        script.act(f"click {element('link', f'{title} - {price(title)}')}")
        noted = f"{title}: {script.fact(price(title))}"
        if title == cheapest:
            noted += f", seller {script.fact(LISTINGS[title]['seller'])}"
        script.act("go_back", note=noted)
    seller = LISTINGS[cheapest]["seller"]
    script.stop(seller)
    intent = (
        "The forum is open in the first tab and the classifieds site in the second. Open each "
        f"of these forum posts and note its points: {named(posts)}. Find the post with the most "
        "points; it is about one of these kinds of items: "
        + ", ".join(f"{name} ({kind})" for name, kind in LISTING_KIND.items())
        + ". On the classifieds site, look at every listing of that kind and answer with the "
        "name of the seller of the cheapest one."
    )
    others = sorted({LISTINGS[t]["seller"] for t in found} - {seller})
    return long_task(
        task_id,
        ["forum", "classifieds"],
        tabs(FORUM, CLASSIFIEDS),
        intent,
        script,
        {"must_include": [seller], "must_exclude": others},
        f"Top post: {top} ({points(top)}); {kind} listings: "
        + ", ".join(f"{t} {price(t)} by {LISTINGS[t]['seller']}" for t in found)
        + ".",
    )


def oldest_listing_comment(task_id: int, titles: list[str], post: str) -> dict[str, Any]:
    """Classifieds first: the date each listing of `titles` was posted; then a forum comment
    on `post` naming the one posted first and its date, which is also the answer."""
    script, noted = Script(), None
    for title in titles:
        find_listing(script, title, noted)
        noted = f"{title}: posted {script.fact(posted(title))}"
    script.act("tab_focus [1]", note=noted)
    first = unique_best({t: LISTINGS[t]["posted"] for t in titles}, best=min)
    open_post(script, post)
    for fact in script.facts:
        script.use(fact["text"])
    text = f"Listed the longest: {first}, posted {posted(first)}."
    script.act(f"type [textbox 'Comment'] [{text}] [1]")
    script.stop(first)
    intent = (
        "The classifieds site is open in the first tab and the forum in the second. Open each "
        f"of these listings and note the date it was posted: {named(titles)}. Then, on the "
        f"forum, post the comment 'Listed the longest: X, posted D.' on the post '{post}', "
        "with X the title of the listing posted first and D its date as the listing shows it. "
        "Answer with that title."
    )
    checks = [
        {
            "url": post_url(post),
            "locator": "document.querySelector('ul.comments').innerText",
            "required_contents": {"must_include": [text]},
        }
    ]
    return long_task(
        task_id,
        ["classifieds", "forum"],
        tabs(CLASSIFIEDS, FORUM),
        intent,
        script,
        {"must_include": [first], "must_exclude": [t for t in titles if t != first]},
        f"Posted: {', '.join(f'{t} {posted(t)}' for t in titles)}.",
        program_html=checks,
        require_login=True,
    )


def paired_rule(
    task_id: int, pairs: list[tuple[str, str]], above: int, text: str
) -> dict[str, Any]:
    """A rule given once decides every later action: each forum post of `pairs` has a paired
    listing, which gets the comment `text` only when the post has more than `above` points;
    the answer is how many comments were posted."""
    script, noted, chosen = Script(), None, []
    for post, listing in pairs:
        open_post(script, post, noted)
        shown = script.fact(points(post))
        script.use(shown)
        if POSTS[post]["score"] <= above:
            noted = f"{post}: {shown}, skip"
            continue
        chosen.append(listing)
        script.act("tab_focus [1]", note=f"{post}: {shown}, comment on {listing}")
        find_listing(script, listing)
        script.act(f"type [textbox 'Comment'] [{text}] [1]")
        script.act("tab_focus [0]")
        noted = None
    script.stop(str(len(chosen)))
    intent = (
        "The forum is open in the first tab and the classifieds site in the second. Visit each "
        "of these forum posts in turn; each is paired with a classifieds listing: "
        + ", ".join(f"'{post}' with '{listing}'" for post, listing in pairs)
        + f". Only when a post has more than {above} points, post the comment '{text}' on its "
        "paired listing; leave the other listings alone. Answer with how many comments you "
        "posted."
    )
    skipped = [listing for _, listing in pairs if listing not in chosen]
    checks = [
        {
            "url": f"__CLASSIFIEDS__/listing/{LISTINGS[listing]['id']}",
            "locator": "",
            "required_contents": {"must_include": [text]}
            if listing in chosen
            else {"must_exclude": [text]},
        }
        for listing in (chosen[-1], skipped[-1])
    ]
    return long_task(
        task_id,
        ["forum", "classifieds"],
        tabs(FORUM, CLASSIFIEDS),
        intent,
        script,
        {"must_include": [str(len(chosen))]},
        f"Posts over {above} points: "
        + ", ".join(f"{post} ({points(post)})" for post, _ in pairs if POSTS[post]["score"] > above)
        + f"; commented on {', '.join(chosen)}.",
        program_html=checks,
    )


def tasks() -> list[dict[str, Any]]:
    """Tasks 531-540."""
    electronics = [t for t, row in LISTINGS.items() if row["category"] == "electronics"]
    used = [t for t in electronics if used_kind(t) in USED_KINDS]
    furniture = [t for t, row in LISTINGS.items() if row["category"] == "furniture"]
    bikes = [t for t, row in LISTINGS.items() if row["category"] == "bikes"]
    rated = [
        t for t, row in PRODUCTS.items() if row["category"] == "electronics" and row["ratings"]
    ]
    return [
        cheaper_used(531, used),
        quote_new_price(
            532,
            [
                "Brown tablet",
                "Grey bluetooth speaker",
                "Purple headphones",
                "Yellow mechanical keyboard",
                "Red tablet",
            ],
        ),
        order_city_listing(533, furniture[12:21]),
        cart_rule(
            534,
            [
                "Grey bluetooth speaker",
                "Purple headphones",
                "Brown tablet",
                "Grey headphones",
                "Yellow mechanical keyboard",
                "Green bluetooth speaker",
                "Red headphones",
            ],
            100,
        ),
        most_comments_best_rated(
            535,
            [
                "My experience with e-readers",
                "Unpopular opinion on cast iron pans",
                "What do you think about board games?",
                "My experience with cast iron pans",
                "Beginner questions about mechanical keyboards",
                "What do you think about e-readers?",
                "Is it worth getting into board games?",
                "Beginner questions about studio headphones",
                "My experience with board games",
            ],
        ),
        best_rated_pick(536, rated[:11], "Weekly thread: game controllers"),
        quote_on_posts(
            537,
            [
                "Beginner questions about studio headphones",
                "My experience with board games",
                "What do you think about e-readers?",
                "Unpopular opinion on cast iron pans",
            ],
        ),
        top_post_cheapest_seller(
            538,
            [
                "Beginner questions about e-bikes",
                "Is it worth getting into poetry?",
                "What do you think about retro consoles?",
                "Looking for advice on studio headphones",
                "Unpopular opinion on e-bikes",
                "Beginner questions about mechanical keyboards",
                "Is it worth getting into retro consoles?",
                "Unpopular opinion on retro consoles",
            ],
        ),
        oldest_listing_comment(539, bikes[2:16], "Beginner questions about bike commuting"),
        paired_rule(
            540,
            [
                ("Unpopular opinion on e-bikes", "Orange electric bike"),
                ("What do you think about retro consoles?", "Green game console"),
                ("Beginner questions about e-bikes", "Blue electric bike"),
                ("Unpopular opinion on retro consoles", "Grey game console"),
                ("Beginner questions about studio headphones", "Grey headphones"),
            ],
            20,
            "Saw this on the forum. Still for sale?",
        ),
    ]
