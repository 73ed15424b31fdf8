"""Long-horizon tasks 511-520 on the forum site.

Each task names posts the agent looks up one by one (search by title, open the post) or users
whose pages it opens, so facts (points, comment counts, dates, authors, karma) are read on many
pages and compared, summed or chained at the end; some comment between reading a fact and
using it, or upvote a post chosen from facts read many pages earlier, and some carry a rule
given once in the goal that decides every later action (which posts to vote or comment on).
The write tasks sign in with the test account first. Answers are computed from the site's
seed-0 data.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from envs.sites.common.accounts import TEST_ACCOUNT
from envs.sites.common.web import site_date
from envs.sites.forum.data import USERNAMES, generate_comments, generate_posts
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
    sign_in,
    unique_best,
)

HOME = Start(["forum"], "__FORUM__/")
"""Where the forum's reading tasks start: the home page."""
SIGNED_IN = Start(["forum"], "__FORUM__/login", require_login=True)
"""Where the forum's writing tasks start: the login page, to sign in with the test account."""
LOG_IN_GOAL = (
    f"Log in to the forum as '{TEST_ACCOUNT['username']}' with the password "
    f"'{TEST_ACCOUNT['password']}'."
)
"""The first sentence of the goal of a task that writes to the forum."""
UPVOTE = f"click {element('button', 'Upvote')}"
"""The action upvoting the post whose page is open."""
_POSTS = generate_posts(0)
_COMMENTS = generate_comments(_POSTS, 0)
_COUNTS = Counter(comment["post_id"] for comment in _COMMENTS)
POSTS = {
    post["title"]: {**post, "id": i, "comments": _COUNTS[i]} for i, post in enumerate(_POSTS, 1)
}
"""The forum's posts by title (unique across forums), with their id and comment count."""
KARMA = {
    name: sum(p["score"] for p in _POSTS if p["author"] == name)
    + sum(c["score"] for c in _COMMENTS if c["author"] == name)
    for name in USERNAMES
}
"""Each seeded user's karma as the user page computes it: the scores of their posts and
comments summed."""


def points(value: int) -> str:
    """A score as the site shows it: '1 point', '12 points'."""
    return f"{value} point" if abs(value) == 1 else f"{value} points"


def score(title: str) -> str:
    """The post's score as its page shows it, e.g. `54 points`."""
    return points(POSTS[title]["score"])


def comments(title: str) -> str:
    """The post's comment count as its page's heading shows it, e.g. `Comments (9)`."""
    return f"Comments ({POSTS[title]['comments']})"


def counted(title: str) -> str:
    """The post's comment count for a note, e.g. `9 comments`."""
    count = POSTS[title]["comments"]
    return f"{count} comment" if count == 1 else f"{count} comments"


def posted(title: str) -> str:
    """The post's date as its page shows it, e.g. `Mar 28, 2024`."""
    return site_date(POSTS[title]["created"].isoformat())


def karma(name: str) -> str:
    """The user's karma as their page shows it, e.g. `Karma: 417`."""
    return f"Karma: {KARMA[name]}"


def post_url(title: str) -> str:
    """The post's page, with the site placeholder."""
    return f"__FORUM__/f/{POSTS[title]['forum']}/{POSTS[title]['id']}"


def open_post(script: Script, title: str, note: str | None = None) -> None:
    """Search for `title` and open its post (two actions); `note`, about the page the search
    is typed on, goes with the first."""
    search_and_open(script, title, element("link", title), note)


def open_user(script: Script, name: str, note: str | None = None) -> None:
    """Go to the page of user `name` (one action); `note` goes with it."""
    script.act(f"goto [__FORUM__/user/{name}]", note=note)


def read_score(script: Script, title: str) -> str:
    """Read the score on the post's page; the note `title: N points`."""
    return f"{title}: {script.fact(score(title))}"


