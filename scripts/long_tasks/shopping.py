"""Long-horizon tasks 521-530 on the shopping site.

Most tasks name products the agent looks up one by one (search by title, open the product),
so prices, ratings and reviews are read on many pages and compared, summed or counted at the
end. The tasks behind the login (`require_login`; the trajectory signs in with the test
account's form first) write to the cart: some read a fact before a run of "Add to cart"
actions and answer with it after them, some carry a rule given once in the goal that decides
every later action (which products to add, how many of each), and two walk the account's order
history. Answers are computed from the site's seed-0 data.
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from envs.sites.common.web import money_cents, site_date
from envs.sites.shopping.data import (
    build_template_db,
    generate_orders,
    generate_products,
    generate_reviews,
)
from scripts.long_tasks.script import (
    Script,
    Start,
    element,
    long_task,
    named,
    one_of,
    search_action,
    sign_in,
    unique_best,
)

HOME = Start(["shopping"], "__SHOPPING__/")
"""Where the shop's reading tasks start: the home page."""
SIGNED_IN = Start(["shopping"], "__SHOPPING__/login?next=/", require_login=True)
"""Where the cart's tasks start: the login page, to sign in and go on to the home page."""
ORDER_HISTORY = Start(["shopping"], "__SHOPPING__/login?next=/orders", require_login=True)
"""Where the order history's tasks start: the login page, to sign in and go on to the
orders."""
ADD_TO_CART = f"click {element('button', 'Add to cart')}"
"""The action adding the product whose page is open to the cart."""
_ROWS = generate_products(0)
_REVIEWS = generate_reviews(len(_ROWS), 0)
PRODUCTS = {
    row["title"]: {
        **row,
        "id": i,
        "reviews": sorted(
            (r for r in _REVIEWS if r["product_id"] == i), key=lambda r: r["posted"], reverse=True
        ),
    }
    for i, row in enumerate(_ROWS, 1)
}
"""The shop's products by title, with their id and their reviews (newest first)."""
TITLES = {row["id"]: title for title, row in PRODUCTS.items()}
ORDERS = {order["id"]: order for order in generate_orders(_ROWS, 0) if order["user_id"] == 1}
"""The test account's past orders by number, oldest first (items: [(product id, quantity)])."""


def _initial_cart() -> dict[str, int]:
    """The test account's cart as the site starts it: title -> quantity (read from the
    template database that `build_template_db` writes)."""
    with tempfile.TemporaryDirectory() as folder:
        db = sqlite3.connect(build_template_db(Path(folder) / "shopping.db", 0))
        query = "SELECT product_id, quantity FROM cart_items WHERE user_id = 1"
        rows = db.execute(query).fetchall()
        db.close()
    return {TITLES[pid]: quantity for pid, quantity in rows}


CART = _initial_cart()
"""The test account's cart at the start of a task: title -> quantity."""


def price(title: str) -> str:
    """The price as the product page shows it, e.g. `$18.95`."""
    return money_cents(PRODUCTS[title]["price"])


def rating(title: str) -> float | None:
    """The product's rating: the mean of its reviews to one decimal, None without reviews
    (as `build_template_db` computes it)."""
    ratings = [review["rating"] for review in PRODUCTS[title]["reviews"]]
    return round(sum(ratings) / len(ratings) + 1e-9, 1) if ratings else None


def stars(title: str) -> str:
    """The rating as the product page shows it, e.g. `4.2 out of 5 stars`."""
    value = rating(title)
    return "No reviews yet" if value is None else f"{value:.1f} out of 5 stars"


def review_count(title: str) -> str:
    """The number of reviews as the product page shows it, e.g. `5 reviews`."""
    count = len(PRODUCTS[title]["reviews"])
    return "No reviews yet" if not count else f"{count} review{'s' if count > 1 else ''}"


def review_line(review: dict[str, Any]) -> str:
    """The start of a review as the product page shows it, e.g. `Dana rated it 5 out of 5 on
    Feb 28, 2024`."""
    posted = site_date(review["posted"].isoformat())
    return f"{review['author']} rated it {review['rating']} out of 5 on {posted}"


def order_total(number: int) -> int:
    """An order's total in cents."""
    return sum(PRODUCTS[TITLES[pid]]["price"] * qty for pid, qty in ORDERS[number]["items"])


def dollars(cents: int) -> str:
    """A `must_include` entry for an amount in cents: `1,234.56 |OR| 1234.56`."""
    shown = money_cents(cents)[1:]
    plain = shown.replace(",", "")
    return shown if shown == plain else f"{shown} |OR| {plain}"


