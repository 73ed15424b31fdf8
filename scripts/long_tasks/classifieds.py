"""Long-horizon tasks 501-510 on the classifieds site.

Each task names listings the agent looks up one by one (search by title, open the listing),
so facts are read on many pages and compared, summed or counted at the end; some post
comments between reading a fact and using it, and some carry a rule given once in the goal
that decides every later action. Answers are computed from the site's seed-0 data.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from envs.sites.classifieds.data import generate_listings
from envs.sites.common.web import site_date
from scripts.long_tasks.script import (
    Script,
    Start,
    comment_action,
    element,
    long_task,
    named,
    one_of,
    rule_checks,
    search_and_open,
    unique_best,
)

HOME = Start(["classifieds"], "__CLASSIFIEDS__/")
"""Where the classifieds' tasks start: the home page."""
LISTINGS = {
    listing["title"]: {**listing, "id": i} for i, listing in enumerate(generate_listings(0), 1)
}


def price(title: str) -> str:
    """The price as the listing page shows it, e.g. `$1,100`."""
    return f"${LISTINGS[title]['price']:,}"


def posted(title: str) -> str:
    """The date as the listing page shows it, e.g. `Mar 28, 2024`."""
    return site_date(LISTINGS[title]["posted"].isoformat())


def listing_link(title: str) -> str:
    """The listing's link in search results, e.g. `[link 'Blue road bike - $120']`."""
    return element("link", f"{title} - {price(title)}")


def open_listing(script: Script, title: str, note: str | None = None) -> None:
    """Search for `title` and open its listing (two actions); `note`, the agent's note of the
    page it leaves, goes with the first."""
    search_and_open(script, title, listing_link(title), note)


def read_price(script: Script, title: str) -> str:
    """Read the price on the listing's page; the note `title: $price`."""
    return f"{title}: {script.fact(price(title))}"


def read_posted(script: Script, title: str) -> str:
    """Read the date the listing was posted on its page; the note `title: posted date`."""
    return f"{title}: posted {script.fact(posted(title))}"


def listing_check(title: str, contents: dict[str, Any]) -> dict[str, Any]:
    """A `program_html` check of the text of the listing's page."""
    return {
        "url": f"__CLASSIFIEDS__/listing/{LISTINGS[title]['id']}",
        "locator": "",
        "required_contents": contents,
    }


def pick(category: str | None = None, count: int = 10, skip: int = 0) -> list[str]:
    """`count` listing titles in id order (of `category`, if given), after skipping `skip`."""
    titles = [t for t, row in LISTINGS.items() if category in (None, row["category"])]
    return titles[skip : skip + count]


def compare(task_id: int, titles: list[str], cheapest: bool) -> dict[str, Any]:
    """The cheapest (or most expensive) of `titles`, each looked up in turn; the answer is the
    title and the facts are every price."""
    script = Script()
    script.read_each(titles, open_listing, read_price, "go_back")
    best = unique_best(titles, lambda t: LISTINGS[t]["price"], highest=not cheapest)
    script.stop(f"{best}: {price(best)}")
    word = "cheapest" if cheapest else "most expensive"
    intent = (
        f"Look up each of these listings and note its price: {named(titles)}. "
        f"Answer with the title of the {word} one and its price."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(best, titles),
        f"Prices: {', '.join(f'{t} {price(t)}' for t in titles)}.",
    )


def total(task_id: int, titles: list[str]) -> dict[str, Any]:
    """The sum of the prices of `titles`."""
    script = Script()
    script.read_each(titles, open_listing, read_price, "go_back")
    amount = sum(LISTINGS[t]["price"] for t in titles)
    script.stop(f"${amount:,}")
    intent = (
        f"I want to buy all of these listings: {named(titles)}. Look up each one and answer "
        "with the total price of all of them together."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        {"must_include": [" |OR| ".join(dict.fromkeys([f"{amount:,}", str(amount)]))]},
        f"Prices: {', '.join(f'{t} {price(t)}' for t in titles)}; total ${amount:,}.",
    )


def seller_of_most_expensive(task_id: int, titles: list[str]) -> dict[str, Any]:
    """Who sells the most expensive of `titles`: every price, then the winner's seller, which
    was shown on its page several listings earlier."""
    best = unique_best(titles, lambda t: LISTINGS[t]["price"])

    def read(script: Script, title: str) -> str:
        noted = read_price(script, title)
        if title == best:
            noted += f", seller {script.fact(LISTINGS[title]['seller'])}"
        return noted

    script = Script()
    script.read_each(titles, open_listing, read, "go_back")
    seller = LISTINGS[best]["seller"]
    script.stop(seller)
    intent = (
        f"Of these listings, find the most expensive one: {named(titles)}. Answer with the "
        "name of its seller."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(seller, sorted({LISTINGS[t]["seller"] for t in titles})),
        f"Most expensive: {best} {price(best)}, sold by {seller}.",
    )


