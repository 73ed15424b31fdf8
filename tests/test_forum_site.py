"""The forum site: seeded data, pages, sorting, search, login, comments, votes and reset."""

import re
import sqlite3
import time
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar

import pytest
from fastapi.testclient import TestClient

from envs.server import SITES, SiteServer
from envs.sites.common.accounts import TEST_ACCOUNT
from envs.sites.forum import build_template_db, create_app
from envs.sites.forum.app import PAGE_SIZE, SESSION_COOKIE, _hotness
from envs.sites.forum.data import FORUMS
from envs.tasks import load_suite


@pytest.fixture(scope="module")
def db_path(tmp_path_factory):
    return build_template_db(tmp_path_factory.mktemp("forum") / "site.db")


@pytest.fixture()
def working(tmp_path, db_path):
    path = tmp_path / "working.db"
    path.write_bytes(db_path.read_bytes())
    return path


@pytest.fixture()
def client(working):
    return TestClient(create_app(working))


@pytest.fixture()
def agent(working):
    """A client logged in as the test account."""
    client = TestClient(create_app(working))
    response = client.post("/login", data=TEST_ACCOUNT, follow_redirects=False)
    assert response.status_code == 303 and SESSION_COOKIE in response.cookies
    return client


def _rows(path, sql, params=()):
    with sqlite3.connect(path) as db:
        rows = db.execute(sql, params).fetchall()
    db.close()
    return rows


def _titles(page: str) -> list[str]:
    """Post titles of a list page, in order."""
    return re.findall(r'<a href="/f/\w+/\d+">([^<]+)</a>', page)


def _score(page: str) -> str:
    return re.search(r'id="post-score">([^<]+)<', page).group(1)


def test_template_db_has_the_seeded_amounts(db_path):
    assert _rows(db_path, "SELECT COUNT(*) FROM forums")[0][0] == len(FORUMS) == 8
    assert _rows(db_path, "SELECT COUNT(*) FROM posts")[0][0] == 150
    comments, replies = _rows(db_path, "SELECT COUNT(*), COUNT(parent_id) FROM comments")[0]
    assert 350 <= comments <= 500 and replies > 50
    assert _rows(db_path, "SELECT COUNT(*) FROM users")[0][0] == 30
    assert _rows(db_path, "SELECT username FROM users WHERE id = 30") == [("agent",)]
    nested = "SELECT COUNT(*) FROM comments c JOIN comments p ON p.id = c.parent_id"
    assert _rows(db_path, nested + " WHERE p.parent_id IS NOT NULL")[0][0] == 0


def test_template_db_is_deterministic_in_the_seed(tmp_path, db_path):
    again = build_template_db(tmp_path / "again.db", seed=0)
    other = build_template_db(tmp_path / "other.db", seed=1)
    for table in ("posts", "comments", "users"):
        query = f"SELECT * FROM {table} ORDER BY id"
        assert _rows(again, query) == _rows(db_path, query)
    assert _rows(other, "SELECT * FROM posts") != _rows(db_path, "SELECT * FROM posts")


def test_home_lists_forums_with_counts(client):
    page = client.get("/").text
    for slug, _, description, count in FORUMS:
        assert f'<a href="/f/{slug}">/f/{slug}</a> {description} · {count} posts' in page
    assert 'aria-label="Search"' in page and ">Log in</a>" in page


def test_forum_pages_are_paginated(client):
    first = client.get("/f/bikes").text
    assert "Showing 1-20 of 26 posts" in first and "Page 1 of 2" in first
    assert len(_titles(first)) == PAGE_SIZE
    second = client.get("/f/bikes?page=2").text
    assert "Showing 21-26 of 26 posts" in second and "Previous page" in second
    assert not set(_titles(first)) & set(_titles(second))
    assert client.get("/f/boats").status_code == 404


def test_forum_sorts_hot_new_and_top(client, db_path):
    rows = _rows(
        db_path,
        "SELECT p.title, p.score, p.created FROM posts p JOIN forums f ON f.id = p.forum_id"
        " WHERE f.slug = 'gaming'",
    )
    by_new = [r[0] for r in sorted(rows, key=lambda r: r[2], reverse=True)]
    by_top = [r[0] for r in sorted(rows, key=lambda r: -r[1])]
    by_hot = [r[0] for r in sorted(rows, key=lambda r: -_hotness(r[1], r[2]))]
    assert _titles(client.get("/f/gaming?sort=new").text) == by_new
    top = client.get("/f/gaming?sort=top").text
    assert _titles(top)[0] == by_top[0] and 'aria-current="true">Top</a>' in top
    assert _titles(client.get("/f/gaming").text) == by_hot != by_new
    scores = [int(s) for s in re.findall(r'class="score">(-?\d+) points?<', top)]
    assert scores == sorted(scores, reverse=True)


