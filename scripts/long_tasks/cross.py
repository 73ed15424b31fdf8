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

from collections import Counter
from collections.abc import Callable
from typing import Any

from envs.sites.common.web import money_cents
from scripts.long_tasks.classifieds import HOME as CLASSIFIEDS
from scripts.long_tasks.classifieds import (
    LISTINGS,
    listing_check,
    listing_link,
    open_listing,
    pick,
    posted,
    price,
    read_posted,
    read_price,
)
from scripts.long_tasks.forum import HOME as FORUM
from scripts.long_tasks.forum import (
    POSTS,
    comments,
    comments_check,
    open_post,
    read_score,
    score,
)
from scripts.long_tasks.script import (
    Script,
    Start,
    comment_action,
    element,
    long_task,
    named,
    one_of,
    rule_checks,
    search_action,
    search_and_open,
    unique_best,
)
from scripts.long_tasks.shopping import (
    ADD_TO_CART,
    CART,
    ORDERS,
    PRODUCTS,
    cart_check,
    product_link,
    rating,
    read_stars,
    stars,
)
from scripts.long_tasks.shopping import HOME as SHOPPING
from scripts.long_tasks.shopping import price as shop_price

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
    return unique_best(shop_search(kind), lambda t: PRODUCTS[t]["price"], highest=False)


def new_price(kind: str) -> str:
    """The price of the cheapest new product of `kind` in the shop, e.g. `$323.99`."""
    return shop_price(cheapest_new(kind))


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


def tabs(first: Start, second: Start, require_login: bool = False, first_page: str = "") -> Start:
    """Where a task on two sites starts, from the sites' own starts `first` and `second`:
    the first active in tab 0 (on the path `first_page` below its URL), the second in tab 1."""
    url = f"{first.url}{first_page} |AND| {second.url}"
    return Start(first.sites + second.sites, url, require_login)


def quote_new_prices(
    script: Script,
    items: list[str],
    open_item: Callable[[Script, str], None],
    fact: Callable[[str], str],
    kind_of: Callable[[str], str],
    quote: Callable[[str], str],
) -> None:
    """For each of `items`, open in tab 0: open it (`open_item(script, item)`) and read
    `fact(item)`, find the price of the cheapest new product of its kind (`kind_of(item)`) in
    the shop in tab 1, and back in tab 0 post the comment `quote(price)` on the item."""
    for item in items:
        open_item(script, item)
        shown = script.fact(fact(item))
        kind = kind_of(item)
        script.act("tab_focus [1]", note=f"{item}: {shown}")
        script.act(search_action(kind))
        new = script.fact(new_price(kind))
        script.act("tab_focus [0]", note=f"new {kind} from {new}")
        script.use(new)
        script.act(comment_action(quote(new)))


def comment_on_post(script: Script, post: str, text: str) -> None:
    """Open the forum post `post` and post the comment `text`, which uses every fact read so
    far (three actions)."""
    open_post(script, post)
    for fact in script.facts:
        script.use(fact["text"])
    script.act(comment_action(text))


def cheaper_used(task_id: int, titles: list[str]) -> dict[str, Any]:
    """Shop first: the cheapest new product of each kind of USED_KINDS (one search each);
    then every listing of `titles` on the classifieds site; the answer counts the listings
    cheaper than the cheapest new product of their kind, read many pages earlier."""
    script = Script()
    script.read_each(
        USED_KINDS,
        lambda script, kind, note: script.act(search_action(kind), note=note),
        lambda script, kind: f"new {kind} from {script.fact(new_price(kind))}",
        "tab_focus [1]",
    )
    script.read_each(titles, open_listing, read_price, "go_back")
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
    quote_new_prices(script, titles, open_listing, price, used_kind, quote)
    saving = {
        t: PRODUCTS[cheapest_new(used_kind(t))]["price"] - LISTINGS[t]["price"] * 100
        for t in titles
    }
    best = unique_best(titles, saving.get)
    script.stop(best)
    intent = (
        "The classifieds site is open in the first tab and the shop in the second. For each of "
        f"these used listings: {named(titles)}, find the cheapest new product of the same kind "
        "in the shop and post the comment 'New in the shop from $X.' on the listing, with X that "
        "product's price. Then answer with the title of the listing that saves the most money "
        "compared with buying its kind new."
    )
    checks = [
        listing_check(title, {"must_include": [quote(new_price(used_kind(title)))]})
        for title in (titles[0], titles[-1])
    ]
    return long_task(
        task_id,
        tabs(CLASSIFIEDS, SHOPPING),
        intent,
        script,
        one_of(best, titles),
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
    orders = list(ORDERS.values())
    newest_first = sorted(orders, key=lambda order: (order["placed"], order["id"]), reverse=True)
    for order in newest_first:
        number = f"Order #{order['id']}"
        script.act(f"click {element('link', number)}", note=noted)
        noted = f"{number}: {script.fact(order['ship_city'])}"
        if order is not newest_first[-1]:
            script.act(f"click {element('link', 'Back to my orders')}", note=noted)
            noted = None
    script.act("tab_focus [1]", note=noted)
    cities = Counter(order["ship_city"] for order in orders)
    city = unique_best(list(cities), cities.get)

    def read(script: Script, title: str) -> str:
        noted = f"{title}: {script.fact(LISTINGS[title]['location'])}"
        if city_of(title) == city:
            noted += f", {script.fact(price(title))}"
        return noted

    script.read_each(titles, open_listing, read, "go_back")
    local = [t for t in titles if city_of(t) == city]
    best = unique_best(local, lambda t: LISTINGS[t]["price"])
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
        tabs(SHOPPING, CLASSIFIEDS, require_login=True, first_page="orders"),
        intent,
        script,
        one_of(best, titles),
        f"Orders shipped to: {dict(cities)}. Listings in {city}: "
        + ", ".join(f"{t} {price(t)}" for t in local)
        + ".",
    )


