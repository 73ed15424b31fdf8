"""The shopping web application: FastAPI routes over a SQLite database, Jinja2 pages.

Pages (all HTML, at most PAGE_SIZE products each so the accessibility tree stays short):

- `GET /` — categories with counts and the top-rated products
- `GET /category/{slug}?sort=&page=` — one category; sort is `newest`, `price_asc`,
  `price_desc` or `rating`
- `GET /search?q=&sort=&page=` — products whose title or description contains every word of q
- `GET /product/{id}` — one product with its photo, price, rating, description, reviews and
  an "Add to cart" form
- `GET /image/{id}.png` — the product photo (see `images.py`)
- `GET /login?next=`, `POST /login` (form fields `username`, `password`, `next`) — signs in
  (a signed cookie, SESSION_COOKIE) and 303 to `next`; the form is shown even when signed in
- `POST /logout` — signs out, 303 to the home page

Signed in only (otherwise 303 to `/login?next=<the page>`):

- `POST /cart/add` (`product_id`, `quantity`) — adds to the cart, 303 to `/cart?added=<id>`
- `GET /cart`; `POST /cart/update` (`product_id`, `quantity`; 0 removes);
  `POST /cart/remove` (`product_id`)
- `GET /checkout` — the cart and a shipping form prefilled with the account's address;
  `POST /checkout` (`name`, `address`, `city`, `zip`) — places the order, empties the cart,
  303 to `/orders/{id}?placed=1`
- `GET /orders` — the account's orders, newest first; `GET /orders/{id}` — one order
"""

import hmac
import sqlite3
from pathlib import Path
from typing import Annotated
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from envs.sites.common.accounts import SessionCookie, login_redirect, safe_next
from envs.sites.common.web import (
    PAGE_SIZE,
    Pages,
    add_category_routes,
    add_picture_route,
    create_site_app,
    money_cents,
    sql_page,
)
from envs.sites.shopping.data import SITE_TODAY
from envs.sites.shopping.images import render_product_image

__all__ = ["PAGE_SIZE", "SESSION_COOKIE", "create_app"]

TOP_RATED_COUNT = 8
"""Products shown under "Top rated" on the home page."""
MAX_QUANTITY = 99
"""The most of one product a cart line may hold."""
SORTS = {
    "newest": ("Newest first", "p.added DESC, p.id DESC"),
    "price_asc": ("Price: low to high", "p.price ASC, p.id ASC"),
    "price_desc": ("Price: high to low", "p.price DESC, p.id ASC"),
    "rating": ("Top rated", "p.rating IS NULL, p.rating DESC, p.review_count DESC, p.id ASC"),
}
"""sort parameter -> (link text, SQL ORDER BY clause)."""
SESSION_COOKIE = "shop_session"
"""Cookie holding "<username>.<HMAC>" of the signed-in user."""
_SESSION = SessionCookie(SESSION_COOKIE, b"agent-kv-shopping-site", ".", digest_chars=32)
"""Signs session cookies with a fixed secret, so a cookie stays valid across resets."""

_HERE = Path(__file__).parent
_PRODUCT_COLUMNS = (
    "p.id, p.title, p.brand, p.price, p.description, p.colour, p.added, p.rating,"
    " p.review_count, c.slug AS category_slug, c.name AS category_name"
)
_NAV = "SELECT slug, name FROM categories ORDER BY id"
_PRODUCT_JOIN = "products p JOIN categories c ON c.id = p.category_id"


def _stars(rating: float | None, count: int) -> str:
    """A product's rating as shown on the site: '4.2 out of 5 stars (6 reviews)'."""
    if not count:
        return "No reviews yet"
    noun = "review" if count == 1 else "reviews"
    return f"{rating:.1f} out of 5 stars ({count} {noun})"


def _page_of(db, where: str, params: list, sort: str, page: int) -> dict:
    """One page of products matching `where`: {products, page, pages, total, first, last}."""
    order = SORTS.get(sort, SORTS["newest"])[1]
    select = f"{_PRODUCT_COLUMNS} FROM {_PRODUCT_JOIN}"
    return sql_page(db, "products", select, where, params, order, page)


def _cart(db: sqlite3.Connection, user_id: int) -> tuple[list[sqlite3.Row], int]:
    """The user's cart lines (product columns plus `quantity`, `subtotal`) and total in cents."""
    rows = db.execute(
        "SELECT p.id, p.title, p.price, ci.quantity, p.price * ci.quantity AS subtotal"
        " FROM cart_items ci JOIN products p ON p.id = ci.product_id"
        " WHERE ci.user_id = ? ORDER BY p.title",
        [user_id],
    ).fetchall()
    return rows, sum(row["subtotal"] for row in rows)