def test_post_page_shows_body_score_and_threaded_comments(client, db_path):
    post_id, title, score = _rows(
        db_path, "SELECT id, title, score FROM posts WHERE forum_id = 1 ORDER BY id LIMIT 1"
    )[0]
    page = client.get(f"/f/bikes/{post_id}").text
    assert f"<h1>{title}</h1>" in page and _score(page) == f"{score} points"
    n = _rows(db_path, "SELECT COUNT(*) FROM comments WHERE post_id = ?", [post_id])[0][0]
    assert f"Comments ({n})" in page and page.count('class="comment"') == n
    assert '<ul class="replies">' in page
    assert 'aria-label="Upvote"' in page and 'aria-label="Comment"' not in page
    assert client.get(f"/f/books/{post_id}").status_code == 404  # wrong forum
    assert client.get("/f/bikes/9999").status_code == 404


def test_search_matches_every_word_in_title_or_body(client):
    page = client.get("/search", params={"q": "gravel bikes"}).text
    assert "Showing 1-2 of 2 posts" in page
    assert set(_titles(page)) == {
        "Weekly thread: gravel bikes",
        "Unpopular opinion on gravel bikes",
    }
    assert "No posts found." in client.get("/search", params={"q": "zeppelin"}).text
    assert "Type words in the search box" in client.get("/search?q=").text
    for wildcard in ("%", "_"):
        assert "No posts found." in client.get("/search", params={"q": wildcard}).text


def test_user_page_shows_karma_posts_and_comments(client, db_path):
    karma = _rows(
        db_path,
        "SELECT (SELECT SUM(score) FROM posts WHERE user_id = u.id)"
        " + (SELECT SUM(score) FROM comments WHERE user_id = u.id)"
        " FROM users u WHERE u.username = 'pixel_pilot'",
    )[0][0]
    page = client.get("/user/pixel_pilot").text
    assert "<h1>pixel_pilot</h1>" in page and f"Karma: {karma}" in page
    assert "Posts (13)" in page and "Comments (9)" in page
    assert client.get("/user/nobody").status_code == 404


def test_posting_commenting_and_voting_need_a_login(client, working):
    before = _rows(working, "SELECT COUNT(*), SUM(score) FROM comments")
    for response in [
        client.get("/submit?forum=bikes", follow_redirects=False),
        client.post("/submit", data={"forum": "bikes", "title": "x"}, follow_redirects=False),
        client.post("/f/bikes/1/comment", data={"body": "Hi"}, follow_redirects=False),
        client.post(
            "/vote",
            data={"target": "post", "id": 1, "direction": "up", "next": "/f/bikes/1"},
            follow_redirects=False,
        ),
    ]:
        assert response.status_code == 303
        assert response.headers["location"].startswith("/login?next=")
    assert client.get("/submit?forum=bikes").url.path == "/login"
    assert _rows(working, "SELECT COUNT(*), SUM(score) FROM comments") == before
    assert _rows(working, "SELECT COUNT(*) FROM posts")[0][0] == 150


def test_login_and_logout(client):
    wrong = client.post("/login", data={"username": "agent", "password": "nope"})
    assert wrong.status_code == 401 and "Wrong username or password." in wrong.text
    forged = TestClient(client.app, cookies={SESSION_COOKIE: "agent:forged"})
    assert ">Log in</a>" in forged.get("/").text
    response = client.post(
        "/login", data={**TEST_ACCOUNT, "next": "/f/books"}, follow_redirects=False
    )
    assert response.headers["location"] == "/f/books"
    page = client.get("/").text
    assert '<a href="/user/agent">agent</a>' in page and "Log out" in page
    assert ">Log in</a>" not in client.post("/logout", follow_redirects=False).text
    client.cookies.clear()
    assert ">Log in</a>" in client.get("/").text