def read_comments(script: Script, title: str) -> str:
    """Read the comment count on the post's page; the note `title: N comments`."""
    script.fact(comments(title))
    return f"{title}: {counted(title)}"


def read_karma(script: Script, name: str) -> str:
    """Read the karma on the page of user `name`; the note `name karma: N`."""
    script.fact(karma(name))
    return f"{name} karma: {KARMA[name]}"


def listed(titles: list[str], column: str) -> str:
    """'A 5, B 12' : each title with its value of `column` (for a task's comments)."""
    return ", ".join(f"{title} {POSTS[title][column]}" for title in titles)


def pick(forum: str | None = None, count: int = 10, skip: int = 0) -> list[str]:
    """`count` post titles in id order (of /f/`forum`, if given), after skipping `skip`."""
    titles = [t for t, row in POSTS.items() if forum in (None, row["forum"])]
    return titles[skip : skip + count]


def distinct_authors(titles: list[str], count: int) -> list[str]:
    """The first `count` of `titles` whose author did not write an earlier one of them."""
    kept: list[str] = []
    for title in titles:
        if POSTS[title]["author"] not in {POSTS[t]["author"] for t in kept}:
            kept.append(title)
    return kept[:count]


def post_check(title: str, contents: dict[str, Any], locator: str) -> dict[str, Any]:
    """A `program_html` check of what `locator` reads on the post's page."""
    return {"url": post_url(title), "locator": locator, "required_contents": contents}


def comments_check(title: str, contents: dict[str, Any]) -> dict[str, Any]:
    """A `program_html` check of the text of the post's comment list."""
    return post_check(title, contents, "document.querySelector('ul.comments').innerText")


def score_check(title: str, value: int) -> dict[str, Any]:
    """A `program_html` check that the post's page shows the score `value`."""
    locator = "document.querySelector('#post-score').innerText"
    return post_check(title, {"exact_match": points(value)}, locator)


def most_karma(task_id: int, names: list[str]) -> dict[str, Any]:
    """The user of `names` with the most karma, each user's page opened in turn."""
    script = Script()
    script.read_each(names, open_user, read_karma, "go_back")
    top = unique_best(names, KARMA.get)
    script.stop(f"{top} karma: {KARMA[top]}")
    intent = (
        f"Open the user page of each of these forum users and note their karma: "
        f"{named(names)}. Answer with the username of the one with the most karma."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(top, names),
        f"Karma: {', '.join(f'{n} {KARMA[n]}' for n in names)}.",
    )


def total_points(task_id: int, titles: list[str]) -> dict[str, Any]:
    """The sum of the scores of `titles`."""
    script = Script()
    script.read_each(titles, open_post, read_score, "go_back")
    amount = sum(POSTS[t]["score"] for t in titles)
    script.stop(str(amount))
    intent = (
        f"Open each of these forum posts and read its points: {named(titles)}. Answer with "
        "the total points of all of them together."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        {"must_include": [str(amount)]},
        f"Points: {listed(titles, 'score')}; total {amount}.",
    )


def most_comments(task_id: int, titles: list[str]) -> dict[str, Any]:
    """The post of `titles` with the most comments (replies included, as the heading counts)."""
    script = Script()
    script.read_each(titles, open_post, read_comments, "go_back")
    top = unique_best(titles, lambda t: POSTS[t]["comments"])
    script.stop(top)
    intent = (
        f"Open each of these forum posts and count its comments: {named(titles)}. Answer with "
        "the title of the post that has the most comments."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(top, titles),
        f"Comments: {listed(titles, 'comments')}.",
    )