def cart_rule(task_id: int, titles: list[str], limit: int) -> dict[str, Any]:
    """A rule given once decides every later action: for each listing of `titles` that costs
    more than `limit` dollars, add the cheapest new product of its kind to the shop's cart;
    the answer is the cart's total after the last one (shown on the cart page then)."""
    script, noted, added = Script(), None, []
    buys = [t for t in titles if LISTINGS[t]["price"] > limit]
    for title in titles:
        open_listing(script, title, noted)
        shown = script.fact(price(title))
        script.use(shown)
        if title not in buys:
            noted = f"{title}: {shown}, not over ${limit}, skip"
            continue
        kind, product = used_kind(title), cheapest_new(used_kind(title))
        script.act("tab_focus [1]", note=f"{title}: {shown}, over ${limit}, buy new")
        script.act(search_action(kind))
        script.act(f"click {product_link(product)}")
        script.act(ADD_TO_CART)
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
    number = total.lstrip("$")
    return long_task(
        task_id,
        tabs(CLASSIFIEDS, SHOPPING, require_login=True),
        intent,
        script,
        {"must_include": [f"{number} |OR| {number.replace(',', '')}"]},
        f"Over ${limit}: {', '.join(buys)}; added {', '.join(added)} to the cart "
        f"({', '.join(f'{n} {t}' for t, n in CART.items())} at the start): total {total}.",
        program_html=[cart_check(added, skipped)],
    )


def most_comments_best_rated(task_id: int, posts: list[str]) -> dict[str, Any]:
    """Forum first: the comment count of each post of `posts`; then, in the shop, every
    product of the kind the most-commented post is about; the answer is the best-rated."""
    top = unique_best(posts, lambda t: POSTS[t]["comments"])
    kind = shop_kind(top)
    script = Script()
    script.read_each(
        posts,
        open_post,
        lambda script, title: f"{title}: {script.fact(comments(title))}",
        "tab_focus [1]",
    )
    script.act(search_action(kind))
    products = shop_search(kind)
    for product in products:
        script.act(f"click {product_link(product)}")
        script.act("go_back", note=read_stars(script, product))
    best = unique_best(products, rating)
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
        tabs(FORUM, SHOPPING),
        intent,
        script,
        one_of(best, products),
        f"Most comments: {top} ({POSTS[top]['comments']}); shop {kind}: "
        + ", ".join(f"{p} {stars(p)}" for p in products)
        + ".",
    )


def best_rated_pick(task_id: int, products: list[str], post: str) -> dict[str, Any]:
    """Shop first: the rating of each product of `products`; then a forum comment naming the
    best-rated one on `post`, which is also the answer."""
    script = Script()
    script.read_each(
        products,
        lambda script, product, note: search_and_open(script, product, product_link(product), note),
        read_stars,
        "tab_focus [1]",
    )
    best = unique_best(products, rating)
    text = f"Best rated in the shop: {best}"
    comment_on_post(script, post, text)
    script.stop(best)
    intent = (
        "The shop is open in the first tab and the forum in the second. Look up each of these "
        f"products in the shop and note its rating: {named(products)}. Then, on the forum, post "
        f"the comment 'Best rated in the shop: X' on the post '{post}', with X the title of the "
        "best-rated of those products. Answer with that title."
    )
    return long_task(
        task_id,
        tabs(SHOPPING, FORUM, require_login=True),
        intent,
        script,
        one_of(best, products),
        f"Ratings: {', '.join(f'{p} {rating(p)}' for p in products)}.",
        program_html=[comments_check(post, {"must_include": [text]})],
    )