def test_commenting_adds_a_comment_by_the_user(agent):
    response = agent.post(
        "/f/bikes/1/comment", data={"body": "  Great   thread! "}, follow_redirects=False
    )
    assert response.headers["location"] == "/f/bikes/1?commented=1"
    page = agent.get(response.headers["location"]).text
    assert "Your comment was posted." in page and "Comments (4)" in page
    assert '<a href="/user/agent">agent</a> · <span class="score">1 point</span>' in page
    assert "Great thread!" in page
    assert "Comments (1)" in agent.get("/user/agent").text
    empty = agent.post("/f/bikes/1/comment", data={"body": " "})
    assert "Comment cannot be empty." in empty.text and "Comments (4)" in empty.text


def test_votes_change_scores_and_toggle(agent, db_path):
    (score,) = _rows(db_path, "SELECT score FROM posts WHERE id = 1")[0]

    def vote(target, target_id, direction):
        data = {"target": target, "id": target_id, "direction": direction, "next": "/f/bikes/1"}
        response = agent.post("/vote", data=data, follow_redirects=False)
        assert response.headers["location"] == "/f/bikes/1"
        return agent.get("/f/bikes/1").text

    page = vote("post", 1, "up")
    assert _score(page) == f"{score + 1} points"
    assert 'aria-label="Upvote" aria-pressed="true"' in page
    assert _score(vote("post", 1, "down")) == f"{score - 1} points"
    page = vote("post", 1, "down")  # the same vote again takes it back
    assert _score(page) == f"{score} points" and 'aria-pressed="true"' not in page
    (comment_score,) = _rows(db_path, "SELECT score FROM comments WHERE id = 1")[0]
    page = vote("comment", 1, "up")
    assert f'<span class="score">{comment_score + 1} point' in page.split('id="comment-1"')[1]
    assert agent.post("/vote", data={"target": "post", "id": 999}).status_code == 404


def test_submitting_a_post(agent):
    form = agent.get("/submit?forum=travel").text
    assert '<option value="travel" selected>' in form
    response = agent.post(
        "/submit",
        data={"forum": "travel", "title": "Night train tips", "body": "Any advice?"},
        follow_redirects=False,
    )
    assert response.headers["location"] == "/f/travel/151?submitted=1"
    page = agent.get(response.headers["location"]).text
    assert "Your post was submitted." in page and "<h1>Night train tips</h1>" in page
    assert "Posted by <a" in page and ">agent</a> in" in page
    newest = agent.get("/f/travel?sort=new").text
    assert _titles(newest)[0] == "Night train tips" and "of 17 posts" in newest
    refused = agent.post("/submit", data={"forum": "travel", "title": "  "})
    assert refused.status_code == 400 and "Title cannot be empty." in refused.text
    assert agent.post("/submit", data={"forum": "boats", "title": "x"}).status_code == 400


def test_site_is_registered_and_resets_quickly():
    spec = SITES["forum"]
    assert (spec.placeholder, spec.login_path) == ("__FORUM__", "/login")
    jar = CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))

    def post(url, data):
        body = urllib.parse.urlencode(data).encode()
        with opener.open(url, data=body, timeout=5) as response:
            return response.read().decode()

    with SiteServer("forum") as server:
        assert "agent" in post(f"{server.url}{spec.login_path}", TEST_ACCOUNT)
        assert "Comments (4)" in post(f"{server.url}/f/bikes/1/comment", {"body": "New one"})
        started = time.perf_counter()
        server.reset()
        assert time.perf_counter() - started < 1.0
        with opener.open(f"{server.url}/f/bikes/1", timeout=5) as response:
            page = response.read().decode()
        assert "Comments (3)" in page and "New one" not in page
        assert '<a href="/user/agent">agent</a>' in page  # the session survives a reset


def test_forum_suite_is_complete_and_mixed():
    tasks = load_suite("forum")
    assert [task.task_id for task in tasks] == list(range(201, 223))
    assert {task.overall_difficulty for task in tasks} == {"easy", "medium", "hard"}
    assert sum(task.horizon >= 5 for task in tasks) >= 6
    writing = [task for task in tasks if "program_html" in task.eval.eval_types]
    assert 4 <= len(writing) <= 6
    for task in tasks:
        assert task.sites == ["forum"] and task.reference_actions[-1].startswith("stop [")
        assert "string_match" in task.eval.eval_types  # so a wrong answer must fail
        writes = "program_html" in task.eval.eval_types
        assert task.require_login == writes and task.require_reset == writes