def author_of_top(task_id: int, titles: list[str]) -> dict[str, Any]:
    """Who wrote the highest-scored of `titles`: every score, then the winner's author, which
    was shown on its page several posts earlier."""
    top = unique_best(titles, lambda t: POSTS[t]["score"])

    def read(script: Script, title: str) -> str:
        noted = read_score(script, title)
        if title == top:
            noted += f", by {script.fact(POSTS[title]['author'])}"
        return noted

    script = Script()
    script.read_each(titles, open_post, read, "go_back")
    author = POSTS[top]["author"]
    script.stop(author)
    intent = (
        f"Of these forum posts, find the one with the most points: {named(titles)}. Answer "
        "with the username of its author."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(author, sorted({POSTS[t]["author"] for t in titles})),
        f"Most points: {top} ({POSTS[top]['score']}), written by {author}.",
    )


def earliest(task_id: int, titles: list[str]) -> dict[str, Any]:
    """The post of `titles` posted first (dates differ by at least a day)."""
    script = Script()
    script.read_each(
        titles,
        open_post,
        lambda script, title: f"{title}: posted {script.fact(posted(title))}",
        "go_back",
    )
    first = unique_best(titles, lambda t: POSTS[t]["created"].date(), highest=False)
    script.stop(first)
    intent = (
        f"Which of these forum posts was posted first: {named(titles)}? Open each one, read "
        "the date it was posted, and answer with the title."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(first, titles),
        f"Posted: {', '.join(f'{t} {posted(t)}' for t in titles)}.",
    )


def richest_author(task_id: int, titles: list[str]) -> dict[str, Any]:
    """Of the authors of `titles`, the one with the most karma: each post is opened, then its
    author's page (a chain of three pages per post)."""
    authors = [POSTS[t]["author"] for t in titles]
    if len(set(authors)) < len(authors):
        raise ValueError("two posts have the same author")
    top = unique_best(authors, KARMA.get)

    def open_author(script: Script, title: str, note: str | None) -> None:
        open_post(script, title, note=note)
        script.act(f"click {element('link', POSTS[title]['author'])}")

    script = Script()
    script.read_each(
        titles,
        open_author,
        lambda script, title: read_karma(script, POSTS[title]["author"]),
        "go_back",
    )
    script.stop(f"{top} karma: {KARMA[top]}")
    intent = (
        f"For each of these forum posts, open the post and then its author's user page: "
        f"{named(titles)}. Of these authors, answer with the username of the one with the "
        "most karma."
    )
    return long_task(
        task_id,
        HOME,
        intent,
        script,
        one_of(top, authors),
        f"Authors' karma: {', '.join(f'{a} {KARMA[a]}' for a in authors)}.",
    )


def fact_then_comments(task_id: int, first: str, titles: list[str], text: str) -> dict[str, Any]:
    """Sign in, read `first`'s author, post `text` on each of `titles`, then answer with that
    author: a fact read at the start and needed after many write actions."""
    script = Script()
    sign_in(script)
    open_post(script, first)
    author = script.fact(POSTS[first]["author"])
    noted = f"{first} author: {author}"
    for title in titles:
        open_post(script, title, note=noted)
        noted = None
        script.act(comment_action(text))
    script.stop(f"{first} author: {author}")
    intent = (
        f"{LOG_IN_GOAL} First find out who wrote the post '{first}'. Then post the comment "
        f"'{text}' on each of these posts: {named(titles)}. When done, answer with the "
        f"username of the author of '{first}'."
    )
    checks = [
        comments_check(title, {"must_include": [TEST_ACCOUNT["username"], text]})
        for title in (titles[0], titles[-1])
    ]
    return long_task(
        task_id,
        SIGNED_IN,
        intent,
        script,
        one_of(author, sorted({POSTS[t]["author"] for t in titles})),
        f"{first} was written by {author}; the comment goes on {len(titles)} posts.",
        program_html=checks,
    )


