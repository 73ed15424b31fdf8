"""The shopping site: seeded data, pages, search, login, cart, checkout and orders, reset, and
its bundled task suite."""

import sqlite3
import time
import urllib.parse
import urllib.request

import pytest
from fastapi.testclient import TestClient

from envs.browser_env import BrowserEnv
from envs.evaluators import evaluate
from envs.server import SITES, SiteServer, SiteServers
from envs.sites.common.accounts import TEST_ACCOUNT
from envs.sites.shopping import build_template_db, create_app
from envs.sites.shopping.app import PAGE_SIZE, SESSION_COOKIE
from envs.sites.shopping.data import CATEGORIES, FIRST_ORDER_ID
from envs.tasks import load_suite

ACCOUNT_ORDERS = [1008, 1005, 1004, 1003, 1002, 1001]
"""The test account's seeded orders, newest first."""


@pytest.fixture(scope="module")
def db_path(tmp_path_factory):
    return build_template_db(tmp_path_factory.mktemp("shopping") / "site.db")


@pytest.fixture()
def client(tmp_path, db_path):
    working = tmp_path / "working.db"
    working.write_bytes(db_path.read_bytes())
    return TestClient(create_app(working))


@pytest.fixture()
def signed_in(client):
    response = client.post("/login", data={**TEST_ACCOUNT, "next": "/"}, follow_redirects=False)
    assert response.status_code == 303 and SESSION_COOKIE in response.cookies
    return client


def _rows(path, sql):
    with sqlite3.connect(path) as db:
        rows = db.execute(sql).fetchall()
    db.close()
    return rows


def test_template_db_has_products_over_8_categories_orders_and_reviews(db_path):
    count, categories = _rows(
        db_path, "SELECT COUNT(*), COUNT(DISTINCT category_id) FROM products"
    )[0]
    assert 80 <= count <= 120 and categories == len(CATEGORIES) == 8
    titles = _rows(db_path, "SELECT COUNT(DISTINCT title), COUNT(*) FROM products")[0]
    assert titles[0] == titles[1]
    assert _rows(db_path, "SELECT COUNT(*) FROM reviews")[0][0] > 200
    orders = _rows(db_path, "SELECT id FROM orders WHERE user_id = 1 ORDER BY placed DESC")
    assert [row[0] for row in orders] == ACCOUNT_ORDERS
    assert _rows(db_path, "SELECT username, password FROM users WHERE id = 1") == [
        (TEST_ACCOUNT["username"], TEST_ACCOUNT["password"])
    ]


def test_template_db_is_deterministic_in_the_seed(tmp_path, db_path):
    again = build_template_db(tmp_path / "again.db", seed=0)
    other = build_template_db(tmp_path / "other.db", seed=1)
    for query in ("SELECT * FROM products ORDER BY id", "SELECT * FROM order_items ORDER BY id"):
        assert _rows(again, query) == _rows(db_path, query)
        assert _rows(other, query) != _rows(db_path, query)
    assert _rows(
        db_path, "SELECT title, price, rating, review_count FROM products WHERE id = 14"
    ) == [("Stars Over Kyoto", 1895, 4.9, 7)]


def test_home_lists_categories_with_counts_and_top_rated(client):
    page = client.get("/").text
    for slug, name, count in CATEGORIES:
        assert f'href="/category/{slug}">{name} ({count})</a>' in page
    assert "Top rated" in page and 'aria-label="Search"' in page
    assert 'href="/login">Sign in</a>' in page and "Sign out" not in page


def test_product_page_shows_price_rating_image_and_reviews(client):
    page = client.get("/product/14").text
    assert "<h1>Stars Over Kyoto</h1>" in page
    for text in [
        "Price: $18.95",
        "Rating: 4.9 out of 5 stars (7 reviews)",
        'href="/category/books">Books</a>',
        'alt="Photo of Stars Over Kyoto"',
        "Reviews (7)",
        "Chris rated it 5 out of 5 on Mar 29, 2024: Five stars.",
        '<button type="submit">Add to cart</button>',
    ]:
        assert text in page
    assert "No reviews yet" in client.get("/product/62").text
    assert client.get("/product/9999").status_code == 404


def test_product_image_is_a_deterministic_png(client):
    first, second = client.get("/image/1.png"), client.get("/image/1.png")
    assert first.headers["content-type"] == "image/png"
    assert first.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert first.content == second.content
    assert first.content != client.get("/image/2.png").content
    assert client.get("/image/9999.png").status_code == 404