def quote_on_posts(task_id: int, posts: list[str]) -> dict[str, Any]:
    """For each forum post of `posts`: its points, the cheapest shop product of the kind it
    is about, and a comment on the post quoting that price; the answer is the post with the
    most points, read many pages earlier."""
    script = Script()
    quote_new_prices(script, posts, open_post, score, shop_kind, shop_quote)
    best = unique_best(posts, lambda t: POSTS[t]["score"])
    script.stop(best)
    intent = (
        "The forum is open in the first tab and the shop in the second. Each of these forum "
        f"posts is about a kind of product the shop sells: {named(posts)}. For each post, note "
        "its points, find the cheapest product of its kind in the shop and post the comment "
        "'The shop sells one from $X.' on the post, with X that product's price. Then answer "
        "with the title of the post that has the most points."
    )
    checks = [
        comments_check(title, {"must_include": [shop_quote(new_price(shop_kind(title)))]})
        for title in (posts[0], posts[-1])
    ]
    return long_task(
        task_id,
        tabs(FORUM, SHOPPING, require_login=True),
        intent,
        script,
        one_of(best, posts),
        f"Points: {', '.join(f'{t} {score(t)}' for t in posts)}.",
        program_html=checks,
    )


def shop_quote(new: str) -> str:
    """The comment of `quote_on_posts` for the price `new`."""
    return f"The shop sells one from {new}."


def top_post_cheapest_seller(task_id: int, posts: list[str]) -> dict[str, Any]:
    """Forum first: the points of each post of `posts`; then, on the classifieds site, every
    listing of the kind the top post is about; the answer is the seller of the cheapest."""
    top = unique_best(posts, lambda t: POSTS[t]["score"])
    kind = LISTING_KIND[topic(top, LISTING_KIND)]
    found = listing_search(kind)
    cheapest = unique_best(found, lambda t: LISTINGS[t]["price"], highest=False)
    script = Script()
    script.read_each(posts, open_post, read_score, "tab_focus [1]")
    script.act(search_action(kind))
    for title in found:
        script.act(f"click {listing_link(title)}")
        noted = read_price(script, title)
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
    return long_task(
        task_id,
        tabs(FORUM, CLASSIFIEDS),
        intent,
        script,
        one_of(seller, sorted({LISTINGS[t]["seller"] for t in found})),
        f"Top post: {top} ({score(top)}); {kind} listings: "
        + ", ".join(f"{t} {price(t)} by {LISTINGS[t]['seller']}" for t in found)
        + ".",
    )


def oldest_listing_comment(task_id: int, titles: list[str], post: str) -> dict[str, Any]:
    """Classifieds first: the date each listing of `titles` was posted; then a forum comment
    on `post` naming the one posted first and its date, which is also the answer."""
    script = Script()
    script.read_each(titles, open_listing, read_posted, "tab_focus [1]")
    first = unique_best(titles, lambda t: LISTINGS[t]["posted"], highest=False)
    text = f"Listed the longest: {first}, posted {posted(first)}."
    comment_on_post(script, post, text)
    script.stop(first)
    intent = (
        "The classifieds site is open in the first tab and the forum in the second. Open each "
        f"of these listings and note the date it was posted: {named(titles)}. Then, on the "
        f"forum, post the comment 'Listed the longest: X, posted D.' on the post '{post}', "
        "with X the title of the listing posted first and D its date as the listing shows it. "
        "Answer with that title."
    )
    return long_task(
        task_id,
        tabs(CLASSIFIEDS, FORUM, require_login=True),
        intent,
        script,
        one_of(first, titles),
        f"Posted: {', '.join(f'{t} {posted(t)}' for t in titles)}.",
        program_html=[comments_check(post, {"must_include": [text]})],
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
        shown = script.fact(score(post))
        script.use(shown)
        if POSTS[post]["score"] <= above:
            noted = f"{post}: {shown}, skip"
            continue
        chosen.append(listing)
        script.act("tab_focus [1]", note=f"{post}: {shown}, comment on {listing}")
        open_listing(script, listing)
        script.act(comment_action(text))
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
    return long_task(
        task_id,
        tabs(FORUM, CLASSIFIEDS),
        intent,
        script,
        {"must_include": [str(len(chosen))]},
        f"Posts over {above} points: "
        + ", ".join(f"{post} ({score(post)})" for post, _ in pairs if POSTS[post]["score"] > above)
        + f"; commented on {', '.join(chosen)}.",
        program_html=rule_checks(listing_check, chosen, skipped, text),
    )


def tasks() -> list[dict[str, Any]]:
    """Tasks 531-540."""
    electronics = [t for t, row in LISTINGS.items() if row["category"] == "electronics"]
    used = [t for t in electronics if used_kind(t) in USED_KINDS]
    rated = [
        t for t, row in PRODUCTS.items() if row["category"] == "electronics" and row["reviews"]
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
        order_city_listing(533, pick("furniture", 9, skip=12)),
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
        oldest_listing_comment(
            539, pick("bikes", 14, skip=2), "Beginner questions about bike commuting"
        ),
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