def rule_once_vote(task_id: int, titles: list[str], least: int) -> dict[str, Any]:
    """A rule given once decides every later action: upvote only the posts with at least
    `least` comments; answer with how many were upvoted."""
    chosen = [t for t in titles if POSTS[t]["comments"] >= least]
    script = Script()
    sign_in(script)
    script.follow_rule(
        titles,
        open_post,
        comments,
        chosen,
        lambda script, title, _: script.act(UPVOTE, note=f"{counted(title)}, upvote"),
    )
    script.stop(str(len(chosen)))
    intent = (
        f"{LOG_IN_GOAL} Then visit each of these posts in turn: {named(titles)}. "
        f"Upvote only the posts that have at least {least} comments; leave the others alone. "
        "Answer with how many posts you upvoted."
    )
    skipped = [t for t in titles if t not in chosen]
    checks = [
        score_check(chosen[-1], POSTS[chosen[-1]]["score"] + 1),
        score_check(skipped[-1], POSTS[skipped[-1]]["score"]),
    ]
    return long_task(
        task_id,
        SIGNED_IN,
        intent,
        script,
        {"must_include": [str(len(chosen))]},
        f"At least {least} comments: {', '.join(chosen)}.",
        program_html=checks,
    )


def rule_once_comment(task_id: int, titles: list[str], above: int, text: str) -> dict[str, Any]:
    """A rule given once decides every later action: comment `text` only on the posts with
    more than `above` points; answer with how many comments were posted."""
    chosen = [t for t in titles if POSTS[t]["score"] > above]
    script = Script()
    sign_in(script)
    script.follow_rule(
        titles,
        open_post,
        score,
        chosen,
        lambda script, _, shown: script.act(comment_action(text), note=f"{shown}, comment"),
    )
    script.stop(str(len(chosen)))
    intent = (
        f"{LOG_IN_GOAL} Then visit each of these posts in turn: {named(titles)}. "
        f"Only on the posts with more than {above} points, post the comment '{text}'; leave "
        "the others alone. Answer with how many comments you posted."
    )
    skipped = [t for t in titles if t not in chosen]
    return long_task(
        task_id,
        SIGNED_IN,
        intent,
        script,
        {"must_include": [str(len(chosen))]},
        f"More than {above} points: {', '.join(chosen)}.",
        program_html=rule_checks(comments_check, chosen, skipped, text),
    )


def upvote_most_commented(task_id: int, titles: list[str]) -> dict[str, Any]:
    """Sign in, find the post of `titles` with the most comments, go back to it and upvote it;
    answer with its title: the winner, read several posts earlier, decides the write action."""
    top = unique_best(titles, lambda t: POSTS[t]["comments"])
    script = Script()
    sign_in(script)
    script.read_each(titles, open_post, read_comments, search_action(top))
    script.use(comments(top))
    script.act(f"click {element('link', top)}")
    script.act(UPVOTE)
    script.stop(top)
    intent = (
        f"{LOG_IN_GOAL} Of these posts, find the one with the most comments: "
        f"{named(titles)}. Upvote that post (only that one), and answer with its title."
    )
    return long_task(
        task_id,
        SIGNED_IN,
        intent,
        script,
        one_of(top, titles),
        f"Comments: {listed(titles, 'comments')}; {top} is "
        f"upvoted from {POSTS[top]['score']} to {POSTS[top]['score'] + 1} points.",
        program_html=[score_check(top, POSTS[top]["score"] + 1)],
    )


def tasks() -> list[dict[str, Any]]:
    """Tasks 511-520."""
    mixed = pick(count=150)
    return [
        most_karma(511, USERNAMES[13:27]),
        total_points(512, pick("bikes", 10)),
        most_comments(513, mixed[0:12]),
        fact_then_comments(514, mixed[12], mixed[13:19], "Thanks for starting this thread!"),
        author_of_top(515, pick("cooking", 12)),
        richest_author(516, distinct_authors(mixed[27:], 7)),
        rule_once_vote(517, pick("gaming", 10), 3),
        earliest(518, pick("science", 12)),
        rule_once_comment(519, pick("travel", 9), 20, "Bookmarked for my next trip."),
        upvote_most_commented(520, pick("movies", 10)),
    ]