def test_category_pages_are_paginated_and_sortable(client):
    first = client.get("/category/electronics").text
    assert "Showing 1-20 of 24 products" in first and "Page 1 of 2" in first
    assert first.count('<a href="/product/') == PAGE_SIZE
    second = client.get("/category/electronics?page=2").text
    assert "Showing 21-24 of 24 products" in second and "Previous page" in second
    cheap = client.get("/category/electronics?sort=price_asc").text
    assert cheap.index("Sonara USB-C charger - $8.99") < cheap.index(
        "Voltix USB-C charger - $15.00"
    )
    dear = client.get("/category/home-kitchen?sort=price_desc").text
    assert dear.index("Ironwood stand mixer - $324.99") < dear.index("Ironwood tea kettle")
    top = client.get("/category/sports-outdoors?sort=rating").text
    assert top.index("Trailpeak camping tent") < top.index("Summit Gear dumbbell set")
    assert client.get("/category/boats").status_code == 404


def test_search_matches_every_word_in_title_or_description(client):
    page = client.get("/search", params={"q": "ground coffee"}).text
    assert "Showing 1-3 of 3 products" in page
    for title in [
        "Harvest Lane ground coffee",
        "Sunny Acres ground coffee",
        "Old Mill ground coffee",
    ]:
        assert title in page
    assert "No products found." in client.get("/search", params={"q": "zeppelin"}).text
    assert "Type words in the search box" in client.get("/search?q=").text
    for wildcard in ("%", "_"):  # LIKE wildcards are searched for literally
        assert "No products found." in client.get("/search", params={"q": wildcard}).text


