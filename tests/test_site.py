"""The classifieds site: seeded data, pages, search, comments, and the in-process server."""

import sqlite3
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from fastapi.testclient import TestClient

from envs.server import SITES, SiteServer, SiteServers
from envs.sites.classifieds import build_template_db, create_app
from envs.sites.classifieds.app import PAGE_SIZE
from envs.sites.classifieds.data import CATEGORIES


@pytest.fixture(scope="module")
def db_path(tmp_path_factory):
    return build_template_db(tmp_path_factory.mktemp("classifieds") / "site.db")


@pytest.fixture()
def client(tmp_path, db_path):
    working = tmp_path / "working.db"
    working.write_bytes(db_path.read_bytes())
    return TestClient(create_app(working))


def _rows(path, sql):
    with sqlite3.connect(path) as db:
        rows = db.execute(sql).fetchall()
    db.close()
    return rows


def test_template_db_has_at_least_100_listings_over_5_categories(db_path):
    listings = _rows(db_path, "SELECT COUNT(*), COUNT(DISTINCT category_id) FROM listings")
    assert listings[0][0] >= 100 and listings[0][1] >= 5
    titles = _rows(db_path, "SELECT COUNT(DISTINCT title), COUNT(*) FROM listings")[0]
    assert titles[0] == titles[1]


def test_template_db_is_deterministic_in_the_seed(tmp_path, db_path):
    again = build_template_db(tmp_path / "again.db", seed=0)
    other = build_template_db(tmp_path / "other.db", seed=1)
    query = "SELECT * FROM listings ORDER BY id"
    assert _rows(again, query) == _rows(db_path, query)
    assert _rows(other, query) != _rows(db_path, query)
    assert _rows(db_path, "SELECT title, price, location, posted FROM listings WHERE id = 1") == [
        ("Blue road bike", 120, "Pittsburgh, PA", "2024-03-28")
    ]


def test_home_lists_categories_with_counts_and_recent_listings(client):
    page = client.get("/").text
    for slug, name, count in CATEGORIES:
        assert f'href="/category/{slug}">{name} ({count})</a>' in page
    assert "Recent listings" in page
    assert 'aria-label="Search"' in page


def test_listing_page_shows_details_image_and_comments(client):
    page = client.get("/listing/1").text
    assert "<h1>Blue road bike</h1>" in page
    for text in [
        "Price: $120",
        "Maria Lopez",
        "Location: Pittsburgh, PA",
        "Posted on Mar 28, 2024",
    ]:
        assert text in page
    assert 'alt="Photo of Blue road bike"' in page
    assert "Comments (1)" in page and "Riley on Mar 17, 2024: Is this still available?" in page
    assert client.get("/listing/9999").status_code == 404


def test_listing_image_is_a_deterministic_png(client):
    first, second = client.get("/image/1.png"), client.get("/image/1.png")
    assert first.headers["content-type"] == "image/png"
    assert first.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert first.content == second.content
    assert first.content != client.get("/image/2.png").content
    assert client.get("/image/9999.png").status_code == 404


def test_category_pages_are_paginated_and_sortable(client):
    first = client.get("/category/bikes").text
    assert "Showing 1-20 of 24 listings" in first and "Page 1 of 2" in first
    assert first.count('<a href="/listing/') == PAGE_SIZE
    second = client.get("/category/bikes?page=2").text
    assert "Showing 21-24 of 24 listings" in second and "Previous page" in second
    cheapest = client.get("/category/bikes?sort=price_asc").text
    assert cheapest.index("Silver bike helmet - $20") < cheapest.index("Blue road bike - $120")
    dearest = client.get("/category/bikes?sort=price_desc").text
    assert dearest.index("Blue electric bike - $1,000") < dearest.index("Black road bike - $780")
    assert client.get("/category/boats").status_code == 404


def test_search_matches_every_word_in_title_or_description(client):
    page = client.get("/search", params={"q": "road bike"}).text
    assert "Showing 1-4 of 4 listings" in page
    for title in ["Blue road bike", "Black road bike", "Silver road bike", "Green road bike"]:
        assert title in page
    assert "No listings found." in client.get("/search", params={"q": "zeppelin"}).text
    assert "Type words in the search box" in client.get("/search?q=").text
    for wildcard in ("%", "_"):  # LIKE wildcards are searched for literally
        assert "No listings found." in client.get("/search", params={"q": wildcard}).text


def test_posting_a_comment_persists_and_redirects(client):
    response = client.post(
        "/listing/1/comments",
        data={"author": "Ana", "body": "Still for sale?"},
        follow_redirects=False,
    )
    assert response.status_code == 303
    assert response.headers["location"] == "/listing/1?posted=1"
    page = client.get(response.headers["location"]).text
    assert "Your comment was posted." in page
    assert "Comments (2)" in page and "Ana on Apr 1, 2024: Still for sale?" in page
    anonymous = client.post("/listing/1/comments", data={"body": "Hi"}, follow_redirects=True)
    assert "Guest on Apr 1, 2024: Hi" in anonymous.text


def test_empty_comment_is_refused(client):
    response = client.post("/listing/1/comments", data={"body": "   "}, follow_redirects=True)
    assert "Comment cannot be empty." in response.text
    assert "Comments (1)" in response.text


def _fetch(url, data=None):
    body = urllib.parse.urlencode(data).encode() if data else None
    with urllib.request.urlopen(url, data=body, timeout=5) as response:
        return response.read().decode()


def test_site_server_serves_resets_and_closes():
    with SiteServer("classifieds") as server:
        assert server.url.startswith("http://127.0.0.1:")
        _fetch(f"{server.url}/listing/1/comments", {"body": "A new comment"})
        assert "Comments (2)" in _fetch(f"{server.url}/listing/1")
        started = time.perf_counter()
        server.reset()
        assert time.perf_counter() - started < 1.0
        page = _fetch(f"{server.url}/listing/1")
        assert "Comments (1)" in page and "A new comment" not in page
        url = server.url
    with pytest.raises(urllib.error.URLError):
        _fetch(url)


def test_site_servers_substitute_placeholders_and_check_ownership():
    assert SITES["classifieds"].placeholder == "__CLASSIFIEDS__"
    with SiteServers(["classifieds"]) as sites:
        base = sites.url("classifieds")
        assert sites.urls == {"classifieds": base}
        assert sites.substitute("__CLASSIFIEDS__/search?q=x") == f"{base}/search?q=x"
        assert sites.owns(f"{base}/listing/1") and sites.owns(base)
        assert not sites.owns("http://example.com/") and not sites.owns(f"{base}9/")
        assert "Welcome to Classifieds" in _fetch(sites.substitute("__CLASSIFIEDS__/"))
        with pytest.raises(KeyError, match="not served"):
            sites.reset(["shopping"])
    with pytest.raises(KeyError, match="unknown site 'gitlab'"):
        SiteServers(["gitlab"])