def product_link(title: str) -> str:
    """The product's link in search results, e.g. `[link 'Trail bottle - $18.95']`."""
    return element("link", f"{title} - {price(title)}")


def open_product(script: Script, title: str, note: str | None = None) -> None:
    """Search for `title` and open its page (two actions); `note` goes with the second."""
    script.act(search_action(title))
    script.act(f"click {product_link(title)}", note=note)


def read_price(script: Script, title: str) -> str:
    """Read the price on the product's page; the note `title: $price`."""
    return f"{title}: {script.fact(price(title))}"


def read_stars(script: Script, title: str) -> str:
    """Read the rating on the product's page; the note `title: N out of 5 stars`."""
    return f"{title}: {script.fact(stars(title))}"


def pick(category: str | None = None, count: int = 10, skip: int = 0) -> list[str]:
    """`count` product titles in id order (of `category`, if given, else of every category
    but the initial cart's products), after skipping `skip`."""
    titles = [
        t for t, row in PRODUCTS.items() if category in (None, row["category"]) and t not in CART
    ]
    return titles[skip : skip + count]


def cart_check(include: list[str], exclude: list[str] | None = None) -> dict[str, Any]:
    """A `program_html` check of the cart's lines at the end of the episode."""
    contents: dict[str, list[str]] = {"must_include": include}
    if exclude:
        contents["must_exclude"] = exclude
    return {
        "url": "__SHOPPING__/cart",
        "locator": "document.querySelector('#cart-items').innerText",
        "required_contents": contents,
    }


def compare(task_id: int, titles: list[str], cheapest: bool) -> dict[str, Any]:
    """The cheapest (or most expensive) of `titles`, each looked up in turn; the answer is the
    title and the facts are every price."""
    script = Script()
    script.read_each(titles, open_product, read_price, "go_back")
    best = unique_best(titles, lambda t: PRODUCTS[t]["price"], highest=not cheapest)
    script.stop(f"{best}: {price(best)}")
    word = "cheapest" if cheapest else "most expensive"
    intent = (
        f"Look up each of these products and note its price: {named(titles)}. "
        f"Answer with the name of the {word} one."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(best, titles),
        f"Prices: {', '.join(f'{t} {price(t)}' for t in titles)}.",
    )


def most_reviews(task_id: int, titles: list[str]) -> dict[str, Any]:
    """Which of `titles` has the most reviews; the facts are every review count."""
    script = Script()
    script.read_each(
        titles,
        open_product,
        lambda script, title: f"{title}: {script.fact(review_count(title))}",
        "go_back",
    )
    best = unique_best(titles, lambda t: len(PRODUCTS[t]["reviews"]))
    script.stop(f"{best}: {review_count(best)}")
    intent = (
        f"Open the page of each of these products and read how many reviews it has: "
        f"{named(titles)}. Answer with the name of the product with the most reviews."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(best, titles),
        f"Reviews: {', '.join(f'{t} {review_count(t)}' for t in titles)}.",
    )


def total(task_id: int, titles: list[str]) -> dict[str, Any]:
    """The price of one each of `titles`."""
    script = Script()
    script.read_each(titles, open_product, read_price, "go_back")
    amount = sum(PRODUCTS[t]["price"] for t in titles)
    script.stop(money_cents(amount))
    intent = (
        f"I want to buy one of each of these products: {named(titles)}. Look up each one and "
        "answer with the total price of all of them together."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        {"must_include": [dollars(amount)]},
        f"Prices: {', '.join(f'{t} {price(t)}' for t in titles)}; total {money_cents(amount)}.",
    )


def count_rated(task_id: int, titles: list[str], at_least: float) -> dict[str, Any]:
    """How many of `titles` are rated at least `at_least` stars (no reviews: not rated)."""
    script = Script()
    script.read_each(titles, open_product, read_stars, "go_back")
    hits = [t for t in titles if (rating(t) or 0) >= at_least]
    script.stop(str(len(hits)))
    intent = (
        f"Open each of these products and read its rating: {named(titles)}. Answer with how "
        f"many of them are rated at least {at_least:.1f} out of 5 stars."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        {"must_include": [str(len(hits))]},
        f"Rated at least {at_least:.1f}: {', '.join(hits) or 'none'}.",
    )