@pytest.mark.parametrize("path", ["/cart", "/checkout", "/orders", "/orders/1001"])
def test_account_pages_redirect_to_login(client, path):
    response = client.get(path, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"] == "/login?next=" + urllib.parse.quote(path)
    added = client.post("/cart/add", data={"product_id": 14}, follow_redirects=False)
    assert added.headers["location"] == "/login?next=/product/14"
    for form in ("/cart/update", "/cart/remove", "/checkout"):  # a form leads back to the cart
        posted = client.post(form, data={"product_id": 14}, follow_redirects=False)
        assert posted.status_code == 303 and posted.headers["location"] == "/login?next=/cart"


def test_login_rejects_a_wrong_password_and_logout_signs_out(client):
    wrong = client.post("/login", data={"username": "agent", "password": "nope", "next": "/cart"})
    assert "Wrong username or password." in wrong.text and SESSION_COOKIE not in client.cookies
    client.cookies.set(SESSION_COOKIE, "agent.0000")
    assert client.get("/cart", follow_redirects=False).status_code == 303  # forged cookie
    client.cookies.clear()
    page = client.post("/login", data={**TEST_ACCOUNT, "next": "/cart"}).text
    assert "<h1>Shopping cart</h1>" in page and "Signed in as Avery Agent" in page
    assert "Cart (3)" in page
    offsite = client.post("/login", data={**TEST_ACCOUNT, "next": "//evil.example/"})
    assert offsite.url.path == "/"
    assert "Sign in</a>" in client.post("/logout").text
    assert client.get("/orders", follow_redirects=False).status_code == 303


def test_cart_add_change_quantity_and_remove(signed_in):
    page = signed_in.get("/cart").text
    assert "Playfield kite" in page and "quantity 2, subtotal $437.90" in page
    assert "Total: $457.89" in page
    page = signed_in.post("/cart/add", data={"product_id": 75, "quantity": 2}).text
    assert "Added Wonderbox chess set to your cart." in page
    assert "quantity 2, subtotal $60.00" in page and "Total: $517.89" in page
    page = signed_in.post("/cart/add", data={"product_id": 75, "quantity": 1}).text
    assert "quantity 3, subtotal $90.00" in page
    page = signed_in.post("/cart/update", data={"product_id": 31, "quantity": 3}).text
    assert "Your cart was updated." in page and "quantity 3, subtotal $59.97" in page
    page = signed_in.post("/cart/remove", data={"product_id": 76}).text
    assert "Sonara smartwatch" not in page and "Total: $149.97" in page
    page = signed_in.post("/cart/update", data={"product_id": 31, "quantity": 0}).text
    assert "Playfield kite" not in page and "Cart (3)" in page
    assert signed_in.post("/cart/add", data={"product_id": 9999}).status_code == 404


def test_checkout_places_an_order_and_empties_the_cart(signed_in):
    form = signed_in.get("/checkout").text
    assert 'value="4200 Fifth Avenue"' in form and "Total: $457.89" in form
    incomplete = signed_in.post("/checkout", data={"name": "Dana Smith"})
    assert "Please fill in every shipping field." in incomplete.text
    shipping = {
        "name": "Dana Smith",
        "address": "12 Elm Street",
        "city": "Columbus",
        "zip": "43004",
    }
    response = signed_in.post("/checkout", data=shipping, follow_redirects=False)
    new_id = FIRST_ORDER_ID + 8
    assert response.headers["location"] == f"/orders/{new_id}?placed=1"
    page = signed_in.get(response.headers["location"]).text
    assert f"Thank you! Your order #{new_id} was placed." in page
    assert "Ship to: Dana Smith, 12 Elm Street, Columbus 43004" in page
    assert "Status: Processing" in page and "Total: $457.89" in page
    assert "Your cart is empty." in signed_in.get("/cart").text
    assert "Cart (0)" in signed_in.get("/").text
    empty = signed_in.get("/checkout")
    assert "Your cart is empty: add products before checking out." in empty.text
    orders = signed_in.get("/orders").text
    assert orders.index(f"Order #{new_id}") < orders.index("Order #1008")


def test_order_history_shows_only_the_accounts_orders(signed_in):
    page = signed_in.get("/orders").text
    numbers = [int(part.split("<")[0]) for part in page.split("Order #")[1:]]
    assert numbers == ACCOUNT_ORDERS
    assert "Placed on Mar 25, 2024, Shipped, total $308.31" in page
    detail = signed_in.get("/orders/1004").text
    assert "Ship to: Avery Agent, 77 Market Street, Philadelphia 19106" in detail
    assert "Auralis mechanical keyboard" in detail and "quantity 3, subtotal $466.47" in detail
    assert signed_in.get("/orders/1006").status_code == 404  # another account's order


def _fetch(url, data=None, headers=None):
    body = urllib.parse.urlencode(data).encode() if data else None
    request = urllib.request.Request(url, data=body, headers=headers or {})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


def test_site_server_resets_the_shopping_db_quickly():
    assert SITES["shopping"].placeholder == "__SHOPPING__"
    assert SITES["shopping"].login_path == "/login"
    with SiteServer("shopping") as server:
        cookie = {"Cookie": f"{SESSION_COOKIE}=agent.{'0' * 32}"}
        assert "Sign in" in _fetch(f"{server.url}/login", headers=cookie)
        with sqlite3.connect(server.db_path) as db:
            db.execute("DELETE FROM cart_items")
            db.execute("DELETE FROM orders")
        db.close()
        started = time.perf_counter()
        server.reset()
        assert time.perf_counter() - started < 1.0
        assert _rows(server.db_path, "SELECT COUNT(*) FROM cart_items") == [(2,)]
        assert _rows(server.db_path, "SELECT COUNT(*) FROM orders") == [(8,)]
        assert "Welcome to One Stop Shop" in _fetch(f"{server.url}/")


def test_site_servers_substitute_the_shopping_placeholder():
    with SiteServers(["shopping"]) as sites:
        base = sites.url("shopping")
        assert sites.substitute("__SHOPPING__/cart") == f"{base}/cart"
        assert "Stars Over Kyoto" in _fetch(sites.substitute("__SHOPPING__/product/14"))


def test_bundled_shopping_suite_is_complete_and_mixed():
    tasks = load_suite("shopping")
    assert [task.task_id for task in tasks] == list(range(101, 123))
    assert {task.overall_difficulty for task in tasks} == {"easy", "medium", "hard"}
    assert sum(task.horizon >= 5 for task in tasks) >= 6
    assert any("url_match" in task.eval.eval_types for task in tasks)
    with_html = [task for task in tasks if "program_html" in task.eval.eval_types]
    assert 4 <= len(with_html) <= 6
    assert all(task.require_login and task.require_reset for task in with_html)
    assert sum(task.require_login for task in tasks) >= 8
    for task in tasks:
        assert task.sites == ["shopping"]
        assert task.reference_actions[-1].startswith("stop [")
        assert "string_match" in task.eval.eval_types  # so a wrong answer must fail


@pytest.mark.browser
def test_program_html_tasks_fail_when_the_site_state_is_not_changed():
    """Answering right without adding, removing or ordering anything scores 0."""
    tasks = [task for task in load_suite("shopping") if "program_html" in task.eval.eval_types]
    with SiteServers(["shopping"]) as sites, BrowserEnv(sites, screenshots=False) as env:
        for task in tasks:
            env.reset(task)
            result = env.step(task.reference_actions[-1])
            verdict = evaluate(task, result.answer, env.url, env.servers, env.read_page)
            assert verdict.details["string_match"]["score"] == 1.0, task.task_id
            assert verdict.score == 0.0, task.task_id