def _with_account(request: Request, db: sqlite3.Connection, ctx: dict) -> dict:
    """Page context plus the signed-in `user` (given or from the cookie) and `cart_count`."""
    user = ctx.pop("user", None) or _SESSION.current_user(request, db)
    cart_count = 0
    if user is not None:
        cart_count = db.execute(
            "SELECT COALESCE(SUM(quantity), 0) FROM cart_items WHERE user_id = ?", [user["id"]]
        ).fetchone()[0]
    return {"user": user, "cart_count": cart_count, **ctx}


def _remove_from_cart(db: sqlite3.Connection, user_id: int, product_id: int) -> None:
    """Delete one product's line from a user's cart (no-op when absent)."""
    db.execute("DELETE FROM cart_items WHERE user_id = ? AND product_id = ?", [user_id, product_id])


class SignInNeeded(Exception):
    """Raised by a route's user dependency when nobody is signed in; answered with a 303 to the
    login page that leads back to `target`."""

    def __init__(self, target: str):
        super().__init__(target)
        self.target = target


def create_app(db_path: str | Path) -> FastAPI:
    """The shopping FastAPI app reading and writing the SQLite file at `db_path`.

    Each request opens its own connection, so the file may be replaced between requests
    (that is how `envs.server.SiteServer.reset` restores the template).
    """
    pages = Pages(_NAV, SORTS, _page_of, {"money": money_cents}, _with_account)
    app, Db = create_site_app("Shopping", _HERE, db_path, pages)
    pages.templates.env.globals["stars"] = _stars
    render, not_found = pages.render, pages.not_found
    current_user = _SESSION.current_user

    @app.exception_handler(SignInNeeded)
    def sign_in_first(request: Request, exc: SignInNeeded) -> RedirectResponse:
        return login_redirect(exc.target)

    def signed_in_user(request: Request, db: Db) -> sqlite3.Row:
        """The signed-in user; without one the route answers with a 303 to the login page,
        which leads back to the page asked for (after a form: to the cart)."""
        user = current_user(request, db)
        if user is None:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            raise SignInNeeded(target if request.method == "GET" else "/cart")
        return user

    User = Annotated[sqlite3.Row, Depends(signed_in_user)]

    @app.get("/", response_class=HTMLResponse)
    def home(request: Request, db: Db):
        categories = db.execute(
            "SELECT c.slug, c.name, COUNT(p.id) AS n FROM categories c"
            " LEFT JOIN products p ON p.category_id = c.id GROUP BY c.id ORDER BY c.id"
        ).fetchall()
        top = db.execute(
            f"SELECT {_PRODUCT_COLUMNS} FROM {_PRODUCT_JOIN} WHERE p.review_count >= 3"
            f" ORDER BY {SORTS['rating'][1]} LIMIT ?",
            [TOP_RATED_COUNT],
        ).fetchall()
        return render(request, db, "home.html", title="Home", categories=categories, top=top)

    add_category_routes(app, pages, Db, "p.category_id = ?", ("p.title", "p.description"))

    @app.get("/product/{product_id}", response_class=HTMLResponse)
    def product(request: Request, db: Db, product_id: int):
        row = db.execute(
            f"SELECT {_PRODUCT_COLUMNS} FROM {_PRODUCT_JOIN} WHERE p.id = ?", [product_id]
        ).fetchone()
        if row is None:
            return not_found(request, db, "Product")
        reviews = db.execute(
            "SELECT author, rating, title, body, posted FROM reviews WHERE product_id = ?"
            " ORDER BY posted DESC, id DESC",
            [product_id],
        ).fetchall()
        return render(request, db, "product.html", title=row["title"], product=row, reviews=reviews)

    add_picture_route(app, Db, "products", render_product_image)

    @app.get("/login", response_class=HTMLResponse)
    def login_form(request: Request, db: Db, next: str = "/", error: int = 0):
        return render(
            request,
            db,
            "login.html",
            title="Sign in",
            next=safe_next(next),
            error="Wrong username or password." if error else "",
        )

    @app.post("/login")
    def login(
        db: Db,
        username: Annotated[str, Form()] = "",
        password: Annotated[str, Form()] = "",
        next: Annotated[str, Form()] = "/",
    ):
        row = db.execute("SELECT password FROM users WHERE username = ?", [username]).fetchone()
        target = safe_next(next)
        if row is None or not hmac.compare_digest(row["password"], password):
            return RedirectResponse(f"/login?{urlencode({'next': target, 'error': 1})}", 303)
        return _SESSION.signed_in(username, target)

    _SESSION.add_logout_route(app)

    @app.post("/cart/add")
    def cart_add(
        request: Request,
        db: Db,
        product_id: Annotated[int, Form()],
        quantity: Annotated[int, Form()] = 1,
    ):
        user = current_user(request, db)
        if user is None:
            return login_redirect(f"/product/{product_id}")
        if db.execute("SELECT 1 FROM products WHERE id = ?", [product_id]).fetchone() is None:
            return not_found(request, db, "Product")
        quantity = min(max(1, quantity), MAX_QUANTITY)
        with db:
            db.execute(
                "INSERT INTO cart_items (user_id, product_id, quantity) VALUES (?, ?, ?)"
                " ON CONFLICT (user_id, product_id)"
                f" DO UPDATE SET quantity = MIN(quantity + excluded.quantity, {MAX_QUANTITY})",
                [user["id"], product_id, quantity],
            )
        return RedirectResponse(f"/cart?added={product_id}", status_code=303)

    @app.get("/cart", response_class=HTMLResponse)
    def cart(
        request: Request, db: Db, user: User, added: int = 0, updated: int = 0, empty: int = 0
    ):
        lines, total = _cart(db, user["id"])
        message = ""
        if added:
            row = db.execute("SELECT title FROM products WHERE id = ?", [added]).fetchone()
            message = f"Added {row['title']} to your cart." if row else ""
        elif updated:
            message = "Your cart was updated."
        return render(
            request,
            db,
            "cart.html",
            title="Cart",
            user=user,
            lines=lines,
            total=total,
            message=message,
            error="Your cart is empty: add products before checking out." if empty else "",
        )

    @app.post("/cart/update")
    def cart_update(
        db: Db,
        user: User,
        product_id: Annotated[int, Form()],
        quantity: Annotated[int, Form()] = 1,
    ):
        with db:
            if quantity <= 0:
                _remove_from_cart(db, user["id"], product_id)
            else:
                db.execute(
                    "UPDATE cart_items SET quantity = ? WHERE user_id = ? AND product_id = ?",
                    [min(quantity, MAX_QUANTITY), user["id"], product_id],
                )
        return RedirectResponse("/cart?updated=1", status_code=303)

    @app.post("/cart/remove")
    def cart_remove(db: Db, user: User, product_id: Annotated[int, Form()]):
        with db:
            _remove_from_cart(db, user["id"], product_id)
        return RedirectResponse("/cart?updated=1", status_code=303)

    @app.get("/checkout", response_class=HTMLResponse)
    def checkout_form(request: Request, db: Db, user: User, error: int = 0):
        lines, total = _cart(db, user["id"])
        if not lines:
            return RedirectResponse("/cart?empty=1", status_code=303)
        return render(
            request,
            db,
            "checkout.html",
            title="Checkout",
            user=user,
            lines=lines,
            total=total,
            error="Please fill in every shipping field." if error else "",
        )

    @app.post("/checkout")
    def checkout(
        request: Request,
        db: Db,
        user: User,
        name: Annotated[str, Form()] = "",
        address: Annotated[str, Form()] = "",
        city: Annotated[str, Form()] = "",
        zip: Annotated[str, Form()] = "",
    ):
        lines, total = _cart(db, user["id"])
        if not lines:
            return RedirectResponse("/cart?empty=1", status_code=303)
        ship = [" ".join(value.split())[:100] for value in (name, address, city, zip)]
        if not all(ship):
            return RedirectResponse("/checkout?error=1", status_code=303)
        with db:
            cursor = db.execute(
                "INSERT INTO orders (user_id, placed, status, ship_name, ship_address,"
                " ship_city, ship_zip, total) VALUES (?, ?, 'Processing', ?, ?, ?, ?, ?)",
                [user["id"], SITE_TODAY.isoformat(), *ship, total],
            )
            order_id = cursor.lastrowid
            db.executemany(
                "INSERT INTO order_items (order_id, product_id, title, price, quantity)"
                " VALUES (?, ?, ?, ?, ?)",
                [(order_id, ln["id"], ln["title"], ln["price"], ln["quantity"]) for ln in lines],
            )
            db.execute("DELETE FROM cart_items WHERE user_id = ?", [user["id"]])
        return RedirectResponse(f"/orders/{order_id}?placed=1", status_code=303)

    @app.get("/orders", response_class=HTMLResponse)
    def orders(request: Request, db: Db, user: User):
        rows = db.execute(
            "SELECT id, placed, status, total FROM orders WHERE user_id = ?"
            " ORDER BY placed DESC, id DESC",
            [user["id"]],
        ).fetchall()
        return render(request, db, "orders.html", title="My orders", user=user, orders=rows)

    @app.get("/orders/{order_id}", response_class=HTMLResponse)
    def order(request: Request, db: Db, user: User, order_id: int, placed: int = 0):
        row = db.execute(
            "SELECT * FROM orders WHERE id = ? AND user_id = ?", [order_id, user["id"]]
        ).fetchone()
        if row is None:
            return not_found(request, db, "Order")
        items = db.execute(
            "SELECT product_id, title, price, quantity, price * quantity AS subtotal"
            " FROM order_items WHERE order_id = ? ORDER BY id",
            [order_id],
        ).fetchall()
        return render(
            request,
            db,
            "order.html",
            title=f"Order #{order_id}",
            user=user,
            order=row,
            items=items,
            placed=bool(placed),
        )

    return app