def reviews_by(task_id: int, titles: list[str], author: str) -> dict[str, Any]:
    """How many reviews `author` wrote across `titles`: every review line of theirs is a fact."""
    theirs = {t: [r for r in PRODUCTS[t]["reviews"] if r["author"] == author] for t in titles}

    def read(script: Script, title: str) -> str:
        for review in theirs[title]:
            script.fact(review_line(review))
        so_far = sum(len(theirs[t]) for t in titles[: titles.index(title) + 1])
        return f"{title}: {len(theirs[title])} by {author}, {so_far} so far"

    script = Script()
    script.read_each(titles, open_product, read, "go_back")
    count = sum(len(reviews) for reviews in theirs.values())
    script.stop(str(count))
    intent = (
        f"Read the reviews of each of these products: {named(titles)}. Answer with how many "
        f"reviews the reviewer {author} wrote on them in all."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        {"must_include": [str(count)]},
        f"Reviews by {author}: {', '.join(f'{t} {len(theirs[t])}' for t in titles)}.",
    )


def fact_then_cart(task_id: int, first: str, titles: list[str]) -> dict[str, Any]:
    """Read `first`'s price, add one of each of `titles` to the cart, then answer with that
    price: a fact read at the start and needed after many write actions."""
    script = Script()
    sign_in(script)
    open_product(script, first)
    shown = script.fact(price(first))
    noted = f"{first}: {shown}"
    for title in titles:
        open_product(script, title, note=noted)
        noted = None
        script.act(ADD_TO_CART)
    script.stop(f"{first}: {shown}")
    intent = (
        f"First find out the price of '{first}'. Then add one of each of these products to "
        f"your cart: {named(titles)}. When done, answer with the price of '{first}'."
    )
    others = sorted({price(t)[1:] for t in titles} - {shown[1:]})
    return long_task(
        task_id,
        SIGNED_IN,
        intent,
        script,
        {"must_include": [dollars(PRODUCTS[first]["price"])], "must_exclude": others},
        f"{first} costs {shown}; {len(titles)} products go into the cart.",
        program_html=[cart_check([titles[0], titles[-1]], [first])],
    )


def rule_cart(task_id: int, titles: list[str], at_least: float) -> dict[str, Any]:
    """A rule given once decides every later action: add to the cart only the products of
    `titles` rated at least `at_least` stars; answer with how many were added."""
    chosen = [t for t in titles if (rating(t) or 0) >= at_least]

    def add(script: Script, title: str, shown: str) -> None:
        added = chosen.index(title) + 1
        script.act(ADD_TO_CART, note=f"{title}: {shown}, add it, {added} added so far")

    script = Script()
    sign_in(script)
    script.follow_rule(titles, open_product, stars, chosen, add)
    script.stop(str(len(chosen)))
    intent = (
        f"Visit each of these products in turn: {named(titles)}. Add to your cart only those "
        f"rated at least {at_least:.1f} out of 5 stars; leave the others alone. Answer with how "
        "many products you added to the cart."
    )
    skipped = [t for t in titles if t not in chosen]
    return long_task(
        task_id,
        SIGNED_IN,
        intent,
        script,
        {"must_include": [str(len(chosen))]},
        f"Rated at least {at_least:.1f}: {', '.join(chosen)}.",
        program_html=[cart_check([chosen[0], chosen[-1]], [skipped[0], skipped[-1]])],
    )


def quantity_rule(task_id: int, titles: list[str], under: int) -> dict[str, Any]:
    """A rule given once sets every quantity: two of each product of `titles` cheaper than
    `under` cents, one of each other; answer with the total the checkout page shows (the
    initial cart included; the cart page itself runs past the truncation with this many
    lines)."""
    quantities = {t: 2 if PRODUCTS[t]["price"] < under else 1 for t in titles}

    def add(script: Script, title: str, shown: str) -> None:
        if quantities[title] == 2:
            script.act("type [spinbutton 'Quantity'] [2] [0]", note=f"{title}: {shown}, take 2")
            script.act(ADD_TO_CART)
        else:
            script.act(ADD_TO_CART, note=f"{title}: {shown}, take 1")

    script = Script()
    sign_in(script)
    script.follow_rule(titles, open_product, price, titles, add)
    cart = {**CART, **quantities}
    amount = sum(PRODUCTS[t]["price"] * qty for t, qty in cart.items())
    script.act("click [link 'Proceed to checkout']")
    script.fact(money_cents(amount))
    script.stop(money_cents(amount))
    limit = money_cents(under)
    intent = (
        f"Add each of these products to your cart: {named(titles)}. Take 2 of each product "
        f"that costs less than {limit} and 1 of each other one. Then go to the checkout, but "
        "do not place the order: answer with the total it shows."
    )
    twice = [t for t in titles if quantities[t] == 2]
    once = [t for t in titles if quantities[t] == 1]
    return long_task(
        task_id,
        SIGNED_IN,
        intent,
        script,
        {"must_include": [dollars(amount)]},
        f"Two each of {', '.join(twice)}; one each of {', '.join(once)}; "
        f"cart total {money_cents(amount)}.",
        program_html=[
            cart_check(
                [
                    twice[-1],
                    f"quantity 2, subtotal {money_cents(2 * PRODUCTS[twice[-1]]['price'])}",
                    once[-1],
                    f"quantity 1, subtotal {price(once[-1])}",
                ]
            )
        ],
    )