def count_located(task_id: int, titles: list[str], state: str) -> dict[str, Any]:
    """How many of `titles` are located in `state` (the location's two-letter suffix)."""
    script = Script()
    script.read_each(
        titles,
        open_listing,
        lambda script, title: f"{title}: {script.fact(LISTINGS[title]['location'])}",
        "go_back",
    )
    hits = [t for t in titles if LISTINGS[t]["location"].endswith(f", {state}")]
    script.stop(str(len(hits)))
    intent = (
        f"Open each of these listings and read its location: {named(titles)}. Answer with how "
        f"many of them are located in the state {state}."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        {"must_include": [str(len(hits))]},
        f"In {state}: {', '.join(hits) or 'none'}.",
    )


def earliest(task_id: int, titles: list[str]) -> dict[str, Any]:
    """The listing of `titles` posted first."""
    script = Script()
    script.read_each(titles, open_listing, read_posted, "go_back")
    first = unique_best(titles, lambda t: LISTINGS[t]["posted"], highest=False)
    script.stop(f"{first}, posted {posted(first)}")
    intent = (
        f"Which of these listings was posted first: {named(titles)}? Open each one, read the "
        "date it was posted, and answer with the title."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(first, titles),
        f"Posted: {', '.join(f'{t} {posted(t)}' for t in titles)}.",
    )


def fact_then_comments(task_id: int, first: str, titles: list[str], text: str) -> dict[str, Any]:
    """Read `first`'s seller, post `text` on each of `titles`, then answer with that seller:
    a fact read at the start and needed after many write actions."""
    script = Script()
    open_listing(script, first)
    seller = script.fact(LISTINGS[first]["seller"])
    noted = f"{first} seller: {seller}"
    for title in titles:
        open_listing(script, title, note=noted)
        noted = None
        script.act(comment_action(text))
    script.stop(f"{first} seller: {seller}")
    intent = (
        f"First find out who sells '{first}'. Then post the comment '{text}' on each of these "
        f"listings: {named(titles)}. When done, answer with the seller of '{first}'."
    )
    checks = [listing_check(title, {"must_include": [text]}) for title in (titles[0], titles[-1])]
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(seller, sorted({LISTINGS[t]["seller"] for t in titles})),
        f"{first} is sold by {seller}; the comment goes on {len(titles)} listings.",
        program_html=checks,
    )


def rule_once(task_id: int, titles: list[str], before: str, text: str) -> dict[str, Any]:
    """A rule given once decides every later action: comment only on listings posted before
    `before` (an ISO date); answer with how many comments were posted."""
    cutoff = dt.date.fromisoformat(before)
    chosen = [t for t in titles if LISTINGS[t]["posted"] < cutoff]
    script = Script()
    script.follow_rule(
        titles,
        open_listing,
        posted,
        chosen,
        lambda script, _, shown: script.act(comment_action(text), note=f"posted {shown}, comment"),
    )
    script.stop(str(len(chosen)))
    intent = (
        f"Visit each of these listings in turn: {named(titles)}. Only on those posted before "
        f"{cutoff:%B} {cutoff.day}, {cutoff.year}, post the comment '{text}'; leave the "
        "others alone. Answer with how many comments you posted."
    )
    skipped = [t for t in titles if t not in chosen]
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        {"must_include": [str(len(chosen))]},
        f"Posted before {before}: {', '.join(chosen)}.",
        program_html=rule_checks(listing_check, chosen, skipped, text),
    )


def tasks() -> list[dict[str, Any]]:
    """Tasks 501-510."""
    mixed = pick(count=66)
    return [
        compare(501, mixed[0:14], cheapest=True),
        seller_of_most_expensive(502, mixed[14:28]),
        total(503, pick("bikes", 13)),
        count_located(504, mixed[28:43], "NY"),
        earliest(505, pick("furniture", 14)),
        fact_then_comments(506, mixed[43], mixed[44:54], "Can you hold it until Friday?"),
        compare(507, pick("electronics", 15), cheapest=False),
        rule_once(508, pick("clothing", 13), "2024-03-01", "Can you hold it until Friday?"),
        total(509, pick("books", 13, skip=2)),
        earliest(510, pick("cars", 15)),
    ]