def best_ordered(task_id: int, numbers: list[int]) -> dict[str, Any]:
    """Of the products in the account's orders `numbers`, the one rated highest: each order
    opened from the order history, each of its products opened from the order."""
    script, noted = Script(), None
    sign_in(script)
    titles = [TITLES[pid] for number in numbers for pid, _ in ORDERS[number]["items"]]
    for i, number in enumerate(numbers):
        if i:
            script.act("click [link 'Back to my orders']", note=noted)
            noted = None
        script.act(f"click [link 'Order #{number}']", note=noted)
        noted = None
        for j, (pid, _) in enumerate(ORDERS[number]["items"]):
            if j:
                script.act("go_back", note=noted)
            script.act(f"click {element('link', TITLES[pid])}")
            noted = read_stars(script, TITLES[pid])
        script.act("go_back", note=noted)
        noted = None
    best = unique_best(titles, lambda t: rating(t) or 0)
    script.stop(f"{best}: {stars(best)}")
    listed = ", ".join(f"#{n}" for n in numbers[:-1]) + f" and #{numbers[-1]}"
    intent = (
        f"Look at the products in your orders {listed}: open each one and read its rating. "
        "Answer with the name of the highest-rated product."
    )
    return long_task(
        task_id,
        ORDER_HISTORY,
        intent,
        script,
        one_of(best, titles),
        f"Ratings: {', '.join(f'{t} {stars(t)}' for t in titles)}.",
    )


def reorder_largest(task_id: int, city: str) -> dict[str, Any]:
    """Of the account's orders shipped to `city`, the one with the largest total: every order is
    opened for its city and total (newest first), then one of each product of the winner is
    added to the cart; the answer is its number."""
    script, noted = Script(), None
    sign_in(script)
    numbers = sorted(ORDERS, reverse=True)
    to_city = [n for n in numbers if ORDERS[n]["ship_city"] == city]
    best = unique_best(to_city, order_total)
    numbers = [n for n in numbers if n != best] + [best]
    shown = []
    for i, number in enumerate(numbers):
        if i:
            script.act("click [link 'Back to my orders']", note=noted)
        script.act(f"click [link 'Order #{number}']")
        order = ORDERS[number]
        where = script.fact(f"{order['ship_city']} {order['ship_zip']}")
        amount = script.fact(money_cents(order_total(number)))
        shown += [where, amount]
        if number == best:
            script.fact(f"Order #{best}")
        noted = f"Order #{number}: {order['ship_city']}, {amount}"
    for text in shown:
        script.use(text)
    for j, (pid, _) in enumerate(ORDERS[best]["items"]):
        if j:
            script.act(f"goto [__SHOPPING__/orders/{best}]")
        script.act(f"click {element('link', TITLES[pid])}", note=noted if not j else None)
        script.act(ADD_TO_CART)
    script.stop(f"Order #{best}")
    intent = (
        f"Of your orders shipped to {city}, find the one with the largest total. Add one of "
        "each product of that order to your cart, then answer with the order's number."
    )
    others = [str(n) for n in numbers if n != best]
    items = [TITLES[pid] for pid, _ in ORDERS[best]["items"]]
    return long_task(
        task_id,
        ORDER_HISTORY,
        intent,
        script,
        {"must_include": [str(best)], "must_exclude": others},
        "Totals: "
        + ", ".join(f"#{n} {ORDERS[n]['ship_city']} {money_cents(order_total(n))}" for n in numbers)
        + ".",
        program_html=[cart_check([items[0], items[-1]])],
    )


def tasks() -> list[dict[str, Any]]:
    """Tasks 521-530."""
    mixed = pick(count=98)
    return [
        compare(521, mixed[4:17], cheapest=True),
        most_reviews(522, pick("sports-outdoors", 12)),
        total(523, pick("books", 12)),
        count_rated(524, mixed[17:31], 4.0),
        reviews_by(525, mixed[40:52], "Dana"),
        fact_then_cart(526, mixed[52], mixed[53:59]),
        rule_cart(527, pick("home-kitchen", 10), 4.0),
        quantity_rule(528, mixed[84:90], 2000),
        best_ordered(529, [1001, 1003, 1008]),
        reorder_largest(530, "Erie"),
    ]
